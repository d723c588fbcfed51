#!/usr/bin/env bash
# Runs everything that needs a GPU in one go: `framekv info`, the GPU test suite,
# `framekv bench` and the benchmark scripts, writing logs and JSON under OUT (default ./out).
#   OUT=/tmp/results bash scripts/gpu-suite.sh [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0
"$PY" -m framekv.tools.cli info | tee "$OUT/info.txt"
"$PY" -m pytest -m gpu -v -rs --durations=15 "$@" 2>&1 | tee "$OUT/pytest-gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PY" -m framekv.tools.cli bench --json "$OUT/bench.json" --png "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
"$PY" benchmarks/resident_waits.py 2>&1 | tee "$OUT/resident_waits.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
for bench in benchmarks/bench_*.py; do
  [ -f "$bench" ] || continue
  name=$(basename "$bench" .py)
  "$PY" "$bench" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
exit $status
