#!/usr/bin/env bash
# Installs framekv into the current Python environment.
#   bash scripts/install.sh        # the runtime (the main job: framekv demo)
#   bash scripts/install.sh test   # the runtime and the test tools
#   bash scripts/install.sh cluster  # the runtime and Ray Serve (framekv serve --replicas)
# Where no torch is installed, torch's CPU build (torch==2.13.0+cpu) is installed first
# where pip finds one (a wheel folder or an index that pip is configured with holds it):
# a plain `torch` requirement would pull a multi-GB CUDA build on Linux. Where pip finds
# none, the script says so and installs torch==2.13.0 from the package index as it
# comes (on Linux x86-64, the CUDA build). An existing torch is kept. Where torch sees a
# CUDA device, the GPU extra (nvidia-cudnn-frontend, the cuDNN backend) comes too.
# The test tools include a headless browser for the served page: Debian's chromium,
# installed through apt-get where it is missing (as root, or through sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=2.13.0
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "framekv: no torch found, installing torch's CPU build torch==$TORCH+cpu"
  if ! "$PY" -m pip install -q "torch==$TORCH+cpu" >/dev/null 2>&1; then
    echo "framekv: no CPU build of torch $TORCH at hand; installing torch==$TORCH from" \
         "the package index instead (on Linux x86-64, the CUDA build)"
    "$PY" -m pip install -q "torch==$TORCH"
  fi
fi
extras=()
[ "${1:-}" = "test" ] && extras+=(test)
[ "${1:-}" = "cluster" ] && extras+=(cluster)
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "framekv: torch sees a CUDA device, installing the GPU extra (nvidia-cudnn-frontend)"
  extras+=(gpu)
fi
if [ "${1:-}" = "test" ] && ! command -v chromium >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  echo "framekv: installing Debian's chromium for the page tests"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get install -y -q chromium >/dev/null \
    || { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium >/dev/null; }
fi
spec="."
[ ${#extras[@]} -gt 0 ] && spec=".[$(IFS=,; echo "${extras[*]}")]"
"$PY" -m pip install -q -e "$spec"
# pyenv and similar shims learn about new console scripts only after a rehash.
command -v pyenv >/dev/null 2>&1 && pyenv rehash || true
