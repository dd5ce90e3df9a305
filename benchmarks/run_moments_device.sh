#!/bin/bash
# AdamW moments, fp32 against bf16, on 4 GPUs at once (issue 42, item 2):
#   source .device/setup.sh; bash benchmarks/run_moments_device.sh DATA_DIR
# GPUs 0 and 1: the main job (qwen3-moe-small, 300 steps, fused AdamW) with each moment dtype on the
# same seed and corpus (DATA_DIR: written by `python -m fmoe.data prepare`, carried to the device);
# GPUs 2 and 3: benchmarks/optim_moments.py on the coarse and fine shapes. Logs and metrics: $OUT.
DATA=${1:?usage: run_moments_device.sh DATA_DIR}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for m in float32 bfloat16; do
  CUDA_VISIBLE_DEVICES=$([ $m = float32 ] && echo 0 || echo 1) timeout 340 python -m fmoe.train --config qwen3-moe-small \
    --data "$DATA" --steps 300 --eval-every 50 --save-every 0 --moments $m --fused-optimizer --no-progress \
    --no-tensorboard --out "/tmp/run_$m" > "$OUT"/train_$m.log 2>&1 &
done
CUDA_VISIBLE_DEVICES=2 timeout 340 python benchmarks/optim_moments.py --shape coarse > "$OUT"/optim_coarse.log 2>&1 &
CUDA_VISIBLE_DEVICES=3 timeout 340 python benchmarks/optim_moments.py --shape fine > "$OUT"/optim_fine.log 2>&1 &
wait
for m in float32 bfloat16; do cp "/tmp/run_$m"/metrics.jsonl "$OUT"/metrics_$m.jsonl; done
tail -n 5 "$OUT"/optim_coarse.log "$OUT"/optim_fine.log
python - "$OUT" <<'PY'
import json, sys, statistics
recs = {m: [json.loads(l) for l in open(f"{sys.argv[1]}/metrics_{m}.jsonl")] for m in ("float32", "bfloat16")}
ev = {m: {r["step"]: r["heldout_loss"] for r in rs if "heldout_loss" in r} for m, rs in recs.items()}
tr = {m: {r["step"]: r["loss"] for r in rs if "loss" in r} for m, rs in recs.items()}
print("| step | train fp32 | train bf16 | held-out fp32 | held-out bf16 | bf16 / fp32 |")
for s in sorted(ev["float32"]):
    a, b = ev["float32"][s], ev["bfloat16"].get(s, float("nan"))
    print(f"| {s} | {tr['float32'].get(s, float('nan')):.3f} | {tr['bfloat16'].get(s, float('nan')):.3f} | {a:.4f} | {b:.4f} | {b / a - 1:+.2%} |")
for m, rs in recs.items():
    later = rs[len(rs) // 10:]
    print(m, "median tok/s", statistics.median(r["tokens_per_s"] for r in later if "tokens_per_s" in r))
PY
