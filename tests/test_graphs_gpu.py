"""framekv.graphs on a CUDA device: capture, replay, the shared pool, failures, host cost."""
from __future__ import annotations

import statistics
import time

import pytest
import torch

from framekv.graphs import (GraphCache, GraphCaptureError, GraphKey, check_replay, chunk_key,
                            format_report)
from framekv.specs import Geometry
from test_graphs import check_chunk_rollout

pytestmark = pytest.mark.gpu

DEV = "cuda"


def recurrent_state():
    gen = torch.Generator(device=DEV).manual_seed(1)
    return {"h": torch.zeros(64, 256, device=DEV),
            "w": torch.randn(256, 256, device=DEV, generator=gen) / 16}


def recurrent_step(state, x, scale):
    h = torch.tanh(state["h"] @ state["w"] + x * scale)
    state["h"].copy_(h)  # in place: the graph holds this address
    return {"h": h * 2, "norm": h.norm(dim=1)}


def test_replay_equals_eager_bit_for_bit_over_100_steps():
    gen = torch.Generator(device=DEV).manual_seed(0)
    steps = [{"x": torch.randn(64, 256, device=DEV, generator=gen),
              "scale": torch.rand(1, device=DEV, generator=gen)} for _ in range(100)]
    assert check_replay(recurrent_state, recurrent_step, steps, device=DEV) is None


def test_run_captures_once_then_replays_with_changing_inputs():
    cache, state, calls = GraphCache(DEV), recurrent_state(), []
    eager = recurrent_state()

    def fn(x, scale):
        calls.append(1)
        return recurrent_step(state, x, scale)

    x0 = {"x": torch.zeros(64, 256, device=DEV), "scale": torch.zeros(1, device=DEV)}
    key = GraphKey.build(owner=1, program="recurrent", inputs=x0)
    cache.capture(key, fn, x0)  # warm-up on zeros from h = 0 leaves h = 0
    state["h"].zero_()
    for i in range(20):
        inp = {"x": torch.full((64, 256), i / 20, device=DEV), "scale": torch.ones(1, device=DEV)}
        out = cache.run(key, fn, inp)
        want = recurrent_step(eager, **inp)
        assert torch.equal(out["h"], want["h"]) and torch.equal(out["norm"], want["norm"])
    assert len(calls) == 3  # two warm-up calls and the capture; replays run no Python
    s = cache.stats()
    assert (s.graphs, s.captures, s.hits, s.eager) == (1, 1, 20, False)
    assert s.reserved_bytes > 0 and s.capture_seconds > 0


def _scratch_heavy(x):
    """Several MiB of temporaries freed inside the call, a small output."""
    a = x.repeat(8, 1) * 2       # 8 MiB
    b = torch.sin(a) + a         # 8 MiB
    c = b.view(8, -1).sum(0)     # back to x's size
    return c.view_as(x) + 1


def _capture_six(shared: bool) -> tuple[int, int]:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    cache = GraphCache(DEV, shared_pool=shared)
    for i in range(6):
        x = {"x": torch.randn(256, 1024, device=DEV)}  # 1 MiB
        cache.capture(GraphKey.build(owner=i, program="heavy", inputs=x), _scratch_heavy, x)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # drop what warm-up cached outside the pools
    total = torch.cuda.memory_reserved() - before
    pooled = cache.stats().reserved_bytes
    del cache
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return total, pooled


def test_shared_pool_uses_less_memory_than_separate_pools():
    separate_total, separate_pooled = _capture_six(shared=False)
    shared_total, shared_pooled = _capture_six(shared=True)
    print(f"\nsix graphs: shared pool {shared_pooled / 2**20:.1f} MiB "
          f"(process delta {shared_total / 2**20:.1f}), separate pools "
          f"{separate_pooled / 2**20:.1f} MiB (process delta {separate_total / 2**20:.1f})")
    assert shared_pooled < separate_pooled
    assert shared_total < separate_total
    # Each separate pool holds at least one graph's temporaries (16 MiB).
    assert separate_pooled >= 6 * (16 << 20)


