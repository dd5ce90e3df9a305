#!/bin/bash
# The main job across the GPUs of one machine (issue 63's table), as a user runs it:
#   source .device/setup.sh; bash benchmarks/run_main_job_scale_device.sh PART...
# Parts:
#   zero3, dp1ep: qwen3-moe-medium under torchrun over every GPU (up to 4), 30 steps of 8 x 2048
#     tokens a GPU on the embedded corpus: ZeRO-3 eager; dp1 x epN (tokens cross once, 1f1b_overlap
#     over 2 microbatches, attention/router/dispatch graphed); STEPS=N for N steps. The graphed jobs, on one GPU and
#     under torchrun: benchmarks/run_graphed_presets_device.sh.
#   30b: the qwen3-30b-a3b preset as it ships (48 layers, vocab 151936, seq 4096, learned routing,
#     pp=4 of two interleaved stages, remat full), 20 steps over 4 GPUs; its checkpoint under /dev/shm
#     when that holds it.
#   30b-ep: the same model over dp1 x ep4 with whole layers recomputed (the planner's first with
#     balanced routing: 116.9 GiB estimated; collapsed routing needs more on the busiest rank).
#   30b-dp2: pp=2 of two interleaved stages x dp=2, remat full (the planner's first at --routing-skew 4).
#   30b-layers: the same layers at half depth (24), ZeRO-3 against dp1 x ep4 (no remat), 20 steps.
#   peer30b: the same 24 layers (vocab 151936, 2 x 4096 tokens a GPU, aux loss 1e-3) as a bare step
#     beside the compiled FSDP2 peer (benchmarks/vs_peer.py): fmoe compiled, ZeRO-3 and dp1 x ep4.
#   nvshmem: torch's NVSHMEM 2-D all-to-all against today's exchange (benchmarks/symm_exchange_probe.py).
# Each job is a fresh process with its own cold Triton and inductor caches; logs in $OUT; a table
# of every job's summary line last (tokens/s a GPU: the job's median over its logged windows).
# LIMIT=S: the seconds each full-depth 30B job may take (default 420; keep the device call's own limit above it, or
#   its workers outlive the call and hold the GPUs' memory).
# FLAGS="...": more flags for the 30B jobs (--layers 24, --remat full).
# Workers still running 25 s before their job's limit (LIMIT, or the part's own) get SIGUSR1: every
#   thread's stack into the log.
# PROFILE=N: each job also traces its step N (--profile-step) and benchmarks/trace_gaps.py's
# reading of rank 0's trace goes to its log (that step is slower: leave it off a timed window).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
gpus=$(nvidia-smi -L | wc -l)
ranks=$((gpus > 4 ? 4 : gpus))
# --stall-report: a step (the first one compiles) that runs past it prints each rank's stack and device memory
common=(--steps 30 --eval-every 30 --eval-batches 1 --save-every 0 --sample-tokens 0 --no-progress --no-tensorboard
        --stall-report 120)
job() {  # job NAME LIMIT_S COMMAND...: run with fresh caches, log $OUT/NAME.log, keep its summary line
  local name=$1 limit=$2 start=$(date +%s); shift 2
  local runs=${RUNS:-/dev/shm}
  rm -rf "$runs/$name"
  # 25 s before the cut, every thread's stack (GIL or not) from each process of the job that takes SIGUSR1:
  # its caught-signals mask (SigCgt) has bit 0x200 while the main job's watchdog runs; SIGUSR1 ends any other
  (sleep $((limit > 25 ? limit - 25 : 0)) && for p in $(pgrep -f -- "--out $runs/$name( |$)"); do
     caught=$(awk '/^SigCgt:/ {print $2}' "/proc/$p/status" 2>/dev/null)
     [ -n "$caught" ] && (( 0x$caught & 0x200 )) && kill -USR1 "$p"; done) &
  local dumper=$!
  TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout "$limit" "$@" \
    ${PROFILE:+--profile-step $PROFILE} --out "$runs/$name" > "$OUT/$name.log" 2>&1
  local code=$?
  pkill -P "$dumper" 2>/dev/null; kill "$dumper" 2>/dev/null
  pkill -9 -f -- "--out $runs/$name( |$)" && sleep 5  # a worker that outlived its torchrun still holds its GPU's memory
  local trace="$runs/$name/trace-step${PROFILE}-rank0.json.gz"
  if [ -n "$PROFILE" ] && [ -f "$trace" ]; then  # where rank 0's GPU waited in that step, into the job's log
    # whole into the log first: a head on a tee's pipe would cut the log short too
    python benchmarks/trace_gaps.py "$trace" --top 12 >> "$OUT/$name.log" 2>&1
    sed -n '/GPU span/,$p' "$OUT/$name.log" | head -70
  fi
  local done_line; done_line=$(grep -h "^done in" "$OUT/$name.log" | tail -1)
  echo "| $name | exit $code, $(( $(date +%s) - start )) s | ${done_line:-no summary: $(tail -2 "$OUT/$name.log" | tr '\n' ' ' | cut -c1-300)} |" \
    | tee -a "$OUT/table.md"
  if [ -s "$runs/$name/metrics.jsonl" ]; then  # and its last window: learned routing settles over the steps
    cp "$runs/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl"
    python3 -c 'import json, sys
r = [json.loads(line) for line in open(sys.argv[1])][-1]
step, rate, load = r["step"], r["tokens_per_s"], max(r.get("expert_load") or [0])
print(f"|   last window | step {step} | {rate:.0f} tokens/s, max expert_load {load:.2f} |")' \
      "$runs/$name/metrics.jsonl" | tee -a "$OUT/table.md"
  fi
  rm -rf "$runs/$name"
}
tr=(torchrun --standalone --nproc-per-node "$ranks" -m interop.train)
qwen=(--config qwen3-moe-medium "${common[@]}")
q30=(--config qwen3-30b-a3b --steps 20 --log-every 5 --eval-every 20 --eval-batches 1 --save-every 0 --sample-tokens 0
     --no-progress --no-tensorboard --stall-report 120 $FLAGS)
