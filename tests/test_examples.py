"""The README's example runs as shipped."""
from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cached_attention_example_runs_and_matches_reference():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "cached_attention.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 6 and lines[-1].startswith("chunk 5: committed 192 tokens")
    errors = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert max(errors) < 1e-5


def test_server_example_serves_deterministic_replays():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "server.py"), "--self-test",
                          "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "same request, same latents: True; bad request answered 400" in out.stdout
