#!/usr/bin/env bash
# Runs the CPU test suite: the plain tests, then the numba-simulator tests in a
# process of their own (NUMBA_ENABLE_CUDASIM must be set before numba is imported).
# GPU tests (-m gpu) are skipped where there is no CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pytest -q -m "not sim" "$@"
plain=$?
NUMBA_ENABLE_CUDASIM=1 "$PY" -m pytest -q -m sim "$@"
sim=$?
# pytest exits 5 when a selection is empty; that is not a failure of this suite.
[ $plain -eq 5 ] && plain=0
[ $sim -eq 5 ] && sim=0
echo "framekv tests: plain suite exit $plain, simulator suite exit $sim"
[ $plain -eq 0 ] && [ $sim -eq 0 ]