ep30=(--pp 1 --virtual-stages 1 --ep 4 --schedule 1f1b_overlap --microbatches 2)  # the old preset's plan
# a full-depth 30B run's last checkpoint (fp32 params, bf16 moments) is ~245 GB: in memory where /dev/shm holds it
big_runs=$([ "$(df --output=avail -BG /dev/shm | tail -1 | tr -dc 0-9)" -ge 260 ] && echo /dev/shm || echo /tmp)
for part in "$@"; do
  case $part in
    zero3) job qwen3-${ranks}gpu-zero3 300 "${tr[@]}" "${qwen[@]}" --batch $((8 * ranks)) ${STEPS:+--steps $STEPS --eval-every $STEPS} ;;
    dp1ep)
      job qwen3-${ranks}gpu-dp1ep${ranks} 300 "${tr[@]}" "${qwen[@]}" --batch $((8 * ranks)) ${STEPS:+--steps $STEPS --eval-every $STEPS} --dp 1 --ep "$ranks" \
        --ep-exchange tokens --schedule 1f1b_overlap --microbatches 2 --cuda-graph attn,router,dispatch ;;
    30b) RUNS=$big_runs job qwen3-30b-a3b "${LIMIT:-420}" "${tr[@]}" "${q30[@]}" ;;
    30b-ep) RUNS=$big_runs job qwen3-30b-a3b-ep4 "${LIMIT:-420}" "${tr[@]}" "${q30[@]}" "${ep30[@]}" --remat full ;;
    30b-dp2) RUNS=$big_runs job qwen3-30b-a3b-pp2dp2 "${LIMIT:-420}" "${tr[@]}" "${q30[@]}" --pp 2 --dp 2 \
      --microbatches 4 ;;
    30b-layers)
      job qwen3-30b-24l-dp1ep4 150 "${tr[@]}" "${q30[@]}" --layers 24 "${ep30[@]}" --remat none
      job qwen3-30b-24l-zero3 150 "${tr[@]}" "${q30[@]}" --layers 24 --pp 1 --virtual-stages 1 --dp "$ranks" \
        --remat none --microbatches 2 --schedule 1f1b_overlap ;;
    peer30b)
      (cd benchmarks && TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout 540 torchrun \
        --standalone --nproc-per-node "$ranks" vs_peer.py --shape qwen3-30b-a3b --layers 24 --vocab 151936 \
        --seq 4096 --batch 2 --aux-loss 1e-3 --peers compiled --fmoe-compile only --fmoe-graph off \
        --meshes dp "dp1ep$ranks+tokens" 2>&1 | tee "$OUT/peer30b.log" | grep -v "^W1\|Warning\|warn(" | tail -12) ;;
    nvshmem)
      NVSHMEM_SYMMETRIC_SIZE=4G timeout 150 torchrun --standalone --nproc-per-node "$ranks" \
        benchmarks/symm_exchange_probe.py 2>&1 | grep -v "^W1\|warn" | tee "$OUT/nvshmem.log" ;;
    *) echo "unknown part $part (zero3 dp1ep 30b 30b-ep 30b-dp2 30b-layers peer30b nvshmem)"; exit 2 ;;
  esac
done
df -h /dev/shm | tail -1
echo "| job | exit, time | summary |"
cat "$OUT/table.md"
