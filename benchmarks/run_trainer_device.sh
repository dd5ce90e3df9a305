#!/bin/bash
# One device command for the trainer: the main job on 2 GPUs on a real tokenized corpus,
# generation from its checkpoint, the GPU tests; a short table last.
#   source .device/setup.sh; bash benchmarks/run_trainer_device.sh DATA_DIR [PRESET] [STEPS]
# DATA_DIR is a corpus written here by `python -m fmoe.data prepare` (carried to the device).
set -o pipefail
DATA=${1:?usage: run_trainer_device.sh DATA_DIR [PRESET] [STEPS]}
PRESET=${2:-qwen3-moe-small}
STEPS=${3:-300}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUN=/tmp/fmoe-run  # the checkpoint is GBs: kept on the device, only the logs come back
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
python -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpus.txt"

rm -rf "$RUN"
torchrun --nproc-per-node 2 -m fmoe.train --config "$PRESET" --data "$DATA" --steps "$STEPS" \
  --eval-every 100 --save-every 0 --no-progress --out "$RUN" 2>&1 | tee "$OUT/train.log" | grep -v "^\[rank"
cp "$RUN/metrics.jsonl" "$RUN/settings.toml" "$OUT/" 2>/dev/null

python -m fmoe.generate --checkpoint "$RUN/checkpoint" --prompt "def read_config(path):" --max-new-tokens 48 \
  --device cuda --dtype bfloat16 2>&1 | tee "$OUT/generate.log" | tail -12

# TESTS: which GPU tests (default: all of them)
timeout "${TEST_TIMEOUT:-420}" python -m pytest -q -rs -m gpu ${TESTS:-tests} 2>&1 | tee "$OUT/gpu_tests.log" | tail -8

python - "$OUT/metrics.jsonl" <<'EOF'
import json, statistics, sys
rec = [json.loads(line) for line in open(sys.argv[1])]
later = rec[len(rec) // 10:]  # the first steps include compilation and warm-up
evals = [r for r in rec if "heldout_loss" in r]
print("| steps | first loss | last loss | held-out (last eval) | median tok/s | median MFU | max expert load |")
print("| --- | --- | --- | --- | --- | --- | --- |")
print(f"| {rec[-1]['step']} | {rec[0]['loss']:.3f} | {rec[-1]['loss']:.3f} | {evals[-1]['heldout_loss']:.3f} | "
      f"{statistics.median(r['tokens_per_s'] for r in later):.0f} | "
      f"{statistics.median(r.get('mfu', 0) for r in later):.1%} | {later[-1]['max_load']:.2f} |")
EOF
