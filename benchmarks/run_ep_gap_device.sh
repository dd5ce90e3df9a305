#!/bin/bash
# Issue 43 item 2 on 2 GPUs, one command: the NCCL expert-parallel tests, then dp1 x ep2
# (rows and tokens) beside ZeRO-3, compiled, fine shape, 1 microbatch, profiled; with
# BASE=<a folder holding an older tree's fmoe/ and interop/>, the same rows with that
# library first (this tree's benchmark scripts), so the two are compared on one machine.
#   source .device/setup.sh; BASE=.baseline bash benchmarks/run_ep_gap_device.sh
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$PWD
bench() {  # bench <library tree> <log>
  (PYTHONPATH=/tmp/site:$1 torchrun --nproc-per-node 2 "$ROOT/benchmarks/vs_peer.py" --shapes fine --peers \
    --fmoe-compile only --microbatches 1 --steps 12 --warmup 3 --profile --meshes dp dp1ep2 dp1ep2+tokens 2>&1) \
    | tee "$OUT/$2" | grep "^  done\|^| fmoe"
}
python -m pytest -q tests/ranks/test_nccl.py -k "ep2" 2>&1 | tee "$OUT/nccl_ep2.log" | tail -2
[ -n "$BASE" ] && echo "== before ($BASE)" && bench "$ROOT/$BASE" before.log
echo "== this tree" && bench "$ROOT" after.log
