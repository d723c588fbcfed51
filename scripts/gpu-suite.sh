#!/usr/bin/env bash
# Runs everything that needs a GPU in one go: `framekv info`, the GPU test suite,
# `framekv bench` and the framekv.bench modules, writing logs and JSON under OUT
# (default ./out).
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
for name in commit graphs launch merge ops wait; do
  "$PY" -m "framekv.bench.$name" --json "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
# Ulysses needs several GPUs and one process per GPU.
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())')
if [ "${gpus:-0}" -ge 2 ]; then
  "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 -m framekv.bench.ulysses \
    --json "$OUT/ulysses.json" 2>&1 | tee "$OUT/ulysses.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "framekv.bench.ulysses skipped: it needs 2 GPUs, this machine has ${gpus:-0}"
fi
exit $status
