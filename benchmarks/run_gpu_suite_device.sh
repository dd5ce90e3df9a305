#!/bin/bash
# The whole GPU test suite (`pytest -m gpu`) in parts that each fit one device command (600 s):
#   source .device/setup.sh; bash benchmarks/run_gpu_suite_device.sh 1      (then 2, 3, 4 in later calls)
# (FMOE_TE=1 source .device/setup.sh for part 4's TransformerEngine tests.)
# Each part is one pytest process in the suite's own order, on cold Triton and inductor caches
# (fresh folders, as on a fresh machine), so an order-dependent failure shows as it would in one
# whole run: part 1 is the suite's prefix up to and past the CUDA-graph tests (tests/dist,
# compile, cuda_graph), nothing left out before them. A CUDA error that poisons the process
# (an illegal memory access) fails every later test of its part only. Log: $OUT/gpu_suite_<part>.log;
# last, the count of each outcome per file. Sized for one GPU (nvidia-h200 / -h100-x1): on two, the NCCL
# tests of tests/dist and test_gpu_parallel_dims run too, and part 1 may not fit (LIMIT_S, or fewer files).
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
part=${1:?"usage: run_gpu_suite_device.sh 1|2|3|4"}
case "$part" in
  1) files="tests/dist tests/test_compile.py tests/test_cuda_graph.py tests/test_fp8.py tests/test_gpu.py
            tests/test_gpu_finetune.py tests/test_gpu_glm.py" ;;
  2) files="tests/test_gpu_kernels.py tests/test_gpu_mla.py tests/test_gpu_parallel_dims.py" ;;
  3) files="tests/test_gpu_sinks_window.py tests/test_peer.py" ;;
  4) files="tests/test_remat.py tests/test_te.py tests/test_trainer.py" ;;
  *) echo "part must be 1, 2, 3 or 4, got '$part'" >&2; exit 2 ;;
esac
TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
export TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
timeout ${LIMIT_S:-540} python -m pytest -v -m gpu -p no:cacheprovider -W ignore $files > "$OUT/gpu_suite_$part.log" 2>&1
rc=$?
echo "part $part: pytest exit $rc ($([ $rc = 124 ] && echo 'cut at the time limit' || echo 'finished')) in $(( $(date +%s) - start )) s"
grep -E "::.* (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/gpu_suite_$part.log" | sed -E 's/::[^ ]* / /; s/ +\[.*//' | sort | uniq -c
grep -E "^(FAILED|ERROR) " "$OUT/gpu_suite_$part.log" | head -10
tail -1 "$OUT/gpu_suite_$part.log"
