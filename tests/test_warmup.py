"""`framekv warmup` and `framekv.engine.warmup` on CPU: the table, the JSON, plan files,
clear errors, and a cache left at position 0 with graphs that replay."""
from __future__ import annotations

import argparse
import importlib.resources
import json
import subprocess
import sys

import msgspec
import pytest
import torch

from framekv import specs
from framekv.engine.warmup import (COMMIT_BLOCK, AttentionStack, plan_geometries, warm_up,
                                   warmup_items)
from framekv.graphs import decode_report
from framekv.tools import warmup as tool


def cli(argv):
    """Run ``framekv warmup ...`` in process, through the subparser `add_parser` registers."""
    p = argparse.ArgumentParser(prog="framekv")
    tool.add_parser(p.add_subparsers(dest="command"))
    args = p.parse_args(["warmup", *argv])
    return args.func(args)


def small_plan(**kw) -> specs.WarmupPlan:
    """Two chunk lengths over one geometry (the last chunk is shorter): two entries."""
    kv = specs.KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="bfloat16",
                      tokens_per_page=4)
    rollout = specs.RolloutSpec(tokens_per_frame=6, frames_per_chunk=2, window_frames=2,
                                prompt_tokens=5, denoising_steps=1, chunks=3,
                                last_chunk_frames=1)
    return specs.WarmupPlan.from_rollout(kv, rollout, **kw)


