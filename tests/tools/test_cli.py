"""The command line's foundation: help, info, and that importing framekv stays light."""
from __future__ import annotations

import json
import subprocess
import sys

from framekv.tools.cli import main


def test_help_lists_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "info" in out and "demo" in out


def test_info_json_reports_versions_and_backends(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    for key in ("torch", "numba", "numba-cuda", "cuda-python", "cudnn-frontend", "msgspec"):
        assert key in info["versions"]
    assert info["backends"]["reference"]["usable"] is True
    cudnn = info["backends"]["cudnn"]
    assert isinstance(cudnn["usable"], bool)
    if not cudnn["usable"]:
        assert cudnn["reason"]  # an unusable backend always says why


def test_info_text(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("framekv ") and "backends:" in out and "reference" in out


def test_import_does_not_touch_cuda_or_cudnn():
    code = ("import sys, framekv, framekv.specs, framekv.ops, framekv.engine, framekv.graphs, "
            "framekv.tools.cli\n"
            "import torch\n"
            "assert 'cudnn' not in sys.modules, 'cudnn imported'\n"
            "assert not torch.cuda.is_initialized(), 'CUDA initialised'\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
