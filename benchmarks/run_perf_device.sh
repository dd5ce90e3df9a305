#!/bin/bash
# One device command for the performance issues (2 GPUs; TE from the kit when loaded):
# fmoe vs the plain PyTorch peer eager and compiled on three shapes (1 GPU, and FSDP2 on 2),
# the compiled steps' kernel profiles, the main job against a bare loop, the 1-GPU full step, expert MLPs
# with permute, the expert-count sweep, and the FSDP strategies with their memory formula.
# Logs under $OUT.
#   FMOE_TE=1 source .device/setup.sh; bash benchmarks/run_perf_device.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v "^W1\|\*\*\*\|OMP_NUM\|Warn\|warn"; }
python benchmarks/vs_peer.py --shapes coarse fine qwen3-moe-medium 2>&1 | tee "$OUT/vs_peer_1gpu.log" | quiet \
  | sed -n '/^## Summary/,$p'
python benchmarks/step_profile.py 2>&1 | tee "$OUT/step_profile.log" | quiet | grep -A8 "^## \|^wall"
python benchmarks/main_job_overhead.py coarse --steps 60 2>&1 | tee "$OUT/main_job_overhead.log" | quiet | tail -3
torchrun --nproc-per-node 2 benchmarks/vs_peer.py --meshes dp dp1ep2 2>&1 | tee "$OUT/vs_peer_2gpu.log" | quiet \
  | sed -n '/^## Summary/,$p'
python benchmarks/full_step.py 2>&1 | tee "$OUT/full_step.log" | quiet | tail -22
python benchmarks/expert_mlp.py --permute 2>&1 | tee "$OUT/expert_mlp_permute.log" | quiet | tail -11
python benchmarks/full_step.py --sweep-experts 8 16 32 64 128 --dim 1024 --ffn 704 --layers 4 2>&1 \
  | tee "$OUT/experts_sweep.log" | quiet | tail -7
torchrun --nproc-per-node 2 benchmarks/fsdp_step.py --out "$OUT/fsdp_step.json" 2>&1 | tee "$OUT/fsdp_step.log" \
  | quiet | tail -9
