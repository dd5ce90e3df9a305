#!/bin/bash
# The whole GPU test suite (`pytest -m "gpu and not presets"`: the presets' main jobs have their own
# script, run_graphed_presets_device.sh) in five parts, each one pytest process in the suite's own
# order on cold Triton and inductor caches (fresh folders, as on a fresh machine):
#   source .device/setup.sh; bash benchmarks/run_gpu_suite_device.sh 1      (then 2 to 5 in later calls)
#   source .device/setup.sh; bash benchmarks/run_gpu_suite_device.sh all    (4 GPUs: the parts side by side)
# (FMOE_TE=1 source .device/setup.sh for the TransformerEngine tests.)
# Parts 1-4 split the files that hold a GPU test, in pytest's order (tests/ranks, then tests/test_*.py by
# name), after test_gpu_glm.py, test_gpu_parallel_dims.py and test_peer.py: a new file falls into its
# place. Part 1 is the suite's prefix up to and past the CUDA-graph tests (tests/ranks, compile,
# cuda_graph), nothing left out before them, so an order-dependent failure shows as in one whole run.
# A CUDA error that poisons the process (an illegal memory access) fails every later test of its part only.
# Each part sees one GPU, so the tests that need two skip there; part 5 runs those (the files that
# ask for `device_count() < 2`) on two GPUs. `all` runs parts 1-4 on GPUs 0-3, then part 5 on GPUs 1 and 3
# once parts 2 and 4 are done, within the same time limit.
# Logs: $OUT/gpu_suite_<part>.log; last, the count of each outcome per file.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
part=${1:?"usage: run_gpu_suite_device.sh 1|2|3|4|5|all"}
export LC_ALL=C  # file order as pytest sorts them
began=$(date +%s)

files_of_part() {  # the GPU test files of part $1
  local n=1 f
  if [ "$1" = 5 ]; then ls tests/ranks/test_*.py tests/test_*.py | xargs grep -l "device_count() < 2"; return; fi
  for f in $(ls tests/ranks/test_*.py tests/test_*.py | xargs grep -l "mark.gpu"); do
    [ "$n" = "$1" ] && echo "$f"
    case "$f" in tests/test_gpu_glm.py|tests/test_gpu_parallel_dims.py|tests/test_peer.py) n=$((n + 1)) ;; esac
  done
}

run_part() {  # part $1 on the visible GPUs: pytest, then its summary
  local log="$OUT/gpu_suite_$1.log" start=$(date +%s) rc
  TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout $(( ${LIMIT_S:-540} - start + began )) \
    python -m pytest -v -m "gpu and not presets" -p no:cacheprovider -W ignore --durations=15 $(files_of_part "$1") > "$log" 2>&1
  rc=$?
  echo "part $1 ($(files_of_part "$1" | xargs -n1 basename | tr '\n' ' ')): pytest exit $rc" \
       "($([ $rc = 124 ] && echo 'cut at the time limit' || echo 'finished')) in $(( $(date +%s) - start )) s"
  grep -E "::.* (PASSED|FAILED|ERROR|SKIPPED)" "$log" | sed -E 's/::[^ ]* / /; s/ +\[.*//' | sort | uniq -c
  grep -E "^(FAILED|ERROR) " "$log" | head -10
  tail -1 "$log"
}

nvidia-smi --query-gpu=name --format=csv,noheader
case "$part" in
  1|2|3|4|5) run_part "$part" ;;
  all) for p in 1 3; do CUDA_VISIBLE_DEVICES=$((p - 1)) run_part $p > "$OUT/gpu_suite_$p.summary" & done
       CUDA_VISIBLE_DEVICES=1 run_part 2 > "$OUT/gpu_suite_2.summary" &
       second=$!
       CUDA_VISIBLE_DEVICES=3 run_part 4 > "$OUT/gpu_suite_4.summary"
       wait $second
       CUDA_VISIBLE_DEVICES=1,3 run_part 5 > "$OUT/gpu_suite_5.summary"
       wait; cat "$OUT"/gpu_suite_[1-5].summary ;;
  *) echo "part must be 1, 2, 3, 4, 5 or all, got '$part'" >&2; exit 2 ;;
esac
