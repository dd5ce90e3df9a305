#!/bin/bash
# Issue 65 on one GPU: LoRA's GPU tests, then benchmarks/lora_step.py on the fine-grained shape
# (LoRA against full fine-tuning, compiled), then Qwen3-30B-A3B's full shape with LoRA alone
# (a step of 8 x 4096 tokens, remat full). Logs under $OUT; a short table last.
#   bash benchmarks/run_lora_device.sh [tests] [fine] [30b]     (all three by default)
set -u
OUT=${OUT:-/tmp/lora-device}
mkdir -p "$OUT"
parts=${*:-tests fine 30b}
for part in $parts; do
  case $part in
    tests) python -m pytest -q -m gpu tests/test_lora.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -4 ;;
    fine) python benchmarks/lora_step.py --shape fine --compile 2>&1 | tee "$OUT/fine_compiled.log" ;;
    30b) python benchmarks/lora_step.py --model qwen3-30b-a3b --batch 8 --seq 4096 --remat full --loss-chunk 4096 \
           --compile --steps 6 --warmup 2 2>&1 | tee "$OUT/qwen3_30b_one_gpu.log" ;;
    *) echo "unknown part $part (tests, fine, 30b)"; exit 2 ;;
  esac
done
echo "=== summary ==="
grep -h "passed\|failed" "$OUT/gpu_tests.log" 2>/dev/null | tail -1
for f in "$OUT"/fine_compiled.log "$OUT"/qwen3_30b_one_gpu.log; do
  [ -f "$f" ] && { echo "--- $(basename "$f")"; grep -h "^|\|x (target\|LoRA on one GPU\|Error\|error" "$f" | tail -8; }
done