def test_debug_mode_catches_a_swapped_buffer_and_a_layout_mismatch():
    cache = GraphCache(DEV, debug=True)
    x = {"x": torch.ones(16, 32, device=DEV)}
    key = GraphKey.build(owner=1, program="double", inputs=x)
    out = cache.run(key, lambda x: x * 2, x)
    assert torch.equal(out, torch.full((16, 32), 2.0, device=DEV))
    with pytest.raises(ValueError, match="input 'x' has layout"):
        cache.replay(key, {"x": torch.ones(32, 16, device=DEV).t()})
    cache.get_static_inputs(key)["x"].set_(torch.zeros(16, 32, device=DEV))
    with pytest.raises(RuntimeError, match="input 'x' of double moved from"):
        cache.replay(key)


@pytest.mark.parametrize("shared", [True, False])
def test_capture_failure_leaves_no_entry_and_torch_usable(shared):
    cache = GraphCache(DEV, shared_pool=shared)
    x = {"x": torch.ones(8, device=DEV)}
    key = GraphKey.build(owner=1, program="sync", inputs=x)
    earlier = GraphKey.build(owner=2, program="earlier", inputs=x)
    cache.run(earlier, lambda x: x + 1, x)

    def host_sync(x):
        return x * float(x.sum().item())  # a device-to-host copy: illegal while capturing

    with pytest.raises(GraphCaptureError, match="capture of sync"):
        cache.run(key, host_sync, x)
    assert key not in cache and cache.stats().capture_failures == 1
    assert not torch.cuda.is_current_stream_capturing()
    y = torch.arange(4.0, device=DEV) + 1  # torch still works
    torch.cuda.synchronize()
    assert y.tolist() == [1.0, 2.0, 3.0, 4.0]
    out = cache.run(key, lambda x: x * 3, x)  # the same key captures fine afterwards
    assert torch.equal(out, torch.full((8,), 3.0, device=DEV))
    out = cache.replay(earlier, {"x": torch.full((8,), 5.0, device=DEV)})
    assert torch.equal(out, torch.full((8,), 6.0, device=DEV))  # earlier graphs unharmed


def test_whole_chunks_over_a_real_cache_replay_bit_for_bit():
    found, (eager, graphed, _) = check_chunk_rollout(DEV, torch.bfloat16, chunks=9)
    assert found is None, str(found)
    assert eager.cache.committed_tokens == graphed.cache.committed_tokens == 9 * 8
    assert torch.equal(eager.cache.k_pool, graphed.cache.k_pool)
    assert torch.equal(eager.cache.v_pool, graphed.cache.v_pool)


def test_warmup_report_on_gpu():
    g = Geometry(6, 12, 8, (4, 8))
    cache = GraphCache(DEV)

    def builder(geometry, tokens, block_size):
        x = {"x": torch.randn(tokens, 1 << 16, device=DEV)}
        return chunk_key(1, geometry, tokens, denoise_steps=1, denoise_block=block_size,
                         inputs=x), _scratch_heavy, x, None

    report = cache.warmup([(g, 8, 4), (g, 8, 8), (g, 4, 4)], builder, progress=False)
    print("\n" + format_report(report))
    assert report.captured == 3 and report.reserved_bytes > 0
    assert all(r.capture_seconds > 0 for r in report.records)


def _per_call_us(fn, n=1000, repeats=5) -> float:
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - start) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def test_replay_host_cost():
    cache = GraphCache(DEV)
    x = {"x": torch.ones(1024, device=DEV)}
    key = GraphKey.build(owner=1, program="tiny", inputs=x)
    handle = cache.capture(key, lambda x: x + 1, x)
    fresh = torch.ones(1024, device=DEV)
    costs = {
        "CUDAGraph.replay": _per_call_us(handle.graph.replay),
        "handle.replay()": _per_call_us(handle.replay),
        "cache.replay(key)": _per_call_us(lambda: cache.replay(key)),
        "cache.replay(key, inputs) (one copy)":
            _per_call_us(lambda: cache.replay(key, {"x": fresh})),
    }
    debug = GraphCache(DEV, debug=True)
    debug.capture(key, lambda x: x + 1, x)
    costs["debug cache.replay(key, inputs)"] = _per_call_us(lambda: debug.replay(key, {"x": fresh}))
    direct = GraphCache(DEV, direct_launch=True)
    direct.capture(key, lambda x: x + 1, x)
    costs["direct_launch cache.replay(key)"] = _per_call_us(lambda: direct.replay(key))
    assert direct.get(key).direct_launch
    print("\nhost cost per replay of a one-kernel graph, 1000 replays:")
    for name, us in costs.items():
        print(f"  {name:40s} {us:7.2f} us")
    # The cache's bookkeeping must stay small next to the launch itself.
    assert costs["cache.replay(key)"] < costs["CUDAGraph.replay"] + 10
    assert costs["direct_launch cache.replay(key)"] < costs["CUDAGraph.replay"] + 10


