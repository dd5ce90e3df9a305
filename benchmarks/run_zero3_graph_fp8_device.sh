#!/bin/bash
# Issue 43 item 1 on 2 GPUs, one command: ZeRO-3 with its whole step as one CUDA graph
# beside the compiled FSDP2 peer (coarse), then FP8 tensorwise (weights gathered in FP8)
# against bf16 under ZeRO-3, compiled.
#   source .device/setup.sh; bash benchmarks/run_zero3_graph_fp8_device.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
cd benchmarks
torchrun --nproc-per-node 2 vs_peer.py --shapes ${SHAPES:-coarse} --peers compiled --fmoe-compile only \
  --meshes dp > "$OUT/zero3_graph.log" 2>&1
grep "^| " "$OUT/zero3_graph.log" | head -8
torchrun --nproc-per-node 2 fp8_step.py --shapes ${SHAPES:-coarse} --modes compiled --recipes none tensorwise \
  > "$OUT/zero3_fp8.log" 2>&1
grep "^| \|Error" "$OUT/zero3_fp8.log" | head -12
