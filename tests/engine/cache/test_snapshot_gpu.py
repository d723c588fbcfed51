"""Snapshots on a CUDA device: the export's copy runs on a side stream and whatever
writes the sequence's pages after it waits for it on the device; a stream restored into
another rollout replays its chunk graphs bit for bit against the uninterrupted one."""
from __future__ import annotations

import functools

import pytest
import torch

from cache_harness import run_rollout
from framekv.engine import CausalKVCache
from framekv.specs import Geometry as G

pytestmark = pytest.mark.gpu
roll = functools.partial(run_rollout, partial_commits=False)


def _cache(g, tpp, sequences=1):
    return CausalKVCache(num_layers=3, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16,
                         tokens_per_page=tpp, device="cuda", num_sequences=sequences,
                         pool_tokens=CausalKVCache.pool_tokens_for(g, tpp, num_sequences=sequences))


@pytest.mark.parametrize("then", ["reset", "forward", "import"])
def test_an_export_is_fenced_against_later_writes(then):
    g = G(5, 37, 12, (3, 12))
    src = _cache(g, 8)
    src.open(g)
    history: dict[int, int] = {}
    roll(src, g, commits=9, seed=2, history=history)
    from framekv.engine.cache.snapshot import kept_positions

    slots = [src.slot_of(p) for p in kept_positions(g, src.committed_tokens)]
    want = src.k_pool[:, slots].cpu(), src.v_pool[:, slots].cpu()
    # A long queue of device work ahead of the export, so its copy is still pending
    # when the host queues the writes below.
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big / 64
    snap = src.export_sequence(0)
    if then == "reset":
        src.reset_sequences([0])
    elif then == "forward":
        roll(src, g, commits=2, seed=5, history=dict(history))
    else:
        src.import_sequence(0, _cache_snapshot_at_zero(g))
    assert torch.equal(snap.k, want[0]) and torch.equal(snap.v, want[1]), (
        "the export read pages written after it")
    dst = _cache(g, 16, sequences=2)
    dst.open(g)
    dst.import_sequence(1, snap)
    roll(dst, g, commits=6, seed=3, history=history, sequence=1)


def test_every_export_of_a_sequence_is_fenced_not_only_its_latest():
    """Two exports of one sequence queued behind a long queue, then a reset: both read
    what was there (exports copy on one stream, in the order asked, so the reset's
    fence on the latest covers the earlier one too)."""
    g = G(5, 37, 12, (3, 12))
    src = _cache(g, 8)
    src.open(g)
    roll(src, g, commits=9, seed=4, history={})
    from framekv.engine.cache.snapshot import kept_positions

    slots = [src.slot_of(p) for p in kept_positions(g, src.committed_tokens)]
    want = src.k_pool[:, slots].cpu(), src.v_pool[:, slots].cpu()
    big = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        big = big @ big / 64
    first, second = src.export_sequence(0), src.export_sequence(0)
    src.reset_sequences([0])
    for snap in (first, second):
        assert torch.equal(snap.k, want[0]) and torch.equal(snap.v, want[1])


def _cache_snapshot_at_zero(g):
    c = _cache(g, 8)
    c.open(g)
    return c.export_sequence(0)


def test_a_restored_stream_replays_bit_for_bit():
    from framekv.engine import Rollout
    from framekv.engine.stream_state import StreamState

    a = Rollout("tiny", "cuda", sequences=2)
    b = Rollout("tiny", "cuda", sequences=2, model=a.model)
    for r in (a, b):
        r.capture()
        r.prefill()
    for _ in range(4):
        a.step()
    b.step()
    state = a.snapshot(1)
    b.restore(0, state)
    for _ in range(5):
        x, y = a.step(), b.step()
        assert b.path == "graphs" and torch.equal(x[1], y[0])
    assert isinstance(state, StreamState) and state.nbytes > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_reserved_exports_are_a_full_window_of_pinned_memory(dtype):
    """`reserve_exports` page-locks K and V of a full window per export (fp8: one byte a
    value); an export then lands in pinned host memory."""
    from framekv.engine.cache.snapshot import kept_positions

    g = G(5, 37, 12, (3, 12))
    c = CausalKVCache(num_layers=3, num_kv_heads=2, head_dim=16, dtype=dtype,
                      tokens_per_page=8, device="cuda",
                      pool_tokens=CausalKVCache.pool_tokens_for(g, 8))
    c.open(g)
    n = len(kept_positions(g, 5 + 37 + 12))  # the most positions a sequence keeps
    size = 1 if dtype == torch.float8_e4m3fn else 2
    assert c.reserve_exports(2) == 2 * 2 * 3 * n * 2 * 16 * size
    if dtype == torch.bfloat16:
        roll(c, g, commits=9, seed=4)
        snap = c.export_sequence(0)
        snap.synchronize()
        assert snap.k.is_pinned() and snap.v.is_pinned()
        assert snap.k.shape == (3, len(kept_positions(g, c.committed_tokens)), 2, 16)
