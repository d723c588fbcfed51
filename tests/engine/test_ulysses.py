"""Ulysses sequence parallelism: shard helpers and refusals in one process, then two
gloo ranks on CPU against the single-process attention, cache and rollout.

The multi-rank workers are module-level functions (spawned processes import them);
`test_ulysses_gpu.py` runs the same workers with NCCL and the cuDNN backend.
"""
from __future__ import annotations

import datetime
import gc
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

import msgspec
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from attention_harness import make
from framekv.engine import CachedAttention, CausalKVCache, CausalVideoDiT, ForwardContext, PagedKV
from framekv.engine.attention.ulysses import (PendingAttention, UlyssesAttention, gather_sequence,
                                              pad_to_multiple, shard_length, shard_sequence)
from framekv.engine.attention.ulysses_kv import UlyssesKV
from framekv.engine.rollout import Rollout
from framekv.specs import Geometry as G
from framekv.specs import load_preset
from framekv.tools.demo import run_demo

TINY = load_preset("tiny")
#: The attention rollout of the multi-rank test: 9 real tokens per forward (one block of
#: 9 denoising, blocks of 3 clean); the caller pads some chunks, the sharder pads the odd
#: lengths (11 -> 12, 9 -> 10), the first chunk both.
ATTN_CPU = {"dist": "gloo", "device": "cpu", "backend": "reference", "dtype": "float32",
            "geometry": (5, 20, 9, (3, 9)), "tpp": 4, "chunk": 9, "frame": 3,
            "lengths": (11, 9, 10, 9, 9, 12, 9, 9), "H": 4, "Hkv": 2, "D": 16, "layers": 2,
            "tol": 1e-5}
#: tiny with 6 x 6 latents: 9 tokens per frame, chunks of 18, a last chunk of 9 and a
#: 7-token prompt, so the prompt and the last chunk are split with a padding row.
ODD_TINY = (msgspec.structs.replace(TINY.model, latent_height=6, latent_width=6),
            msgspec.structs.replace(TINY.rollout, tokens_per_frame=9, prompt_tokens=7,
                                    chunks=5, last_chunk_frames=1, window_frames=2))


# ---------------------------------------------------------------------- one process


def test_pad_and_shard_helpers():
    x = torch.arange(2 * 7 * 3, dtype=torch.float32).view(2, 7, 3)
    assert pad_to_multiple(x, 7) is x
    p = pad_to_multiple(x, 4)
    assert p.shape == (2, 8, 3) and torch.equal(p[:, :7], x) and not p[:, 7:].any()
    assert pad_to_multiple(x, 3, dim=2) is x and pad_to_multiple(x, 4, dim=0).shape == (4, 7, 3)
    shards = [shard_sequence(x, 3, r) for r in range(3)]
    assert [s.shape[1] for s in shards] == [3, 3, 3] == [shard_length(7, 3)] * 3
    assert torch.equal(torch.cat(shards, dim=1), pad_to_multiple(x, 3))
    assert shard_sequence(x, 1, 0) is not None and torch.equal(shard_sequence(x, 1, 0), x)
    assert torch.equal(gather_sequence(shards[0], 2, world_size=1), x[:, :2])


@pytest.mark.parametrize("call,match", [
    (lambda x: pad_to_multiple(x, 0), "multiple must be a positive integer, got 0"),
    (lambda x: shard_sequence(x, 2, 2), r"rank must be an integer in \[0, 2\), got 2"),
    (lambda x: shard_sequence(x, 0, 0), "world_size must be a positive integer, got 0"),
])
def test_helper_refusals(call, match):
    with pytest.raises(ValueError, match=match):
        call(torch.zeros(1, 5, 2))


