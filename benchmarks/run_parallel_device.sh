#!/bin/bash
# One device command per stage for issue 40 (tensor, expert-tensor and context parallelism):
#   source .device/setup.sh; bash benchmarks/run_parallel_device.sh STAGE [SHAPE]
# STAGE: tests (the 2-GPU tests: tp, cp, etp on NCCL against one GPU, eager, compiled and
# FP8), bench SHAPE (the one-GPU step of the code before these dimensions against today's,
# on GPU 0: fmoe eager, compiled and step-graphed, no peer). "Before" is the tree of
# commit 10c9b09 in .baseline/ (git archive 10c9b09 fmoe interop benchmarks | tar -x -C
# .baseline), carried with the working tree. Logs under $OUT; a table last.
set -o pipefail
STAGE=${1:?usage: run_parallel_device.sh tests|bench SHAPE}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
case "$STAGE" in
  tests)
    python -m pytest -q -rs -p no:cacheprovider -W ignore tests/test_gpu_parallel_dims.py -m gpu 2>&1 \
      | tee "$OUT/tests.log" | tail -25 ;;
  bench)
    SHAPE=${2:-coarse}
    for who in before after; do
      if [ "$who" = before ]; then root=.baseline; else root=.; fi
      CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$PWD/$root:$PYTHONPATH" python "$root/benchmarks/vs_peer.py" \
        --shape "$SHAPE" --peers ${BENCH_FLAGS:-} 2>&1 | tee "$OUT/$SHAPE-$who.log" | grep -v "^W1\|Warning" | tail -12
    done ;;
esac
