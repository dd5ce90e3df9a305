#!/bin/bash
# One device command for the FSDP issue: GPU tests on 2 GPUs (NCCL), then the benchmark.
#   source .device/setup.sh; bash benchmarks/run_fsdp_device.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python -m pytest -q -rs -m gpu tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
torchrun --nproc-per-node 2 benchmarks/fsdp_step.py --dim 256 --layers 2 --heads 4 --experts 4 --ffn 256 \
  --vocab 512 --batch 2 --seq 256 --steps 2 --out "$OUT/fsdp_smoke.json" 2>&1 | tail -3
torchrun --nproc-per-node 2 benchmarks/fsdp_step.py --out "$OUT/fsdp_step.json" 2>&1 | tee "$OUT/fsdp_step.log" | grep -v "^  done"
