#!/bin/bash
# The GPU presets' main jobs with --cuda-graph step (tests/test_gpu_graphed_presets.py), on cold Triton
# and inductor caches, as on a fresh machine, and the CUDA-graph capture tests:
#   source .device/setup.sh; bash benchmarks/run_graphed_presets_device.sh [one] [torchrun] [capture]
# one: the one-GPU jobs (each on a GPU of its own where there are three; two and one on GPUs 0 and 1
# where there are two); torchrun: the jobs under torchrun over every GPU (up to 4; needs 2),
# torchrun=PRESET just that preset's; capture: tests/test_cuda_graph.py's GPU tests. No part
# named: all three. Run folders under /dev/shm (a job's last checkpoint of ~30 GB is written in
# seconds there). Logs in $OUT; each job's summary line last.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpus.txt" | wc -l)
tests() {  # tests NAME ARGS...: pytest -v -s, its log $OUT/NAME.log, its run folders under /dev/shm/NAME
  local name=$1 start=$(date +%s); shift
  python -m pytest -v -s -p no:cacheprovider -W ignore --basetemp "/dev/shm/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "$name: pytest exit $? in $(( $(date +%s) - start )) s"
  rm -rf "/dev/shm/$name"
}
one=tests/test_gpu_graphed_presets.py::test_a_graphed_preset_trains_on_one_gpu
for part in ${@:-one torchrun capture}; do
  case $part in
    one) if [ "$gpus" -ge 3 ]; then
           CUDA_VISIBLE_DEVICES=0 tests one-gpu-a "$one[qwen3-moe-medium]" &
           CUDA_VISIBLE_DEVICES=1 tests one-gpu-b "$one[deepseek-v3-medium]" &
           CUDA_VISIBLE_DEVICES=2 tests one-gpu-c "$one[gpt-oss-medium]" &
           wait
         elif [ "$gpus" -ge 2 ]; then
           CUDA_VISIBLE_DEVICES=0 tests one-gpu-a "$one[qwen3-moe-medium]" "$one[gpt-oss-medium]" &
           CUDA_VISIBLE_DEVICES=1 tests one-gpu-b "$one[deepseek-v3-medium]" &
           wait
         else
           tests one-gpu "$one"
         fi ;;
    torchrun) tests torchrun tests/test_gpu_graphed_presets.py -k torchrun ;;
    torchrun=*) tests "torchrun-${part#torchrun=}" tests/test_gpu_graphed_presets.py -k "torchrun and ${part#torchrun=}" ;;
    capture) tests capture tests/test_cuda_graph.py -m gpu ;;
    *) echo "unknown part $part (one, torchrun, torchrun=PRESET, capture)"; exit 2 ;;
  esac
done
grep -hE "^(FAILED|ERROR) " "$OUT"/*.log | head -20
grep -h ": done in" "$OUT"/*.log