def to_toml(plan: specs.WarmupPlan) -> str:
    """A plan as TOML, written out by hand (msgspec's TOML encoder needs an extra package)."""
    kv = "\n".join(f"{k} = {json.dumps(v)}" for k, v in msgspec.to_builtins(plan.kv).items())
    lines = [f"cache_dir = {json.dumps(plan.cache_dir)}", "", "[kv]", kv]
    for e in plan.entries:
        g = e.geometry
        lines += ["", "[[entries]]", f"token_counts = {list(e.token_counts)}",
                  f"block_sizes = {list(e.block_sizes)}", "[entries.geometry]",
                  f"pin_tokens = {g.pin_tokens}", f"window_tokens = {g.window_tokens}",
                  f"max_staged_tokens = {g.max_staged_tokens}",
                  f"causal_block_sizes = {list(g.causal_block_sizes)}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- the command
def test_tiny_prints_the_table_and_writes_json(tmp_path, capsys):
    out_json = tmp_path / "w.json"
    assert cli(["tiny", "--json", str(out_json), "--no-progress"]) == 0
    out, err = capsys.readouterr()
    assert tool.CPU_NOTE in out
    assert "tokens" in out and "reserved MiB" in out and "graphs on cpu" in out
    assert "forward T=32" in out and "commit:32" in out
    assert err == ""  # --no-progress
    report = decode_report(out_json.read_bytes())
    plan = specs.load_preset("tiny").warmup_plan()
    assert len(report.records) == plan.num_forwards + 1  # one chunk length: one commit
    assert [r.status for r in report.records] == ["captured"] * len(report.records)
    assert report.graphs == report.captured == len(report.records)
    assert report.device == "cpu"
    assert decode_report(json.dumps(msgspec.to_builtins(report))) == report


def test_progress_goes_to_stderr(capsys):
    assert cli(["tiny"]) == 0
    out, err = capsys.readouterr()
    assert "warm-up [" in err and "done" in err
    assert "warm-up [" not in out


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_plan_file(tmp_path, capsys, suffix):
    plan = small_plan(cache_dir=str(tmp_path / "cache"))
    path = tmp_path / f"plan{suffix}"
    path.write_bytes(specs.encode_json(plan) if suffix == ".json" else to_toml(plan).encode())
    assert specs.load(path, specs.WarmupPlan) == plan
    out_json = tmp_path / "w.json"
    assert cli([str(path), "--json", str(out_json), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "cache dir:" in out and "unused on cpu" in out
    report = decode_report(out_json.read_bytes())
    assert len(report.records) == plan.num_forwards + 2  # two chunk lengths
    assert {r.tokens for r in report.records} == {6, 12}
    assert not (tmp_path / "cache").exists()  # nothing is compiled on CPU


def test_preset_file_path(capsys):
    path = importlib.resources.files("framekv.specs") / "presets" / "tiny.toml"
    assert cli([str(path), "--no-progress"]) == 0
    assert "warm-up of" in capsys.readouterr().out


@pytest.mark.parametrize("plan, words", [
    ("missing.toml", ["plan file not found", "missing.toml"]),
    ("no/such/plan.json", ["plan file not found"]),
    ("nope", ["preset name", "unknown preset 'nope'", "available:", "tiny"]),
    ("plan.yaml", ["unknown preset 'plan.yaml'", ".toml/.json plan file"]),
])
def test_bad_plan_errors_are_clear(capsys, plan, words):
    assert cli([plan, "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("framekv warmup: error: ")
    for w in words:
        assert w in err


def test_invalid_plan_file_names_the_field(tmp_path, capsys):
    data = msgspec.to_builtins(small_plan())
    data["kv"]["tokens_per_page"] = 48
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert cli([str(path)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and "tokens_per_page" in err and "power of two" in err


@pytest.mark.parametrize("device, words", [("gpu", ["cpu or cuda"]),
                                           ("meta", ["cpu or cuda"])])
def test_bad_device(capsys, device, words):
    assert cli(["tiny", "--device", device, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words)


def test_failed_capture_names_the_plan_item(capsys, monkeypatch):
    from framekv.engine import CachedAttention

    def broken(self, *args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(CachedAttention, "forward", broken)
    assert cli(["tiny", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "kernel exploded" in err and "warm-up plan item 0: tokens=32 block_size=16" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_cuda_without_a_gpu_says_so(capsys):
    assert cli(["tiny", "--device", "cuda", "--no-progress"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_module_entry_point_and_light_import():
    out = subprocess.run([sys.executable, "-m", "framekv.tools.warmup", "tiny", "--no-progress"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert tool.CPU_NOTE in out.stdout and "3 graphs on cpu" in out.stdout
    code = ("import sys, framekv.tools.warmup\n"
            "assert 'torch' not in sys.modules and 'cudnn' not in sys.modules\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---------------------------------------------------------------------------- the engine side
def test_items_put_one_commit_after_each_chunk_length():
    plan = small_plan()
    items = warmup_items(plan)
    g = plan_geometries(plan)[0]
    assert [(t, b) for _, t, b in items] == [(12, 6), (12, 12), (12, COMMIT_BLOCK), (6, 6),
                                             (6, COMMIT_BLOCK)]
    assert all(geometry == g for geometry, _, _ in items)
    repeated = specs.WarmupPlan(plan.kv, plan.entries + plan.entries[:1])
    assert sum(b == COMMIT_BLOCK for _, _, b in warmup_items(repeated)) == 2


def test_after_warm_up_every_geometry_opens_at_position_zero():
    result = warm_up(small_plan(), device="cpu", progress=False)
    cache = result.cache
    assert not cache.is_open
    assert cache.dtype == torch.float32  # CPU computes in fp32 whatever the plan says
    assert not cache.k_pool.any() and not cache.v_pool.any()  # no warm-up garbage
    for g in plan_geometries(small_plan()):
        cache.open(g)
        assert cache.committed_tokens == 0 and cache.staged_tokens == 0
        assert cache._open.counters.tolist() == [0, cache._open.host.ring_base, 0, 0]
        cache.close()
    cache.shutdown()


def test_warmed_graphs_replay_a_chunk():
    result = warm_up(specs.load_preset("tiny"), device="cpu", progress=False)
    graphs, cache, stack = result.graphs, result.cache, result.stack
    g = stack.geometries[0]
    assert stack.num_heads == 4  # the preset model's query heads, not its 2 K/V heads
    cache.open(g)
    for chunk in range(3):
        for block in (32, 16):
            out = graphs.replay(stack.forward_key(g, 32, block))
            assert out.shape == (1, 32, 4, 16) and torch.isfinite(out).all()
        graphs.replay(stack.commit_key(g, 32))
        assert cache.committed_tokens == 32 * (chunk + 1)
    assert len(graphs) == 3 and all(k.owner == stack.owner for k in graphs.keys())
    cache.shutdown()


def test_plan_without_a_preset_uses_mha():
    stack = AttentionStack(small_plan().kv, plan_geometries(small_plan()), device="cpu")
    key = stack.forward_key(stack.geometries[0], 6, 6)
    assert stack.num_heads == 2 and key.inputs[0].shape == (1, 6, 6, 16)
    stack.cache.shutdown()


def test_numba_disk_cache_reaches_every_kernel(tmp_path):
    code = (
        "import os, sys\n"
        "from framekv.ops import _launch\n"
        f"d = {str(tmp_path / 'numba')!r}\n"
        "assert _launch.enable_disk_cache(d)\n"
        "assert os.environ['NUMBA_CACHE_DIR'] == d and len(_launch._KERNELS) == 6\n"
        "for k in _launch._KERNELS:\n"
        "    c = k._dispatcher._cache\n"
        "    assert type(c).__name__ == 'CUDACache', c\n"
        "    assert c._cache_path.startswith(d), c._cache_path\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
