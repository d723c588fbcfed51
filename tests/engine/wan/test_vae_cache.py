"""`vae_cache.ChunkCache`, a chunk's in-place view of its rows in a coder's arena: loads
into any strided buffer (some of an entry's steps too, from the arena, as zeros or from
a held copy), stores to the arena's rows only (other rows untouched), a
video's start reads zeros and, when writing, leaves zeros in an entry it never
stores; a chunk that must not write leaves the arena as it was and still reads back
what it stored, as a copy."""
from __future__ import annotations

import torch

from framekv.engine.wan.vae_cache import ChunkCache


def _arena(S=4):
    # row r, step s, entry l: every value stamped 100 l + 10 s + r, so a wrong row, step
    # or entry shows
    return [torch.full((S, 2, 3, 5, c), 0.0) + (100 * l + torch.arange(S).view(S, 1, 1, 1, 1))
            + 10 * torch.arange(2).view(1, 2, 1, 1, 1) for l, c in enumerate((6, 4))]


def test_load_gathers_the_rows_into_a_strided_buffer():
    arena = _arena()
    cache = ChunkCache(arena, torch.tensor([3, 1]), first=False, write=True)
    buf = torch.zeros(2, 5, 3, 5, 3, 8)                  # [B, T, H, W, taps, width]
    cache.load(0, buf[:, 1:3, :, :, 1, :6])
    assert torch.equal(buf[0, 1:3, :, :, 1, :6], arena[0][3])
    assert torch.equal(buf[1, 1:3, :, :, 1, :6], arena[0][1])
    buf[:, 1:3, :, :, 1, :6] = 0
    assert not buf.any()                                 # nothing written beside the view
    assert torch.equal(cache.get(1), arena[1][[3, 1]]) and cache.empty(1, 7).shape == (2, 7, 3, 5, 4)


def test_a_load_of_some_steps_reads_those_alone_from_the_arena_zeros_or_the_copy():
    arena = _arena()
    cache = ChunkCache(arena, torch.tensor([3, 1]), first=False, write=True)
    buf = torch.zeros(2, 3, 3, 5, 3, 12)                 # [B, T, H, W, taps, width]
    cache.load(0, buf[:, :1, :, :, 2, 1:7], steps=slice(1, 2))
    assert torch.equal(buf[:, :1, :, :, 2, 1:7], arena[0][[3, 1], 1:])
    cache.load(0, buf[:, 1:, :, :, 0, ::2], steps=slice(0, 2))   # strided channels
    assert torch.equal(buf[:, 1:, :, :, 0, ::2], arena[0][[3, 1]])
    buf[:, :1, :, :, 2, 1:7] = 0
    buf[:, 1:, :, :, 0, ::2] = 0
    assert not buf.any()                                 # nothing written beside the views
    for first in (True, False):
        cache = ChunkCache(arena, torch.tensor([2]), first=first, write=False)
        out = torch.full((1, 1, 3, 5, 6), 7.0)
        cache.load(0, out, steps=slice(1, 2))
        assert torch.equal(out, torch.zeros_like(out) if first else arena[0][2:3, 1:])
        value = torch.randn(1, 2, 3, 5, 6)
        cache.store(0, value)
        cache.load(0, out, steps=slice(1, 2))
        assert torch.equal(out, value[:, 1:])            # the held copy's step


def test_store_writes_the_rows_alone():
    arena = _arena()
    before = [t.clone() for t in arena]
    cache = ChunkCache(arena, torch.tensor([2, 0]), first=False, write=True)
    value = torch.randn(2, 2, 3, 5, 6)
    cache.store(0, value)
    assert torch.equal(arena[0][2], value[0]) and torch.equal(arena[0][0], value[1])
    assert torch.equal(arena[0][[1, 3]], before[0][[1, 3]]) and torch.equal(arena[1], before[1])
    assert torch.equal(cache.get(0), value)              # read back from the arena


def test_a_video_start_reads_zeros_and_leaves_zeros_where_it_stores_nothing():
    arena = _arena()
    before = [t.clone() for t in arena]
    cache = ChunkCache(arena, torch.tensor([1]), first=True, write=True)
    assert not cache.get(0).any() and not cache.get(1).any()
    value = torch.ones(1, 2, 3, 5, 6)
    cache.store(0, value)
    assert torch.equal(cache.get(0), value)              # once stored, the stored value
    assert not arena[1][1].any()                         # never stored: zeros for the next chunk
    assert torch.equal(arena[1][[0, 2, 3]], before[1][[0, 2, 3]])


def test_a_chunk_that_must_not_write_leaves_the_arena_and_holds_a_copy():
    for first in (True, False):
        arena = _arena()
        before = [t.clone() for t in arena]
        cache = ChunkCache(arena, torch.tensor([2]), first=first, write=False)
        buf = torch.randn(1, 4, 3, 5, 6)
        cache.store(0, buf[:, -2:])
        want = buf[:, -2:].clone()
        buf.zero_()                                      # the buffer is reused: the copy stays
        assert torch.equal(cache.get(0), want)
        assert torch.equal(cache.get(1), torch.zeros(1, 2, 3, 5, 4) if first else before[1][[2]])
        assert all(torch.equal(a, b) for a, b in zip(arena, before))
