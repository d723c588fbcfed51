"""CausalKVCache on a CUDA device: the same contract as on CPU, device-resident commit."""
from __future__ import annotations

import pytest
import torch

from cache_harness import check_block, run_rollout, stamp
from framekv.engine import CausalKVCache
from framekv.specs import Geometry as G

pytestmark = pytest.mark.gpu


def _cache(g, tpp, *, layers=2, heads=2, dim=16, dtype=torch.bfloat16, pool_tokens=None):
    return CausalKVCache(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype,
                         tokens_per_page=tpp, device="cuda",
                         pool_tokens=pool_tokens or CausalKVCache.pool_tokens_for(g, tpp))


def _free() -> int:
    """Free device bytes, after earlier tests' garbage (arenas unmapped when collected)
    is gone: a collection during the measured rollout would read as a change."""
    import gc

    from framekv.ops import driver

    gc.collect()
    torch.cuda.synchronize()
    return driver.mem_get_info(torch.cuda.current_device())[0]


@pytest.mark.parametrize("g,tpp", [
    (G(6, 9, 6, (3, 6)), 4),
    (G(13, 3, 8, (2, 4, 8)), 4),
    (G(5, 37, 12, (3, 12)), 8),
    (G(40, 11, 7, (7,)), 16),
    (G(3, 50, 16, (1, 16)), 1),
    (G(100, 300, 64, (16, 64)), 128),
])
def test_device_rollout_rows_resolve_to_exact_visible_sets(g, tpp):
    cache = _cache(g, tpp)
    cache.open(g)
    run_rollout(cache, g, commits=80, seed=tpp + g.pin_tokens)
    cache.shutdown()


def test_ten_thousand_commits_constant_memory():
    g, tpp = G(13, 37, 12, (3, 12)), 8
    cache = _cache(g, tpp)
    cache.open(g)
    history: dict[int, int] = {}
    run_rollout(cache, g, commits=50, seed=5, history=history)  # kernels compiled, bound
    free0, mapped0, torch0 = _free(), cache.pool_bytes, torch.cuda.memory_allocated()
    final = run_rollout(cache, g, commits=10_000, seed=6, check_every=97, steps_per_chunk=1,
                        history=history)
    assert final > 10_000
    free1 = _free()
    assert (free1, cache.pool_bytes) == (free0, mapped0), (
        f"device memory changed: free {free0} -> {free1}, pool {mapped0} -> {cache.pool_bytes}")
    assert torch.cuda.memory_allocated() <= torch0 + (1 << 20)
    cache.shutdown()


def test_pool_bytes_for_equals_driver_allocation():
    g, tpp = G(512, 37824, 1576, (394, 1576)), 32
    kw = dict(num_layers=4, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, tokens_per_page=tpp)
    warm = _cache(G(1, 1, 1, (1,)), 1)      # one-time driver and kernel-module costs first
    warm.open(G(1, 1, 1, (1,)))              # (an open's uploads and page zeroing included)
    warm.shutdown()
    free0 = _free()
    cache = CausalKVCache(**kw, pool_tokens=CausalKVCache.pool_tokens_for(g, tpp), device="cuda")
    cache.open(g)
    used = free0 - _free()
    want = CausalKVCache.pool_bytes_for(g, **kw)
    print(f"pool_bytes_for {want}, driver measured {used}, cache.pool_bytes {cache.pool_bytes}")
    assert used == want == cache.pool_bytes
    cache.shutdown()
    assert _free() == free0, "shutdown must return every byte"


def _chunk_writes(cache, g, step, b=None):
    C, b = cache.committed_tokens, b or max(g.causal_block_sizes)
    pos = torch.arange(C, C + g.max_staged_tokens)
    for layer in range(cache.num_layers):
        cache.write_staged(layer, stamp(layer, 0, pos, step, cache.num_kv_heads, cache.head_dim,
                                        cache.dtype, "cuda"),
                           stamp(layer, 1, pos, step, cache.num_kv_heads, cache.head_dim,
                                 cache.dtype, "cuda"), b)


def _state_equal(a, b):
    sa, sb = a._open.seqs[0], b._open.seqs[0]
    assert all(torch.equal(sa.flat[k], sb.flat[k]) for k in sa.flat), "layout tensors differ"
    assert torch.equal(a._pool, b._pool), "pools differ"


def test_commit_captured_once_replays_for_200_chunks():
    g, tpp = G(13, 29, 12, (3, 12)), 4
    eager, graphed = _cache(g, tpp), _cache(g, tpp)
    for c in (eager, graphed):
        c.open(g)
        for step in range(3):  # warm-up: compile and bind every kernel outside capture
            _chunk_writes(c, g, step)
            c.commit(g.max_staged_tokens)
    n = g.max_staged_tokens
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        graphed.commit_device(n)  # captured, not run: the mirror stays put
    for step in range(3, 203):
        _chunk_writes(eager, g, step)
        _chunk_writes(graphed, g, step)
        eager.commit(n)
        graphed.commit_host(n)
        graph.replay()
        torch.cuda.synchronize()
        _state_equal(eager, graphed)
        assert eager.committed_tokens == graphed.committed_tokens
        assert int(graphed._open.seqs[0].counters[0]) == graphed.committed_tokens
    C = graphed.committed_tokens
    _chunk_writes(graphed, g, 500, b=3)
    for j in range(g.max_staged_tokens // 3):
        check_block(graphed, g, 1, 3, j, C, 500)


def test_reopen_other_geometry_and_back_keeps_addresses():
    g1, g2, tpp = G(6, 9, 6, (3, 6)), G(64, 40, 32, (8, 32)), 8
    need = max(CausalKVCache.pool_tokens_for(g, tpp) for g in (g1, g2))
    cache = _cache(g1, tpp, pool_tokens=need)
    cache.open(g1)
    ptrs = {k: t.data_ptr() for k, t in cache._open.seqs[0].flat.items()}
    run_rollout(cache, g1, commits=30, seed=1)
    cache.close()
    cache.open(g2)
    run_rollout(cache, g2, commits=30, seed=2)
    cache.close()
    cache.open(g1)
    assert {k: t.data_ptr() for k, t in cache._open.seqs[0].flat.items()} == ptrs
    assert cache.committed_tokens == 0 and int(cache._open.seqs[0].counters[0]) == 0
    run_rollout(cache, g1, commits=30, seed=3)
    cache.shutdown()


def test_edits_on_device_take_effect_next_forward():
    g, tpp = G(6, 9, 6, (3, 6)), 4
    cache = _cache(g, tpp)
    cache.open(g)
    for step in range(4):
        _chunk_writes(cache, g, step)
        cache.commit(6)
    C = cache.committed_tokens
    for x in (4, 15, 23):
        p = torch.tensor([x])
        cache.write_range(0, x, stamp(0, 0, p, 77, 2, 16, torch.bfloat16, "cuda"),
                          stamp(0, 1, p, 77, 2, 16, torch.bfloat16, "cuda"))
    _chunk_writes(cache, g, 9)
    from cache_harness import decode, row_keys
    d = decode(row_keys(cache, 0, 6, 0)[0])
    for x in (4, 15, 23):
        assert d["step"][d["pos"] == x].tolist() == [77]
    assert C == cache.committed_tokens
