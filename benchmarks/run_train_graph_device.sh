#!/bin/bash
# The main job with its update inside the step's CUDA graph (issue 42, item 5), against the
# step-only graph of an earlier tree, one GPU, runs alternated:
#   source .device/setup.sh; BEFORE=.before bash benchmarks/run_train_graph_device.sh [tests] [mlp] [small] [medium]
# BEFORE: a copy of the earlier tree's fmoe/ and interop/ (e.g. `git archive <commit> fmoe interop
# pyproject.toml | tar -x -C .before`, carried to the device). Parts:
#   tests   the GPU tests of the graphed train step (test_cuda_graph.py, test_gpu.py's main job)
#   mlp     benchmarks/expert_mlp.py --permute --graph (eager and graph-replayed timings)
#   small   qwen3-moe-small's main job, --cuda-graph step, before / after / before / after (24 x 1024
#           tokens a step: the embedded corpus's held-out split, 24985 tokens, must hold one batch)
#   medium  qwen3-moe-medium's main job (8 x 2048 tokens, no_shard, bf16 moments), before / after
# Logs in $OUT; a table of the jobs' tokens/s and MFU last.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BEFORE=${BEFORE:-.before}
JOBS=()

job() {  # job NAME TREE ARGS...: the main job from TREE, its summary line kept
  local name=$1 tree=$2; shift 2
  (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout 400 python -m interop.train "$@" --sample-tokens 0 --no-progress \
    --no-tensorboard --out "/tmp/run-$name") > "$OUT/$name.log" 2>&1
  JOBS+=("$name: $(grep -E '^done in|Error' "$OUT/$name.log" | tail -n 1)")
  rm -rf "/tmp/run-$name"
}

for part in "$@"; do
  case $part in
    tests)
      python -m pytest -q tests/test_cuda_graph.py tests/test_gpu.py -k "train_steps or refuses_before or graphed_main_job" \
        2>&1 | tail -n 15 | tee "$OUT/tests.log" ;;
    mlp)
      python benchmarks/expert_mlp.py --permute --backends torch --graph 2>&1 | tail -n 8 | tee "$OUT/expert_mlp.log" ;;
    small)
      for i in 1 2; do
        for tree in "$BEFORE" .; do
          job "small-$([ "$tree" = . ] && echo after || echo before)-$i" "$tree" --config qwen3-moe-small --batch 24 --steps 60 \
            --eval-every 1000 --save-every 0 --cuda-graph step
        done
      done ;;
    medium)
      for tree in "$BEFORE" .; do
        job "medium-$([ "$tree" = . ] && echo after || echo before)" "$tree" --config qwen3-moe-medium --batch 8 --dp 1 \
          --sharding no_shard --steps 50 --eval-every 1000 --save-every 0 --moments bfloat16 --cuda-graph step
      done ;;
    *) echo "unknown part $part (tests, mlp, small, medium)"; exit 2 ;;
  esac
done
printf '%s\n' "${JOBS[@]}"
