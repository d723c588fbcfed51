"""Warm-up on a GPU: a warmed cache dir makes a later process build nothing (no numba
compile, no cuDNN plan build), and the warmed rollout replays like eager."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from framekv.engine import Rollout, warm_up
from framekv.graphs import decode_report

pytestmark = pytest.mark.gpu


def run_tool(cache_dir: Path, json_path: Path, preset: str = "tiny") -> tuple[float, float, str]:
    """``framekv warmup`` in a new process: (warm-up seconds from the report, process
    wall, stdout)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "framekv.tools.cli", "warmup", preset, "--device", "cuda",
                          "--cache-dir", str(cache_dir), "--json", str(json_path), "--no-progress"],
                         capture_output=True, text=True)
    wall = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr
    print(out.stdout)
    return decode_report(json_path.read_bytes()).seconds, wall, out.stdout


def test_second_process_warms_up_faster_from_the_cache_dir(tmp_path):
    cache_dir = tmp_path / "cache"
    cold, cold_wall, cold_out = run_tool(cache_dir, tmp_path / "cold.json")
    warm, warm_wall, warm_out = run_tool(cache_dir, tmp_path / "warm.json")
    numba_files = sorted(p.name for p in (cache_dir / "numba").rglob("*") if p.is_file())
    plan_files = sorted(p.name for p in (cache_dir / "cudnn").glob("*.plan"))
    print(f"cold warm-up {cold:.3f} s (process {cold_wall:.1f} s), second process "
          f"{warm:.3f} s (process {warm_wall:.1f} s); {len(numba_files)} numba cache files, "
          f"{len(plan_files)} cuDNN plan files")
    assert any(name.endswith(".nbi") for name in numba_files), numba_files
    assert plan_files and "0 loaded from disk" in cold_out
    assert "numba kernels: 0 compiled" in warm_out, warm_out
    assert f"cuDNN plans: 0 built, {len(plan_files)} loaded from disk" in warm_out, warm_out
    assert warm < cold


def test_demo_after_warmup_builds_nothing(tmp_path):
    """``framekv warmup tiny --cache-dir D``, then ``framekv demo --cache-dir D`` in a new
    process: its captures compile no kernel and build no cuDNN plan."""
    cache_dir = tmp_path / "cache"
    run_tool(cache_dir, tmp_path / "w.json")
    report_path = tmp_path / "demo.json"
    out = subprocess.run([sys.executable, "-m", "framekv.tools.cli", "demo", "--device", "cuda",
                          "--cache-dir", str(cache_dir), "--json", str(report_path),
                          "--no-progress"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr + out.stdout
    print(out.stdout)
    builds = json.loads(report_path.read_text())["builds"]
    assert builds["numba_compiled"] == 0 and builds["cudnn_plans_built"] == 0, builds
    assert builds["numba_loaded"] > 0 and builds["cudnn_plans_loaded"] > 0, builds


def test_warmed_rollout_replays_like_eager():
    result = warm_up("tiny", device="cuda", progress=False)
    r = result.rollout
    assert not r.graphs.eager and result.report.captured == len(result.report.records) == 1
    eager = Rollout("tiny", "cuda", use_graphs=False, model=r.model)
    for rollout in (r, eager):
        rollout.prefill()
    for _ in range(8):
        assert torch.equal(r.step(), eager.step())
    assert r.paths == {"graphs": 8, "eager": 0}
    torch.cuda.synchronize()
    assert int(r.cache._open.seqs[0].counters[0]) == r.cache.committed_tokens
    r.close()
    eager.close()
