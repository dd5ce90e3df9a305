#!/bin/bash
# One device command for the interop issue (2 GPUs, TE in the kit): the TE and
# CUDA-graph GPU tests, then the CUDA-graph step benchmark and the expert-MLP
# backend benchmark.
#   FMOE_TE=1 source .device/setup.sh; bash benchmarks/run_interop_device.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export CUBLAS_WORKSPACE_CONFIG=:4096:8
python -m pytest -q -rs -s -m gpu tests/test_te.py tests/test_cuda_graph.py \
  tests/ranks/test_nccl.py::test_nccl_te_experts_with_zero3_delayed_wgrad_ep2 \
  tests/ranks/test_nccl.py::test_nccl_cuda_graphs_are_bitwise_eager 2>&1 | tee "$OUT/gpu_tests.log" | grep -v "^te seed\|^swiglu\|^quick_geglu" | tail -30
python benchmarks/cuda_graph_step.py "$@" 2>&1 | tee "$OUT/cuda_graph_step.log" | tail -6
python benchmarks/expert_mlp.py 2>&1 | tee "$OUT/expert_mlp.log" | tail -11
