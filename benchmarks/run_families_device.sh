#!/bin/bash
# One device command per stage for issue 39's families (DeepSeek-V3's MLA, GLM-4.5, GPT-OSS):
#   source .device/setup.sh; bash benchmarks/run_families_device.sh STAGE
# STAGE: tests-a | tests-b (the GPU tests of the new attention kinds, in two parts under the
# 10-minute limit), kernels (the attention paths), profile (each preset's top kernels), peers (fmoe against its compiled peer per
# preset, qwen3-moe-medium as the baseline in the same run). Logs under $OUT; a table last.
set -o pipefail
STAGE=${1:?usage: run_families_device.sh tests-a|tests-b|kernels|profile|peers}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
case "$STAGE" in
  tests-a)
    python -m pytest -q -rs -p no:cacheprovider -W ignore tests/test_gpu_mla.py tests/test_peer.py \
      tests/test_gpu_sinks_window.py -k "not plain_rows_take_flex" -m gpu 2>&1 \
      | tee "$OUT/tests-a.log" | tail -15 ;;
  tests-b)
    python -m pytest -q -rs -p no:cacheprovider -W ignore \
      tests/test_gpu_sinks_window.py::test_plain_rows_take_flex_and_match_the_reference \
      tests/test_gpu_glm.py tests/test_gpu_finetune.py -m gpu 2>&1 | tee "$OUT/tests-b.log" | tail -15 ;;
  kernels)
    python benchmarks/attention_paths.py 2>&1 | tee "$OUT/attention_paths.log"
    python benchmarks/attention_paths.py --case mla --seq 8192 --batch 1 2>&1 | tee -a "$OUT/attention_paths.log" ;;
  profile)  # where each preset's compiled step spends its GPU time, one trace per preset
    python benchmarks/step_profile.py --shapes ${SHAPES:-qwen3-moe-medium glm4.5-medium} --top 30 \
      --trace "$OUT/traces" 2>&1 | tee "$OUT/profile.log" | grep -v "^W1\|Warning" ;;
  peers)
    python benchmarks/vs_peer.py --shapes ${SHAPES:-qwen3-moe-medium glm4.5-medium gpt-oss-medium deepseek-v3-medium} \
      --peers compiled ${PEER_FLAGS:-} 2>&1 | tee "$OUT/vs_peer.log" | grep -v "^W1\|Warning" | tail -60 ;;
esac
