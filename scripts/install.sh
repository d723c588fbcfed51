#!/usr/bin/env bash
# Installs framekv into the current Python environment.
#   bash scripts/install.sh        # the runtime (the main job: framekv demo)
#   bash scripts/install.sh test   # the runtime and the test tools
# Where no torch is installed, the CPU build is installed first (a plain `torch`
# requirement would pull a multi-GB CUDA build); an existing torch is kept. Where torch
# sees a CUDA device, the GPU extra (nvidia-cudnn-frontend, the cuDNN backend) comes too.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "framekv: no torch found, installing the CPU build torch==2.13.0"
  "$PY" -m pip install -q "torch==2.13.0"
fi
extras=()
[ "${1:-}" = "test" ] && extras+=(test)
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "framekv: torch sees a CUDA device, installing the GPU extra (nvidia-cudnn-frontend)"
  extras+=(gpu)
fi
spec="."
[ ${#extras[@]} -gt 0 ] && spec=".[$(IFS=,; echo "${extras[*]}")]"
"$PY" -m pip install -q -e "$spec"
# pyenv and similar shims learn about new console scripts only after a rehash.
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
