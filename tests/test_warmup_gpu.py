"""Warm-up on a GPU: captured graphs replay a chunk, the on-disk caches make a second
process's warm-up faster, and a cuDNN plan file loads into a fresh backend."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from framekv import specs
from framekv.engine.warmup import plan_geometries, warm_up
from framekv.graphs import decode_report

pytestmark = pytest.mark.gpu


def run_tool(cache_dir: Path, json_path: Path, preset: str = "tiny") -> tuple[float, float, str]:
    """``framekv warmup`` in a new process: (warm-up seconds from the report, process
    wall, stdout)."""
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "framekv.tools.warmup", preset, "--device", "cuda",
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
    assert f"0 built, {len(plan_files)} loaded from disk" in warm_out
    assert warm < cold


def test_captured_chunk_replays_like_eager():
    result = warm_up(specs.load_preset("tiny"), device="cuda", progress=False)
    graphs, cache, stack = result.graphs, result.cache, result.stack
    assert not graphs.eager and result.report.captured == len(result.report.records)
    g = plan_geometries(specs.load_preset("tiny").warmup_plan())[0]
    cache.open(g)
    for chunk in range(4):
        for block in (32, 16):
            key = stack.forward_key(g, 32, block)
            out = graphs.replay(key).clone()
            qkv = graphs.get_static_inputs(key)["qkv"]
            # Every layer reads the same input, so the last layer's eager forward over
            # the same staged positions gives the graph's output again.
            eager = stack.layers[-1](qkv, kv_cache=cache, seq_len=32, causal_block_size=block)
            torch.testing.assert_close(out, eager, atol=2e-3, rtol=0)
        graphs.replay(stack.commit_key(g, 32))
        torch.cuda.synchronize()
        assert int(cache._open.counters[0]) == cache.committed_tokens == 32 * (chunk + 1)
    cache.shutdown()
