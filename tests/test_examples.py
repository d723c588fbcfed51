"""The README's example runs as shipped."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_cached_attention_example_runs_and_matches_reference():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "cached_attention.py")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 6 and lines[-1].startswith("chunk 5: committed 192 tokens")
    errors = [float(line.rsplit(" ", 1)[1]) for line in lines]
    assert max(errors) < 1e-5


@pytest.mark.parametrize("model", ["reference", "wan-diffusers"])
def test_streaming_example_embeds_the_scheduler(model):
    """Both models' chunks in one layout: frame numbers read from [C, F, H, W]."""
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "streaming.py"), "--device",
                          "cpu", "--model", model], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    for seed in (1, 2, 3):
        mine = [line for line in lines if line.startswith(f"session {seed}:")]
        assert mine[:3] == [f"session {seed}: chunk {i}, frames {2 * i}..{2 * i + 1} of 4x8x8, "
                            f"batch of {line.rsplit(' ', 1)[1]}" for i, line in enumerate(mine[:3])]
        assert mine[-1] == f"session {seed}: done"
    assert len((ROOT / "examples" / "streaming.py").read_text().splitlines()) < 40
