#!/usr/bin/env bash
# Installs framekv into the current Python environment.
#   bash scripts/install.sh        # the runtime (the main job: framekv demo)
#   bash scripts/install.sh test   # the runtime and the test tools
# Where no torch is installed, the CPU build is installed first (a plain `torch`
# requirement would pull a multi-GB CUDA build); an existing torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "framekv: no torch found, installing the CPU build torch==2.13.0"
  "$PY" -m pip install -q "torch==2.13.0"
fi
extra=""
[ "${1:-}" = "test" ] && extra="[test]"
"$PY" -m pip install -q -e ".${extra}"
# pyenv and similar shims learn about new console scripts only after a rehash.
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
