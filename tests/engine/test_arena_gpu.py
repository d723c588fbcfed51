"""Device arenas on a real GPU: fixed addresses, aliasing views, driver-measured memory."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

MiB = 1 << 20


@pytest.fixture
def dev():
    from framekv.ops import driver

    torch.cuda.init()
    d = torch.device("cuda", torch.cuda.current_device())
    driver.make_current(d.index)
    torch.cuda.synchronize()
    return d


def _free(dev) -> int:
    from framekv.ops import driver

    torch.cuda.synchronize(dev)
    return driver.mem_get_info(dev.index)[0]


def test_growth_keeps_every_earlier_address(dev):
    from framekv.engine.arena import DeviceArena

    with DeviceArena(256 * MiB, device=dev) as a:
        kept = []
        for i in range(40):  # 40 x 1.5 MiB: many chunk growths
            t = a.empty((3 * MiB // 4,), torch.bfloat16, name=f"t{i}")
            t.copy_(torch.randn(t.shape, device=dev).to(torch.bfloat16))
            kept.append((t, t.data_ptr(), t.clone()))
        assert a.mapped_bytes >= 60 * MiB and a.mapped_bytes % a.chunk_bytes == 0
        for t, ptr, ref in kept:
            assert t.data_ptr() == ptr
            assert torch.equal(t, ref)
        assert kept[0][1] == a.base_ptr


def test_torch_and_numba_views_alias_the_same_bytes(dev):
    from numba import cuda

    from framekv.engine.arena import DeviceArena, numba_view

    @cuda.jit
    def add_index(x):
        i = cuda.grid(1)
        if i < x.size:
            x[i] += i

    with DeviceArena(16 * MiB, device=dev) as a:
        t = a.empty(1000, torch.int32)
        t.copy_(torch.randint(-1000, 1000, (1000,), device=dev, dtype=torch.int32))
        expect = t.clone() + torch.arange(1000, device=dev, dtype=torch.int32)
        nv = numba_view(t)
        assert nv.device_ctypes_pointer.value == t.data_ptr()
        stream = cuda.external_stream(torch.cuda.current_stream().cuda_stream)
        add_index[4, 256, stream](nv)
        torch.cuda.synchronize()
        assert torch.equal(t, expect)
        b = a.empty((64, 8), torch.bfloat16)
        b.copy_(torch.randn(64, 8, device=dev).to(torch.bfloat16))
        bv = numba_view(b)  # bf16 travels as int16 words: same bytes
        assert bv.device_ctypes_pointer.value == b.data_ptr() and bv.shape == (64, 8)
        assert torch.equal(torch.as_tensor(bv, device=dev).view(torch.bfloat16), b)


def test_mapped_bytes_match_driver_free_memory(dev):
    from framekv.engine.arena import DeviceArena

    DeviceArena(2 * MiB, device=dev).close()  # first use pays any one-time driver cost
    free0 = _free(dev)
    a = DeviceArena(1024 * MiB, device=dev)
    assert _free(dev) == free0, "reserving address space must not take memory"
    a.empty(37 * MiB + 5, torch.uint8)
    a.empty((1000, 1000), torch.float32)  # 4 MB more, crosses chunks
    assert a.mapped_bytes == 42 * MiB  # 37 MiB + 256 B aligned + 4e6 B, in 2 MiB chunks
    free1 = _free(dev)
    print(f"free before {free0}, after {free1}, driver delta {free0 - free1}, mapped {a.mapped_bytes}")
    assert free0 - free1 == a.mapped_bytes
    a.close()
    assert _free(dev) == free0, "close must return every byte"
    assert a.mapped_bytes == 0


def test_exhaustion_and_closed_on_device(dev):
    from framekv.engine.arena import ArenaClosedError, ArenaExhaustedError, DeviceArena

    free0 = _free(dev)
    a = DeviceArena(4 * MiB, device=dev)
    a.empty(3 * MiB, torch.uint8)
    with pytest.raises(ArenaExhaustedError):
        a.empty(2 * MiB, torch.uint8)
    assert a.mapped_bytes == 4 * MiB
    assert free0 - _free(dev) == 4 * MiB
    a.close()
    with pytest.raises(ArenaClosedError):
        a.empty(1, torch.uint8)
    assert _free(dev) == free0


def test_graph_captured_over_arena_tensors_replays_after_growth(dev):
    from framekv.engine.arena import DeviceArena

    with DeviceArena(512 * MiB, device=dev) as a:
        x = a.empty((1024, 128), torch.float32)
        y = a.empty((1024, 128), torch.float32)
        x.copy_(torch.randn_like(x))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y.copy_(x * 2 + 1)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y.copy_(x * 2 + 1)
        for _ in range(10):  # grow the arena well past the captured tensors
            a.empty(16 * MiB, torch.uint8)
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, x * 2 + 1)


def test_release_to_returns_chunks_to_the_driver(dev):
    from framekv.engine.arena import DeviceArena

    with DeviceArena(256 * MiB, device=dev) as a:
        keep = a.empty(3 * MiB, torch.uint8)
        keep.fill_(7)
        free0 = _free(dev)
        m = a.mark()
        a.empty(20 * MiB, torch.uint8)
        a.empty(9 * MiB, torch.uint8)
        assert free0 - _free(dev) == a.mapped_bytes - 4 * MiB
        a.release_to(m)
        assert a.mapped_bytes == 4 * MiB and _free(dev) == free0
        assert bool((keep == 7).all())
        assert a.empty(MiB, torch.uint8).data_ptr() == a.base_ptr + 3 * MiB


def test_arena_collected_during_capture_is_closed_later(dev):
    import gc

    from framekv.engine import arena as arena_mod

    gc.collect()
    arena_mod.release_deferred()  # earlier tests' garbage must not blur the count
    doomed = arena_mod.DeviceArena(8 * MiB, device=dev)
    doomed.empty(3 * MiB, torch.uint8)  # maps 4 MiB (2 MiB chunks)
    x = torch.zeros(1024, device=dev)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        del doomed
        gc.collect()  # __del__ runs inside the capture: it must not unmap or synchronise
        x.add_(1)
    g.replay()
    torch.cuda.synchronize()
    assert float(x[0]) == 1.0
    assert arena_mod._DEFERRED, "the collected arena waits for a safe point"
    still_mapped = _free(dev)
    arena_mod.release_deferred()
    assert not arena_mod._DEFERRED
    assert _free(dev) - still_mapped == 4 * MiB  # its one chunk of 4 MiB comes back now
