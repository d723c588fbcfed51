"""Test suite layout.

tests/ mirrors the package: a module's tests sit under the folder of its subpackage
(tests/ops/, tests/engine/cache/, tests/engine/serving/, tests/engine/wan/,
tests/graphs/, tests/specs/, tests/bench/, tests/client/, tests/tools/), the two
servers' under tests/serve/ and tests/cluster/; what tests share (``*_harness.py``,
`cudnn_fake`, `wan_oracle`) and the package-wide checks (test_floors.py) stay at the
top. Test files import what they share by module name, so every test folder is on
``sys.path`` (below) and every test file's name is unique.

- plain tests: CPU, run by CI (`pytest -m "not gpu"`).
- ``gpu``: need a CUDA GPU; skipped where there is none.
- ``sim``: run numba kernels under the CUDA simulator. numba reads
  NUMBA_ENABLE_CUDASIM when it is first imported, so these run in their own
  process with the variable set, and then only they run.
"""
from __future__ import annotations

import os
import pathlib
import sys

import pytest

_TESTS = pathlib.Path(__file__).resolve().parent
for _folder in sorted(p for p in _TESTS.rglob("*") if p.is_dir() and p.name != "__pycache__"):
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))
if str(_TESTS) not in sys.path:
    sys.path.append(str(_TESTS))

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    has_cuda = None
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_sim = pytest.mark.skip(reason="simulator test: run with NUMBA_ENABLE_CUDASIM=1 in its own process")
    skip_plain = pytest.mark.skip(reason="NUMBA_ENABLE_CUDASIM=1: only simulator tests run in this process")
    for item in items:
        is_sim = "sim" in item.keywords
        if SIMULATOR != is_sim:
            item.add_marker(skip_plain if SIMULATOR else skip_sim)
        elif "gpu" in item.keywords:
            if has_cuda is None:
                has_cuda = _cuda_available()
            if not has_cuda:
                item.add_marker(skip_gpu)


@pytest.fixture(params=["lean", "small-grid", "dispatcher"])
def launch_mode(request, monkeypatch):
    """How GPU tests launch the numba kernels. lean: default launches. small-grid: 2
    CTAs of 32 threads, so every stride loop turns. dispatcher: launches through
    numba's dispatcher (the fallback path)."""
    from framekv.ops import _launch

    if request.param == "small-grid":
        monkeypatch.setattr(_launch, "MAX_BLOCKS", 2)
        monkeypatch.setattr(_launch, "MAX_THREADS", 32)
    elif request.param == "dispatcher":
        monkeypatch.setattr(_launch, "USE_DISPATCHER", True)
    return request.param
