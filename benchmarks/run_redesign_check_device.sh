#!/bin/bash
# The redesign's GPU check: is the step as fast as before it, and does the main job still train?
#   git archive <before> | tar -x -C .before        (here, once; .before is git-ignored and carried)
#   source .device/setup.sh; bash benchmarks/run_redesign_check_device.sh [steps] [jobs]
# steps: the fine and coarse bare steps (benchmarks/vs_peer.py, no peer, fmoe compiled and graphed),
#   the tree in .before against this one, ROUNDS times (default 2). Each round runs both trees side by
#   side on GPUs 0 and 1 and the next round swaps the GPUs, so a GPU's own speed cancels in the ratio.
# jobs: the main job (qwen3-moe-medium, 30 steps) with --cuda-graph step on one GPU, then under torchrun
#   over every GPU (up to 4, ZeRO-3); eager-jobs: the same without --cuda-graph step.
# Logs in $OUT; a table last.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$PWD
gpus=$(nvidia-smi -L | tee "$OUT/gpus.txt" | wc -l)
export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)

bare_steps() {  # bare_steps TREE GPU LOG: vs_peer's fmoe rows from TREE's code on GPU
  (cd "$ROOT/$1" && CUDA_VISIBLE_DEVICES=$2 PYTHONPATH="/tmp/site:$ROOT/$1" \
     python benchmarks/vs_peer.py --shapes coarse fine --peers --fmoe-compile only > "$OUT/$3" 2>&1)
}

steps() {
  [ -d "$ROOT/.before/fmoe" ] || { echo "no .before tree (see the header)"; return 2; }
  for round in $(seq 1 "${ROUNDS:-2}"); do
    if [ $((round % 2)) = 1 ]; then a=0 b=1; else a=1 b=0; fi
    bare_steps .before $a "before-$round.log" & bare_steps . $b "after-$round.log"; wait
  done
  python - "$OUT" <<'EOF'
import glob, re, statistics, sys
out = sys.argv[1]
times = {}  # (tree, shape, system) -> [ms]
for path in sorted(glob.glob(f"{out}/before-*.log") + glob.glob(f"{out}/after-*.log")):
    tree, shape = path.split("/")[-1].split("-")[0], None
    for line in open(path):
        if line.startswith("## "):
            shape = line[3:].strip()
        m = re.match(r"\s*done (.+?) \((.+?)\): ([\d.]+) ms", line)
        if m:
            times.setdefault((tree, shape, m.group(1)), []).append(float(m.group(3)))
print("\n| shape | system | before ms | after ms | before / after |\n| --- | --- | ---: | ---: | ---: |")
for (tree, shape, system), ms in sorted(times.items()):
    if tree == "after" and ("before", shape, system) in times:
        b, a = statistics.median(times[("before", shape, system)]), statistics.median(ms)
        print(f"| {shape} | {system} | {b:.1f} ({len(times[('before', shape, system)])}) | {a:.1f} ({len(ms)}) "
              f"| {b / a:.3f}x |")
EOF
}

main_job() {  # main_job NAME GPUS LAUNCH... : the qwen3-moe-medium main job; its exit and summary kept
  local name=$1 visible=$2 start=$(date +%s); shift 2
  rm -rf "/dev/shm/$name"
  CUDA_VISIBLE_DEVICES=$visible timeout 300 "$@" --config qwen3-moe-medium --steps 30 --eval-every 30 \
    --eval-batches 1 --save-every 0 --sample-tokens 0 --no-progress --no-tensorboard --out "/dev/shm/$name" \
    > "$OUT/$name.log" 2>&1
  echo "$name: exit $? in $(( $(date +%s) - start )) s: $(grep -h '^done in' "$OUT/$name.log" | tail -1)"
  rm -rf "/dev/shm/$name"
}

jobs() {  # jobs FLAGS: the main job with FLAGS (e.g. "--cuda-graph step") on one GPU, then over every GPU
  local ranks=$((gpus > 4 ? 4 : gpus)) all graph=$1
  all=$(seq -s, 0 $((ranks - 1)))
  main_job "1gpu${graph:+-graphed}" 0 python -m interop.train --batch 8 --dp 1 --sharding no_shard $graph
  main_job "${ranks}gpu${graph:+-graphed}" "$all" python -m torch.distributed.run --standalone \
    --nproc-per-node "$ranks" -m interop.train --batch $((8 * ranks)) $graph
}

for part in ${@:-steps jobs eager-jobs}; do
  case $part in
    steps) steps | tee "$OUT/steps.txt" ;;
    jobs) jobs "--cuda-graph step" | tee -a "$OUT/jobs.txt" ;;
    eager-jobs) jobs "" | tee -a "$OUT/jobs.txt" ;;
    *) echo "unknown part $part (steps, jobs, eager-jobs)"; exit 2 ;;
  esac
done
