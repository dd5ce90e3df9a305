#!/bin/bash
# Issue 43 item 2 on 2 GPUs, one command: the NCCL expert-parallel tests, then dp1 x ep2
# (rows and tokens) beside ZeRO-3, compiled, fine shape, 1 microbatch, profiled; with
# BASE=<a folder holding an older tree's fmoe/ benchmarks/ interop/>, that tree's same rows
# first, so the two are compared on one machine.
#   source .device/setup.sh; BASE=.baseline bash benchmarks/run_ep_gap_device.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$PWD
bench() {  # bench <tree> <log>
  (cd "$1" && PYTHONPATH=/tmp/site:$PWD torchrun --nproc-per-node 2 benchmarks/vs_peer.py --shapes fine --peers \
    --fmoe-compile only --microbatches 1 --steps 12 --warmup 3 --profile --meshes dp dp1ep2 dp1ep2+tokens 2>&1) \
    | tee "$OUT/$2" | grep "^  done\|^| fmoe"
}
python -m pytest -q tests/dist/test_nccl.py -k "ep2" 2>&1 | tee "$OUT/nccl_ep2.log" | tail -2
[ -n "$BASE" ] && echo "== before ($BASE)" && bench "$ROOT/$BASE" before.log
echo "== this tree" && bench "$ROOT" after.log
