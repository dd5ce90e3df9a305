#!/bin/bash
# Issue 43 item 2, the fine shape, compiled, graphed scopes (attention, router, dispatch)
# beside graphed ZeRO-3; each table's rows come from one run.
#   source .device/setup.sh; bash benchmarks/run_ep_graphs_device.sh [pairs] [four] [parts]
# pairs (4 GPUs, two runs side by side on separate GPU pairs): GPUs 0-1, 1 microbatch,
#   rows against tokens; GPUs 2-3, 2 microbatches, the standard schedule against the 1F1B
#   all-to-all overlap (rows and tokens).
# four (4 GPUs): dp4 ZeRO-3 against dp1 x ep4 and dp2 x ep2, rows and tokens, 1 microbatch.
# parts (2 GPUs): what tokens and each graphed scope add, one at a time, 1 microbatch.
# repeat (2 GPUs): graphed ZeRO-3 and graphed dp1 x ep2 tokens alternating, twice, then rows, 20 steps;
#   AUX=0.01 adds the router's balancing loss (both sides), so routing stays balanced.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
run() {  # run <gpus> <port> <microbatches> <log> <meshes...>
  local gpus=$1 port=$2 mb=$3 log=$4; shift 4
  local n=$(( $(tr -cd , <<< "$gpus" | wc -c) + 1 ))
  (cd benchmarks && CUDA_VISIBLE_DEVICES=$gpus torchrun --nproc-per-node $n --master-port "$port" vs_peer.py \
    --shapes fine --peers --fmoe-compile only --fmoe-graph off --microbatches "$mb" --steps ${STEPS:-12} \
    --aux-loss ${AUX:-0} --warmup 3 --profile \
    --meshes "$@" > "$OUT/$log" 2>&1)
  echo "== $log"; grep "^| fmoe\|Error" "$OUT/$log" | tail -8
}
for what in ${*:-pairs}; do
  case $what in
    pairs)
      run 0,1 29611 1 ep_graphs_mb1.log dp+graphs dp1ep2+graphs+dispatch dp1ep2+tokens+graphs+dispatch &
      run 2,3 29612 2 ep_graphs_mb2.log dp+graphs dp1ep2+graphs+dispatch dp1ep2+1f1b+graphs+dispatch \
        dp1ep2+tokens+1f1b+graphs+dispatch
      wait ;;
    four)
      run 0,1,2,3 29613 1 ep_graphs_4gpu.log dp+graphs dp1ep4+graphs+dispatch dp1ep4+tokens+graphs+dispatch \
        dp2ep2+tokens+graphs+dispatch ;;
    parts)
      run 0,1 29614 1 ep_graphs_parts.log dp dp+graphs dp1ep2+tokens dp1ep2+tokens+graphs \
        dp1ep2+tokens+graphs+dispatch ;;
    repeat)
      STEPS=20 run 0,1 29615 1 ep_graphs_repeat${AUX:+_aux$AUX}.log dp+graphs dp1ep2+tokens+graphs+dispatch \
        dp+graphs dp1ep2+tokens+graphs+dispatch dp1ep2+graphs+dispatch ;;
  esac
done
