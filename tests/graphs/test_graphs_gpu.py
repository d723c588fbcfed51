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


def test_graphs_share_one_pool():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    cache = GraphCache(DEV)
    for i in range(6):
        x = {"x": torch.randn(256, 1024, device=DEV)}  # 1 MiB
        cache.capture(GraphKey.build(owner=i, program="heavy", inputs=x), _scratch_heavy, x)
    pooled = cache.stats().reserved_bytes
    print(f"\nsix graphs of 16 MiB temporaries each: shared pool {pooled / 2**20:.1f} MiB")
    # Six pools of their own would hold at least one graph's temporaries (16 MiB) each.
    assert pooled < 6 * (16 << 20)


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


def test_capture_failure_leaves_no_entry_and_torch_usable():
    cache = GraphCache(DEV)
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
    print("\nhost cost per replay of a one-kernel graph, 1000 replays:")
    for name, us in costs.items():
        print(f"  {name:40s} {us:7.2f} us")
    # The cache's bookkeeping must stay small next to the launch itself.
    assert costs["cache.replay(key)"] < costs["CUDAGraph.replay"] + 10


def test_a_graph_drawing_random_numbers_draws_fresh_ones_at_every_replay():
    cache = GraphCache(DEV)
    x = {"x": torch.zeros(4096, device=DEV)}
    key = GraphKey.build(owner=1, program="noise", inputs=x)
    cache.capture(key, lambda x: x + torch.rand(4096, device=DEV), x)
    outs = [cache.replay(key).clone() for _ in range(6)]
    for a, b in zip(outs, outs[1:]):
        assert not torch.equal(a, b)  # torch's prologue advances the generator each replay
    assert all(0 <= o.min() and o.max() < 1 for o in outs)


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
    from framekv.graphs.capture import instantiate, new_graph
    from framekv.graphs.inspect import graph_info

    buf = torch.zeros(4096, dtype=torch.uint8, device=DEV)
    want = buf.clone()
    _memsets(want)  # eager
    torch.cuda.synchronize()
    expect = want.clone()
    expect[want == 0] = 0x11
    cache = GraphCache(DEV)
    key = GraphKey.build(owner=1, program="memsets", inputs={})
    entry = cache.capture(key, lambda: _memsets(buf), {})
    # The same work kept as captured, through the helpers the cache uses.
    kept = new_graph()
    with torch.cuda.graph(kept):
        _memsets(buf)
    assert instantiate(kept, rewrite=False, device_index=torch.cuda.current_device()) == 0
    for label, graph, replay in (("rewritten", entry.graph, lambda: cache.replay(key)),
                                 ("as captured", kept, kept.replay)):
        buf.fill_(0x11)  # dirty every byte, the untouched ones included
        replay()
        torch.cuda.synchronize()
        assert torch.equal(buf, expect), label
        info = graph_info(graph)
        print(f"\n{label}: {info}")
        assert info.types == ({"kernel": 3} if label == "rewritten" else {"memset": 3})
        assert info.straight_line
    assert entry.memsets_replaced == 3


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
