#!/usr/bin/env bash
# One device call (<= 8 min on an H200): the exact linear's tile sweep + the exact-vs-fast benchmark with the
# winning tiles (benchmarks/exact_kernels.py --sweep), then the gpu tests of the exact kernels.
#
#   bash benchmarks/run_exact_sweep.sh       # everything under $OUT (default ./exact_out)
#
# $OUT gets: exact_tiles.json (the chosen table, written as soon as the sweep ends), exact_kernels.json (the
# whole report), exact_kernels.log, results.jsonl (this run's rows), gpu_tests.log. The gpu tests get the time
# left of 470 s (compiling the 8B-shape variants takes minutes: when cut, run them alone:
# `python3 -m pytest -q -m gpu tests/runtime/test_exact_kernels.py`). SKIP_TESTS=1 skips them.
# Exit status: the benchmark's, else pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export OUT=${OUT:-$ROOT/exact_out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
began=$SECONDS
# dflash_trt.* maps onto the top-level folders (pyproject package-dir): an editable install resolves them.
$PY -m pip install --quiet --no-deps --no-build-isolation -e "$ROOT" > "$OUT/pip.log" 2>&1 || tail -5 "$OUT/pip.log"

timeout 390 $PY benchmarks/exact_kernels.py --sweep --sweep-seconds 180 --reps 10 --results "$OUT/results.jsonl" \
  > "$OUT/exact_kernels.log" 2>&1
bench=$?
grep -E "^(sweep|  [a-z_]+ +(BEST|M=1 best))|^plan.EXACT_TILES|^    \(" "$OUT/exact_kernels.log"
tail -n 32 "$OUT/exact_kernels.log"
echo "benchmark exit $bench after $((SECONDS - began)) s"

status=$bench
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  # the kernel-level tests first (8B shapes, bit-invariance, the split-K sums), then the executor-level ones
  for selection in "on_cuda" "not on_cuda"; do
    left=$((470 - (SECONDS - began)))
    if [ $left -lt 30 ]; then
      echo "gpu tests -k '$selection' skipped: ${left} s left"
      continue
    fi
    timeout $left $PY -m pytest -q -m gpu -p no:cacheprovider -k "$selection" tests/runtime/test_exact_kernels.py >> "$OUT/gpu_tests.log" 2>&1
    tests=$?
    tail -n 12 "$OUT/gpu_tests.log"
    echo "gpu tests -k '$selection' exit $tests (timeout ${left} s) after $((SECONDS - began)) s"
    [ $status -eq 0 ] && status=$tests
  done
fi
exit $status