@pytest.mark.parametrize("args,world,match", [
    ((6, 2, 16), 4, "num_heads must be a multiple of the world size: expected a multiple of 4, got 6"),
    ((8, 2, 16), 4, "num_kv_heads must be a multiple of the world size: expected a multiple of 4, got 2"),
    ((4, 3, 16), 2, "num_kv_heads must be a multiple of the world size: expected a multiple of 2, got 3"),
    ((4, 0, 16), 2, "num_kv_heads must be a positive integer"),
])
def test_head_counts_must_divide_the_world(args, world, match):
    with pytest.raises(ValueError, match=match):
        UlyssesAttention(*args, world_size=world)


def _local_cache(Hkv=1):
    g, tpp = G(6, 24, 12, (4, 12)), 4
    cache = CausalKVCache(num_layers=1, num_kv_heads=Hkv, head_dim=16, dtype=torch.float32,
                          tokens_per_page=tpp, device="cpu",
                          pool_tokens=CausalKVCache.pool_tokens_for(g, tpp))
    cache.open(g)
    return cache


def test_async_refuses_a_cache_before_any_exchange():
    u = UlyssesAttention(4, 2, 16, world_size=2)
    cache = _local_cache()
    x = torch.randn(1, 6, 8, 16)
    with pytest.raises(ValueError, match="async_op=True does not take a kv_cache"):
        u(x, kv_cache=cache, seq_len=12, async_op=True)
    assert cache.staged_tokens == 0


@pytest.mark.parametrize("call,match", [
    (lambda u, c, x: u(x, kv_cache=_local_cache(2), seq_len=12),
     r"kv_cache holds 2 K/V heads; this rank's share is num_kv_heads / world_size = 2 / 2 = 1"),
    (lambda u, c, x: u(x, kv_cache=c), "seq_len .* is required with a kv_cache"),
    (lambda u, c, x: u(x, causal_block_size=4), "causal_block_size needs a kv_cache"),
    (lambda u, c, x: u(x[:, :, :7]), r"packed q must have shape \[1, S_local, 8, 16\]"),
    (lambda u, c, x: u(x[:, :, :4], x[:, :, 4:7], x[:, :, 4:7]), r"k must have shape \[1, 6, 2, 16\]"),
    (lambda u, c, x: u(x), "a world of 2 ranks needs torch.distributed initialised"),
])
def test_call_refusals(call, match):
    u = UlyssesAttention(4, 2, 16, world_size=2)
    with pytest.raises(ValueError, match=match):
        call(u, _local_cache(), torch.randn(1, 6, 8, 16))


def test_world_of_one_is_the_plain_module():
    torch.manual_seed(0)
    plain = CachedAttention(4, 2, 16, backend="reference")
    u = UlyssesAttention.wrap(plain, world_size=1)
    assert u.attn.num_heads == 4 and u.attn.backend is plain.backend
    x = torch.randn(1, 14, 8, 16)
    assert torch.equal(u(x), plain(x))
    pending = u(x, async_op=True)
    assert isinstance(pending, PendingAttention) and pending.is_completed()
    assert torch.equal(pending.wait(), plain(x))
    with pytest.raises(ValueError, match="already called"):
        pending.wait()
    # Without a cache, seq_len limits keys and queries; the rest is zero.
    out = u(x, seq_len=11)
    assert torch.equal(out[:, :11], plain(x[:, :11])) and not out[:, 11:].any()
    a, b = _local_cache(2), _local_cache(2)
    for _ in range(3):
        x = torch.randn(1, 14, 8, 16)
        assert torch.equal(u(x, kv_cache=a, seq_len=12, causal_block_size=4),
                           plain(x, kv_cache=b, seq_len=12, causal_block_size=4))
        a.commit(12)
        b.commit(12)
    assert torch.equal(a.k_pool, b.k_pool) and torch.equal(a.v_pool, b.v_pool)