# ---------------------------------------------------------------------------- direct launch
def test_default_replays_go_through_torch_and_the_warm_up_tells_random_graphs():
    cache = GraphCache(DEV)
    x = {"x": torch.zeros(4096, device=DEV)}
    key = GraphKey.build(owner=1, program="noise", inputs=x)
    entry = cache.capture(key, lambda x: x + torch.rand(4096, device=DEV), x)
    assert entry.draws_random is True  # its warm-up calls moved the generator
    with pytest.raises(ValueError, match="draws random numbers.*replay it instead"):
        cache.resident(key)
    outs = [cache.replay(key).clone() for _ in range(6)]
    assert entry.launcher is None and not entry.direct_launch
    for a, b in zip(outs, outs[1:]):
        assert not torch.equal(a, b)  # torch's prologue advances the generator each replay
    plain = GraphKey.build(owner=2, program="affine", inputs=x)
    handle = cache.capture(plain, lambda x: x * 3 + 1, x)
    for _ in range(4):
        cache.replay(plain)
    assert handle.launcher is None and not handle.direct_launch and handle.draws_random is False
    quiet = GraphKey.build(owner=3, program="affine", inputs=x)
    unknown = cache.capture(quiet, lambda x: x * 3 + 1, x, warmup=0)
    assert unknown.draws_random is None  # no eager call, nothing known


def test_graph_without_rng_switches_to_direct_launch_and_follows_the_current_stream():
    cache = GraphCache(DEV, direct_launch=True)
    x = {"x": torch.randn(1 << 20, device=DEV)}
    key = GraphKey.build(owner=1, program="affine", inputs=x)
    entry = cache.capture(key, lambda x: x * 3 + 1, x)
    assert not entry.direct_launch  # the probe switches at a replay
    assert entry.draws_random is False  # known from the warm-up calls
    offset = torch.cuda.default_generators[0].get_offset()
    cache.replay(key)
    cache.replay(key)
    assert entry.direct_launch and entry.draws_random is False
    assert torch.cuda.default_generators[0].get_offset() == offset
    side = torch.cuda.Stream()
    for i in range(5):
        fresh = torch.randn(1 << 20, device=DEV)
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream())
            # A launch on any other stream would run before the copy behind the sleep.
            torch.cuda._sleep(2_000_000)
            entry.static_inputs["x"].copy_(fresh)
            out = cache.replay(key).clone()
        torch.cuda.current_stream().wait_stream(side)
        assert torch.equal(out, fresh * 3 + 1), f"replay {i}"


def test_graph_drawing_random_numbers_keeps_torch_replay_and_fresh_numbers():
    cache = GraphCache(DEV, direct_launch=True)
    x = {"x": torch.zeros(4096, device=DEV)}
    key = GraphKey.build(owner=1, program="noise", inputs=x)
    entry = cache.capture(key, lambda x: x + torch.rand(4096, device=DEV), x)
    assert entry.draws_random is True
    outs = [cache.replay(key).clone() for _ in range(6)]
    assert not entry.direct_launch and entry.draws_random is True
    with pytest.raises(ValueError, match="draws random numbers.*replay it instead"):
        cache.resident(key)
    for a, b in zip(outs, outs[1:]):
        assert not torch.equal(a, b)  # each replay draws new numbers
    assert all(0 <= o.min() and o.max() < 1 for o in outs)


