#!/bin/bash
# One device command for issue 41 (pipeline parallelism and the planner), on 2 GPUs:
#   source .device/setup.sh; bash benchmarks/run_pipeline_device.sh [calibrate|check|tests ...]
# calibrate: plan_calibration.py on the first GPU (coarse, fine, qwen3-moe-medium; 8 x 2048 tokens,
# 2 microbatches) writes $OUT/calibration.json and holds the planner against those steps;
# calibrate-mb4: that calibration against steps it was not measured on (one GPU, 4 microbatches).
# check: pp=2 on both GPUs (16 x 2048 tokens, 8 microbatches; standard, 1f1b_overlap, 2 virtual stages)
# against the planner's estimate with that calibration. tests: the 2-GPU tests (tp, cp,
# etp, pp on NCCL against one GPU; tests-pp: only pp's). Runs on the GPUs
# CUDA_VISIBLE_DEVICES names (GPUs 0 and 1 when unset); check's shapes from $SHAPES (default
# coarse fine), its calibration from $CAL (default $OUT/calibration.json; calibrate also writes
# each shape's own, $OUT/calibration_{shape}.json). Logs under $OUT; tables last.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0,1}
first=${CUDA_VISIBLE_DEVICES%%,*}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
quiet() { grep -v "^W1\|Warning\|warn(" | tail -${1:-12}; }
for stage in ${*:-calibrate check tests}; do
  case "$stage" in
    calibrate)
      (cd benchmarks && CUDA_VISIBLE_DEVICES=$first python plan_calibration.py --shapes coarse fine qwen3-moe-medium \
        --out "$OUT/calibration.json" 2>&1 | tee "$OUT/calibrate.log" | quiet 10) ;;
    calibrate-mb4)
      (cd benchmarks && CUDA_VISIBLE_DEVICES=$first python plan_calibration.py --shapes coarse fine qwen3-moe-medium --microbatches 4 \
        --calibration "$OUT/calibration.json" 2>&1 | tee "$OUT/calibrate_mb4.log" | quiet 6) ;;
    check)
      for run in "standard 1" "1f1b_overlap 1" "standard 2"; do
        set -- $run
        (cd benchmarks && torchrun --standalone --nproc-per-node 2 plan_calibration.py --shapes ${SHAPES:-coarse fine} --pp 2 --batch 16 \
          --microbatches 8 --schedule $1 --virtual-stages $2 --calibration "${CAL:-$OUT/calibration.json}" 2>&1 \
          | tee "$OUT/pp2_$1_v$2.log" | quiet 5)
      done ;;
    tests|tests-pp)
      python -m pytest -q -rs -p no:cacheprovider -W ignore tests/test_gpu_parallel_dims.py -m gpu \
        $([ "$stage" = tests-pp ] && echo -k pp) 2>&1 | tee "$OUT/$stage.log" | tail -15 ;;
  esac
done
