#!/bin/bash
# Issue 43 items 2 and 3, one command on 4 GPUs: dp1 x ep2 dropless beside ZeRO-3 on the
# fine shape, compiled, plain, with the attention and router graphed and with the
# dispatch's index work graphed too (GPUs 0-1); meanwhile the two-GPU CUDA-graph tests
# on GPUs 2-3 (graphed scopes bitwise the eager step on NCCL: dp2 ZeRO-3, ep2 with
# capacity, dropless and tokens, tp2); then ep2 x tp2 x etp2 on all four and the
# compiled one-GPU scopes.
#   source .device/setup.sh; bash benchmarks/run_graph_scopes_device.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
(cd benchmarks && CUDA_VISIBLE_DEVICES=0,1 torchrun --nproc-per-node 2 --master-port 29611 vs_peer.py \
  --shapes fine --peers --fmoe-compile only --fmoe-graph off --microbatches 1 --steps 12 --warmup 3 --profile \
  --meshes ${MESHES:-dp dp+graphs dp1ep2 dp1ep2+graphs dp1ep2+graphs+dispatch} > "$OUT/graph_scopes_bench.log" 2>&1) &
bench=$!
CUDA_VISIBLE_DEVICES=2,3 python -m pytest -q tests/ranks/test_nccl.py -k "cuda_graphs and not etp2" \
  > "$OUT/nccl_graphs_2gpu.log" 2>&1
tail -3 "$OUT/nccl_graphs_2gpu.log"
wait $bench
grep "^  done\|^| fmoe" "$OUT/graph_scopes_bench.log"
python -m pytest -q tests/ranks/test_nccl.py -k "cuda_graphs and etp2" 2>&1 | tee "$OUT/nccl_graphs_4gpu.log" | tail -2
python -m pytest -q tests/test_cuda_graph.py -k "graphed_compiled_scopes" 2>&1 | tee "$OUT/cuda_graph_scopes.log" | tail -2
