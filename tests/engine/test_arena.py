"""Host arena behaviour (CPU) and the same interface's contracts."""
from __future__ import annotations

import pytest
import torch

from framekv.engine.arena import (DEFAULT_ALIGN, HOST_CHUNK_BYTES, ArenaClosedError,
                                  ArenaExhaustedError, HostArena, carved_bytes, make_arena,
                                  round_up)


def test_carves_are_aligned_and_disjoint():
    a = HostArena(1 << 20)
    base = a.empty(0, torch.uint8).data_ptr()
    tensors = [a.empty((3, 5, 7), dt, name=f"t{i}") for i, dt in
               enumerate([torch.bfloat16, torch.float32, torch.int64, torch.uint8, torch.float16])]
    spans = []
    for t in tensors:
        assert (t.data_ptr() - base) % DEFAULT_ALIGN == 0
        assert t.is_contiguous() and t.shape == (3, 5, 7)
        spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
    spans.sort()
    assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:]))
    # Stamp every tensor, then check nothing overwrote anything else.
    for i, t in enumerate(tensors):
        t.copy_(torch.full(t.shape, i + 1, dtype=torch.float32).to(t.dtype))
    for i, t in enumerate(tensors):
        assert bool((t.float() == i + 1).all())


def test_accounting_tracks_used_and_mapped():
    a = HostArena(10 * HOST_CHUNK_BYTES)
    assert a.reserved_bytes == 10 * HOST_CHUNK_BYTES and a.mapped_bytes == 0 and a.used_bytes == 0
    a.empty(1000, torch.uint8)
    assert a.used_bytes == 1000 and a.mapped_bytes == HOST_CHUNK_BYTES
    a.empty(HOST_CHUNK_BYTES, torch.uint8, align=512)
    assert a.used_bytes == round_up(1000, 512) + HOST_CHUNK_BYTES
    assert a.mapped_bytes == round_up(a.used_bytes, HOST_CHUNK_BYTES)
    assert a.used_bytes == carved_bytes([1000, HOST_CHUNK_BYTES], 512)
    assert [n for n, _, _ in a.allocations] == ["", ""]
    assert a.stats()["allocations"] == 2


def test_growth_keeps_earlier_addresses_and_contents():
    a = HostArena(64 * HOST_CHUNK_BYTES)
    first = a.empty(100, torch.int64)
    first.copy_(torch.arange(100) * 7 + 3)
    ptr = first.data_ptr()
    for _ in range(20):
        a.empty(HOST_CHUNK_BYTES // 2, torch.int32)
    assert first.data_ptr() == ptr
    assert torch.equal(first, torch.arange(100) * 7 + 3)


def test_reservation_is_rounded_to_whole_chunks():
    assert HostArena(1).reserved_bytes == HOST_CHUNK_BYTES
    assert HostArena(HOST_CHUNK_BYTES + 1).reserved_bytes == 2 * HOST_CHUNK_BYTES


def test_exhaustion_raises_and_changes_nothing():
    a = HostArena(2 * HOST_CHUNK_BYTES)
    a.empty(HOST_CHUNK_BYTES, torch.uint8)
    before = a.stats()
    with pytest.raises(ArenaExhaustedError, match=r"needs \d+ bytes, reservation holds 8192"):
        a.empty(HOST_CHUNK_BYTES + 1, torch.uint8, name="big")
    assert a.stats() == before
    assert isinstance(ArenaExhaustedError("x"), MemoryError)  # callers may catch MemoryError
    a.empty(HOST_CHUNK_BYTES, torch.uint8)  # what does fit still fits exactly
    assert a.free_bytes == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"shape": (-1, 2), "dtype": torch.float32}, "shape must hold integers >= 0"),
    ({"shape": (2.5,), "dtype": torch.float32}, "shape must hold integers >= 0"),
    ({"shape": "abc", "dtype": torch.float32}, "shape must hold integers >= 0"),
    ({"shape": object(), "dtype": torch.float32}, "shape must be an int or a sequence"),
    ({"shape": (2,), "dtype": "float32"}, "dtype must be a torch.dtype, got 'float32'"),
    ({"shape": (2,), "dtype": torch.float32, "align": 48}, r"align must be a power of two >= the element size \(4\), got 48"),
    ({"shape": (2,), "dtype": torch.float64, "align": 4}, r"align must be a power of two >= the element size \(8\), got 4"),
    ({"shape": (2,), "dtype": torch.float32, "align": 0}, "align must be a power of two"),
])
def test_bad_carves_raise_value_error(kwargs, match):
    a = HostArena(1 << 16)
    with pytest.raises(ValueError, match=match):
        a.empty(**kwargs)
    assert a.used_bytes == 0 and a.allocations == []


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1"])
def test_bad_reservation_raises(bad):
    with pytest.raises(ValueError, match="reserve_bytes must be a positive integer"):
        HostArena(bad)


def test_closed_arena_refuses_and_close_is_idempotent():
    a = HostArena(1 << 16)
    t = a.zeros(16, torch.float32)
    a.close()
    a.close()
    assert a.closed and a.mapped_bytes == 0
    with pytest.raises(ArenaClosedError, match="HostArena is closed"):
        a.empty(1, torch.uint8)
    assert float(t.sum()) == 0.0  # host views stay readable until the last one goes


def test_context_manager_closes():
    with HostArena(1 << 16) as a:
        a.empty(8, torch.uint8)
    assert a.closed


def test_zeros_and_make_arena():
    a = make_arena("cpu", 1 << 16)
    assert isinstance(a, HostArena)
    a.empty(64, torch.float32).fill_(3.0)  # dirty memory
    z = a.zeros((4, 4), torch.bfloat16)
    assert z.dtype == torch.bfloat16 and bool((z == 0).all())
    with pytest.raises(ValueError, match="device must be 'cpu' or a CUDA device, got meta"):
        make_arena("meta", 1 << 16)


def test_release_to_forgets_later_carves():
    a = HostArena(64 * HOST_CHUNK_BYTES)
    keep = a.empty(100, torch.int64, name="keep")
    keep.copy_(torch.arange(100))
    m = a.mark()
    a.empty(5 * HOST_CHUNK_BYTES, torch.uint8, name="a")
    a.empty(7, torch.float32, name="b")
    a.release_to(m)
    assert a.used_bytes == m and [n for n, _, _ in a.allocations] == ["keep"]
    assert a.mapped_bytes == round_up(m, HOST_CHUNK_BYTES)
    again = a.empty(5, torch.float32)
    assert again.data_ptr() - keep.data_ptr() == round_up(800, DEFAULT_ALIGN)
    assert torch.equal(keep, torch.arange(100))
    with pytest.raises(ValueError, match="mark must be in"):
        a.release_to(a.used_bytes + 1)