def test_a_direct_launch_entry_runs_resident_and_launches_directly_again_after():
    cache = GraphCache(DEV, direct_launch=True)
    x = {"x": torch.zeros(256, device=DEV)}
    key = GraphKey.build(owner=1, program="count", inputs=x)
    entry = cache.capture(key, lambda x: x.add_(1), x)
    cache.replay(key)
    direct = entry.launcher
    assert entry.direct_launch and direct is not None
    before = entry.static_inputs["x"].clone()
    torch.cuda.synchronize()
    r = cache.resident(key, idle_timeout_s=5.0)
    with pytest.raises(RuntimeError, match="runs resident"):
        cache.replay(key)
    r.submit()
    r.wait(timeout_s=10)
    r.close()
    assert entry.launcher is direct
    cache.replay(key)
    torch.cuda.synchronize()
    assert torch.equal(entry.static_inputs["x"], before + 2)  # one resident run, one replay


# ---------------------------------------------------------------------------- memset rewrite
def _memsets(buf: torch.Tensor) -> None:
    """Three driver memsets on torch's stream: bytes, a pitched 2-D of uint16, uint32s."""
    from cuda.bindings import driver as dr

    stream = dr.CUstream(init_value=torch.cuda.current_stream().cuda_stream)
    base = buf.data_ptr()
    assert int(dr.cuMemsetD8Async(base, 0x5A, 1000, stream)[0]) == 0
    # 7 rows of 24 uint16 (48 bytes), 64 bytes apart, from byte 1024
    assert int(dr.cuMemsetD2D16Async(base + 1024, 64, 0xBEEF, 24, 7, stream)[0]) == 0
    assert int(dr.cuMemsetD32Async(base + 2048, 0x01020304, 300, stream)[0]) == 0


def test_memset_nodes_become_kernel_nodes_writing_the_same_bytes():
    from framekv.graphs.inspect import graph_info

    buf = torch.zeros(4096, dtype=torch.uint8, device=DEV)
    want = buf.clone()
    _memsets(want)  # eager
    torch.cuda.synchronize()
    for kernel_only in (True, False):
        cache = GraphCache(DEV, kernel_only=kernel_only)
        key = GraphKey.build(owner=1, program="memsets", inputs={})
        entry = cache.capture(key, lambda: _memsets(buf), {})
        buf.fill_(0x11)  # dirty every byte, the untouched ones included
        expect = want.clone()
        expect[want == 0] = 0x11
        cache.replay(key)
        torch.cuda.synchronize()
        assert torch.equal(buf, expect), f"kernel_only={kernel_only}"
        info = graph_info(entry.graph)
        print(f"\nkernel_only={kernel_only}: {info}")
        if kernel_only:
            assert entry.memsets_replaced == 3 and info.types == {"kernel": 3}
        else:
            assert entry.memsets_replaced == 0 and info.types == {"memset": 3}
        assert info.straight_line


def test_cudnn_forward_graph_is_kernel_only_and_replays_like_eager():
    from framekv.engine import CachedAttention, CausalKVCache
    from framekv.graphs.inspect import graph_info

    g = Geometry(64, 1536, 256, (64, 256))
    cache = CausalKVCache(num_layers=1, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16,
                          tokens_per_page=32, device=DEV,
                          pool_tokens=CausalKVCache.pool_tokens_for(g, 32))
    cache.open(g)
    mod = CachedAttention(8, 2, 128, backend="cudnn", layer_idx=0)
    qkv = {"qkv": torch.randn(1, 256, 12, 128, device=DEV, dtype=torch.bfloat16)}
    graphs = GraphCache(DEV)
    key = GraphKey.build(owner=1, geometry=g, tokens=256, block_sizes=(256,), program="fwd",
                         inputs=qkv)
    fwd = lambda qkv: mod(qkv, kv_cache=cache, seq_len=256, causal_block_size=256)  # noqa: E731
    entry = graphs.capture(key, fwd, qkv, after_replay=lambda: cache.note_staged(256))
    info = graph_info(entry.graph)
    print(f"\ncuDNN forward graph: {info}, {entry.memsets_replaced} memsets replaced")
    assert "memset" not in info.types and info.straight_line
    for i in range(6):
        x = {"qkv": torch.randn(1, 256, 12, 128, device=DEV, dtype=torch.bfloat16)}
        got = graphs.replay(key, x).clone()
        want = fwd(x["qkv"])
        assert torch.equal(got, want), f"step {i}"
        cache.commit(256)
    cache.shutdown()