def test_model_forward_with_a_world_of_one_is_unchanged():
    spec = ODD_TINY
    model = CausalVideoDiT(spec[0], prompt_tokens=spec[1].prompt_tokens)
    caches = [Rollout(spec, "cpu", use_graphs=False, model=model).cache for _ in range(2)]
    g = spec[1].geometry()
    plain, par = PagedKV(caches[0], g), UlyssesKV(model, caches[1], g, world_size=1)
    assert (par.world_size, par.rank, par.num_kv_heads) == (1, 0, spec[0].num_kv_heads)
    model.prefill(plain)
    model.prefill(par)
    gen = torch.Generator().manual_seed(3)
    lat = torch.randn(1, 4, 2, 6, 6, generator=gen)
    t, f0 = torch.full((1,), 0.5), torch.zeros(1, dtype=torch.int64)
    want = model(lat, t, ForwardContext(plain, seq_len=18, block_size=9, frame0=f0))
    got = model(lat, t, ForwardContext(par, seq_len=18, block_size=9, frame0=f0))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="this rank's num_kv_heads / world_size"):
        UlyssesKV(model, caches[0], g, world_size=2, rank=0)


# ---------------------------------------------------------------------- several ranks


def spawn(worker, cfg: dict, world: int = 2) -> None:
    """Run ``worker(rank, world, init_file, cfg)`` on ``world`` spawned processes; a
    failure in any of them fails the caller with its traceback."""
    tmp = tempfile.mkdtemp(prefix="framekv-ulysses-")
    try:
        mp.spawn(worker, args=(world, os.path.join(tmp, "init"), cfg), nprocs=world, join=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _finish() -> None:
    """Leave together: a rank tearing gloo down while the other still talks to it
    aborts the process."""
    dist.barrier()
    dist.destroy_process_group()


def _init(rank: int, world: int, init_file: str, cfg: dict) -> torch.device:
    device = torch.device(cfg["device"] if cfg["device"] == "cpu" else f"cuda:{rank}")
    torch.set_num_threads(1)  # two ranks on a small CI machine: no thread oversubscription
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(cfg["dist"], init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    return device


def _resident_positions(cache, geometry: G) -> list[int]:
    """The fixed region and the window the next block sees (always resident)."""
    C, P, W = cache.committed_tokens, geometry.pin_tokens, geometry.window_tokens
    return list(range(min(P, C))) + list(range(max(P, C - W), C))


def assert_cache_holds_heads(local, full, positions, heads: slice, tol: float = 0.0) -> None:
    """Each position's K/V in ``local`` equals ``heads`` of it in ``full`` (every layer):
    bit for bit, or within ``tol`` (relative to max(1, max |K/V|)) where the K/V were
    computed from sharded rows."""
    for layer in range(full.num_layers):
        for pool_l, pool_f in ((local.k_pool, full.k_pool), (local.v_pool, full.v_pool)):
            slots_l = torch.tensor([local.slot_of(p) for p in positions], dtype=torch.long)
            slots_f = torch.tensor([full.slot_of(p) for p in positions], dtype=torch.long)
            got, want = pool_l[layer][slots_l], pool_f[layer][slots_f][:, heads]
            scale = max(1.0, want.float().abs().max().item())
            err = (got.float() - want.float()).abs().max().item() / scale if tol else 0.0
            assert (err <= tol) if tol else torch.equal(got, want), (
                f"layer {layer}: K/V differ from the heads {heads} of the full cache ({err:.3g})")


def attention_rollout_worker(rank: int, world: int, init_file: str, cfg: dict) -> None:
    """A cached-attention rollout through `UlyssesAttention` on every rank against the
    single-process `CachedAttention` over a full-head cache (run on every rank)."""
    device = _init(rank, world, init_file, cfg)
    dtype = getattr(torch, cfg["dtype"])
    g, tpp, H, Hkv, D = G(*cfg["geometry"]), cfg["tpp"], cfg["H"], cfg["Hkv"], cfg["D"]
    kw = {"layers": cfg["layers"], "D": D, "dtype": dtype, "device": device, "backend": cfg["backend"]}
    full, mods = make(g, tpp, H=H, Hkv=Hkv, **kw)
    local, _ = make(g, tpp, H=H // world, Hkv=Hkv // world, **kw)
    ulysses = [UlyssesAttention.wrap(m, world_size=world) for m in mods]
    assert all(u.attn.num_kv_heads == local.num_kv_heads for u in ulysses)
    heads = slice(rank * Hkv // world, (rank + 1) * Hkv // world)
    gen, T = torch.Generator().manual_seed(cfg.get("seed", 0)), cfg["chunk"]
    worst = 0.0
    for i, S in enumerate(cfg["lengths"]):
        for j, b in enumerate([T, T, cfg["frame"]]):
            for layer, (mod, u) in enumerate(zip(mods, ulysses)):
                qkv = torch.randn(1, S, H + 2 * Hkv, D, generator=gen).to(device, dtype)
                want = mod(qkv, kv_cache=full, seq_len=T, causal_block_size=b)      # [1, S, H, D]
                shard = shard_sequence(qkv, world, rank)                            # [1, S_l, ., D]
                if (i + j + layer) % 2:  # packed and separate inputs alike
                    got = u(shard, kv_cache=local, seq_len=T, causal_block_size=b)
                else:
                    got = u(shard[:, :, :H], shard[:, :, H:H + Hkv], shard[:, :, H + Hkv:],
                            kv_cache=local, seq_len=T, causal_block_size=b)
                want = shard_sequence(want, world, rank)
                assert got.shape == want.shape == (1, -(-S // world), H, D)
                scale = max(1.0, want.float().abs().max().item())
                worst = max(worst, (got.float() - want.float()).abs().max().item() / scale)
                real = max(0, min(T - rank * got.shape[1], got.shape[1]))
                assert not got[:, real:].any(), "padding rows must come back zero"
        C = full.committed_tokens
        assert_cache_holds_heads(local, full, list(range(C, C + T)), heads)        # staged
        full.commit(T)
        local.commit(T)
        assert_cache_holds_heads(local, full, _resident_positions(full, g), heads)
    assert local.committed_tokens > g.pin_tokens + g.window_tokens, "the window never slid"
    assert worst <= cfg["tol"], f"rank {rank}: max error {worst:.3g} > {cfg['tol']} (relative)"
    _finish()


def dense_worker(rank: int, world: int, init_file: str, cfg: dict) -> None:
    """Attention without a cache: packed MHA (one exchange), GQA (three), async, and
    seq_len limiting the keys to the real rows of a padded sequence."""
    _init(rank, world, init_file, cfg)
    gen = torch.Generator().manual_seed(1)
    for H, Hkv, S in ((4, 4, 10), (4, 2, 13), (8, 2, 7)):
        plain = CachedAttention(H, Hkv, 16, backend="reference")
        u = UlyssesAttention.wrap(plain)
        qkv = torch.randn(1, S, H + 2 * Hkv, 16, generator=gen)
        want = shard_sequence(plain(qkv), world, rank)
        shard = shard_sequence(qkv, world, rank)
        for got in (u(shard, seq_len=S), u(shard, seq_len=S, async_op=True).wait(),
                    u(shard[:, :, :H], shard[:, :, H:H + Hkv], shard[:, :, H + Hkv:], seq_len=S)):
            assert (got - want).abs().max().item() <= 1e-5, (H, Hkv, S)
        if S % world == 0:  # nothing padded: seq_len may be left out
            assert (u(shard) - want).abs().max().item() <= 1e-5
    _finish()


def model_rollout_worker(rank: int, world: int, init_file: str, cfg: dict) -> None:
    """The reference model's rollout on every rank against the single-process one."""
    device = _init(rank, world, init_file, cfg)
    spec, chunks = cfg["spec"], cfg["chunks"]
    single = Rollout(spec, device, backend=cfg["backend"], use_graphs=False)
    par = Rollout(spec, device, use_graphs=cfg.get("graphs", True), model=single.model,
                  process_group=dist.group.WORLD)
    assert par.cache.num_kv_heads == spec[0].num_kv_heads // world
    heads = slice(rank * par.cache.num_kv_heads, (rank + 1) * par.cache.num_kv_heads)
    single.prefill()
    par.prefill()
    tol = cfg["cache_tol"]
    assert_cache_holds_heads(par.cache, single.cache, list(range(spec[1].prompt_tokens)), heads, tol)
    worst = 0.0
    for i in range(chunks):
        want, got = single.step(), par.step()
        assert want.shape == got.shape
        scale = max(1.0, want.abs().max().item())
        worst = max(worst, (got - want).abs().max().item() / scale)
        if i < cfg.get("cache_chunks", chunks):  # bf16 K/V drift apart with the latents
            assert_cache_holds_heads(par.cache, single.cache,
                                     _resident_positions(single.cache, single.geometry), heads, tol)
    assert worst <= cfg["tol"], f"rank {rank}: latents differ by {worst:.3g} (relative)"
    single.close()
    par.close()
    _finish()


def teardown_worker(rank: int, world: int, init_file: str, cfg: dict) -> None:
    """A rank's rollout, then the group destroyed: no gloo worker thread may outlive it
    (one alive at interpreter shutdown aborts the process as it frees its tensors)."""
    device = _init(rank, world, init_file, cfg)
    r = Rollout(ODD_TINY, device, use_graphs=False, process_group=dist.group.WORLD)
    r.prefill()
    r.step()
    r.close()
    del r
    _finish()
    gc.collect()
    left = _gloo_threads()
    assert not left, f"rank {rank}: gloo threads alive after destroy_process_group: {left}"


def demo_teardown_worker(rank: int, world: int, init_file: str, cfg: dict) -> None:
    """``framekv demo`` as torchrun starts it: the demo initialises and destroys the
    group itself, and must leave no gloo worker thread behind."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
    report = run_demo("tiny", chunks=2, check_chunks=1, device="cpu", stream=io.StringIO(),
                      progress=False)
    assert report["ok"] and report["world_size"] == world and not dist.is_initialized()
    left = _gloo_threads()
    assert not left, f"rank {rank}: gloo threads alive after the demo: {left}"


def _gloo_threads() -> list[str]:
    """Names of this process's threads that gloo started."""
    task = "/proc/self/task"
    names = [open(os.path.join(task, t, "comm")).read().strip() for t in os.listdir(task)]
    return [n for n in names if "gloo" in n]


def test_two_rank_attention_rollout_equals_single_process():
    spawn(attention_rollout_worker, ATTN_CPU)


def test_two_rank_dense_attention_equals_single_process():
    spawn(dense_worker, {"dist": "gloo", "device": "cpu"})


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task")
def test_a_destroyed_group_leaves_no_gloo_threads():
    spawn(teardown_worker, {"dist": "gloo", "device": "cpu"})


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc/self/task")
def test_demo_leaves_no_gloo_threads():
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn(demo_teardown_worker, {"port": port})


def test_two_rank_model_rollout_equals_single_process():
    spawn(model_rollout_worker, {"dist": "gloo", "device": "cpu", "backend": "reference",
                                 "spec": ODD_TINY, "chunks": 6, "tol": 1e-4, "cache_tol": 1e-5})


def test_demo_under_torchrun_prints_on_rank_zero_only(tmp_path):
    report = tmp_path / "demo.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "framekv.tools.cli", "demo", "--chunks", "2", "--check-chunks", "1",
           "--no-progress", "--device", "cpu", "--json", str(report)]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("framekv demo: preset tiny, device cpu") == 1, res.stdout
    assert ("parallel: Ulysses sequence parallelism over 2 ranks; each rank attends 2/1 heads "
            "and caches its 1 K/V heads") in res.stdout
    assert "FAILED" not in res.stdout and res.stdout.count("graphs vs eager") == 1
    rep = json.loads(report.read_text())
    assert rep["ok"] and rep["world_size"] == 2 and rep["rank"] == 0 and rep["frames"] == 4
