#!/bin/bash
# One device command for the schedule issue: GPU tests on 2 GPUs (NCCL), then the
# standard vs 1f1b_overlap benchmark.
#   source .device/setup.sh; bash benchmarks/run_schedule_device.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pytest -q -rs -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
torchrun --nproc-per-node 2 benchmarks/schedule_overlap.py "$@" 2>&1 | tee "$OUT/schedule_overlap.log" \
  | grep -v "^W1\|\*\*\*\|OMP_NUM"
