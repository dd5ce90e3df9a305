#!/bin/bash
# One device command for the EP issue: GPU tests on 2 GPUs (NCCL), then the all-to-all benchmark.
#   source .device/setup.sh; bash benchmarks/run_ep_device.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python -m pytest -q -rs -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
torchrun --nproc-per-node 2 benchmarks/ep_a2a.py --dim 256 --experts 4 --ffn 256 --layers 1 --tokens 1024 \
  --seq 256 --steps 1 2>&1 | tail -3
torchrun --nproc-per-node 2 benchmarks/ep_a2a.py 2>&1 | tee "$OUT/ep_a2a.log" | grep -v "^W1\|\*\*\*\|OMP_NUM"
