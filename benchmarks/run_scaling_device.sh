#!/bin/bash
# One device command per stage for issue 43 (several GPUs against a compiled FSDP2 peer):
#   source .device/setup.sh; bash benchmarks/run_scaling_device.sh STAGE...
# Runs on the GPUs CUDA_VISIBLE_DEVICES names (all of them when unset); a stage needing
# more is skipped with a line saying so. Stages:
#   one: vs_peer.py on the first GPU (coarse, fine; peer eager and compiled, fmoe eager,
#     compiled and step-graphed): the weak-scaling table's one-GPU rows.
#   two, four, eight: vs_peer.py on 2 / 4 / 8 GPUs: the FSDP2 peer eager and compiled,
#     fmoe ZeRO-3 (dp = world) and the dp x ep meshes, eager and compiled.
#   overlap2, overlap4, overlap8: the fine shape in 4 microbatches, fmoe only, eager:
#     dp1epN standard against 1f1b_overlap and 1f1b_overlap + delay_wgrad, profiled
#     (NCCL time, its exposed part, the GPU's idle time).
# Every row goes to $OUT/scale.jsonl (weak-scaling table printed by each run); logs under
# $OUT; each run's table last.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
visible=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $(($(nvidia-smi -L | wc -l) - 1)))}
gpus=$(echo "$visible" | tr , '\n' | wc -l)
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus-$visible.txt"
quiet() { grep -v "^W1\|Warning\|warn(\|^  done\|^\[rank" | tail -${1:-40}; }
cd benchmarks
peer() {  # $1 ranks, then vs_peer.py's flags
  local n=$1; shift
  if [ "$n" -gt "$gpus" ]; then echo "skipped: $n GPUs needed, $gpus visible ($visible)"; return; fi
  local devices; devices=$(echo "$visible" | cut -d, -f1-"$n")
  if [ "$n" = 1 ]; then
    CUDA_VISIBLE_DEVICES=$devices python vs_peer.py --out "$OUT/scale.jsonl" "$@"
  else
    CUDA_VISIBLE_DEVICES=$devices torchrun --standalone --nproc-per-node "$n" vs_peer.py --out "$OUT/scale.jsonl" "$@"
  fi
}
for stage in "$@"; do
  case "$stage" in
    one) peer 1 --shapes coarse fine 2>&1 | tee "$OUT/one.log" | quiet ;;
    two) peer 2 --shapes coarse fine --meshes dp dp1ep2 2>&1 | tee "$OUT/two.log" | quiet ;;
    four) peer 4 --shapes coarse fine --meshes dp dp2ep2 dp1ep4 2>&1 | tee "$OUT/four.log" | quiet ;;
    eight) peer 8 --shapes coarse fine --meshes dp dp4ep2 dp2ep4 dp1ep8 2>&1 | tee "$OUT/eight.log" | quiet ;;
    overlap2|overlap4|overlap8)
      n=${stage#overlap}
      peer "$n" --shapes fine --microbatches 4 --peers --fmoe-compile off --profile \
        --meshes dp1ep$n dp1ep$n+1f1b dp1ep$n+1f1b+dw 2>&1 | tee "$OUT/$stage.log" | quiet 20 ;;
    *) echo "unknown stage $stage (one two four eight overlap2 overlap4 overlap8)"; exit 2 ;;
  esac
done
