"""CausalKVCache on CPU: exact V(j) through the real pool, lifecycle, edits, errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from cache_harness import check_block, row_keys, run_rollout, stamp
from framekv.engine import CausalKVCache
from framekv.engine.cache.plan import LayoutPlan
from framekv.specs import Geometry

G = Geometry

# (geometry, tokens_per_page): pins aligned / not / 0, windows 0, < page, unaligned,
# > max_staged, block sizes 1..M, pages of 1 to 128 tokens, pinning over several forwards.
GEOMETRIES = [
    (G(6, 9, 6, (3, 6)), 4),          # DESIGN.md's worked example
    (G(0, 0, 5, (1, 5)), 2),          # no pin, no window
    (G(13, 3, 8, (2, 4, 8)), 4),      # window smaller than a page
    (G(5, 37, 12, (3, 12)), 8),       # unaligned everything
    (G(40, 11, 7, (7,)), 16),         # the pin fills over several commits
    (G(3, 50, 16, (1, 16)), 1),       # one-token pages
    (G(100, 300, 64, (16, 64)), 128),  # pages larger than a forward
    (G(32, 64, 16, (4, 16)), 16),     # everything aligned
]


def make_cache(geometry, tpp, *, layers=2, heads=2, dim=8, dtype=torch.float32, extra=0):
    return CausalKVCache(num_layers=layers, num_kv_heads=heads, head_dim=dim, dtype=dtype,
                         tokens_per_page=tpp,
                         pool_tokens=CausalKVCache.pool_tokens_for(geometry, tpp) + extra,
                         device="cpu")


@pytest.mark.parametrize("geometry,tpp", GEOMETRIES)
def test_rollout_rows_resolve_to_exact_visible_sets(geometry, tpp):
    cache = make_cache(geometry, tpp, dtype=torch.bfloat16)
    cache.open(geometry)
    run_rollout(cache, geometry, commits=60, seed=tpp * 7 + geometry.pin_tokens)


@pytest.mark.parametrize("geometry,tpp", [GEOMETRIES[0], GEOMETRIES[3], GEOMETRIES[4]])
def test_long_rollout_500_commits(geometry, tpp):
    cache = make_cache(geometry, tpp)
    cache.open(geometry)
    before = (cache.pool_bytes, cache._arena.used_bytes)
    final = run_rollout(cache, geometry, commits=500, seed=11, check_every=5, steps_per_chunk=1)
    assert final > 20 * geometry.max_staged_tokens
    assert (cache.pool_bytes, cache._arena.used_bytes) == before, "memory grew during a rollout"


@pytest.mark.parametrize("seed", range(6))
def test_random_odd_geometries(seed):
    rng = np.random.default_rng(1000 + seed)
    tpp = int(2 ** rng.integers(0, 6))
    M = int(rng.integers(1, 20))
    sizes = tuple(sorted({int(rng.integers(1, M + 1)) for _ in range(2)} | {M}))
    g = G(int(rng.integers(0, 30)), int(rng.integers(0, 40)), M, sizes)
    cache = make_cache(g, tpp)
    cache.open(g)
    run_rollout(cache, g, commits=80, seed=seed)


def test_worked_example_rows():
    g, tpp = GEOMETRIES[0]
    cache = make_cache(g, tpp, dtype=torch.bfloat16)
    cache.open(g)
    H, D = 2, 8
    C = 0
    while C < 20:  # T = 6 with b = 3 or 6; reach C = 20 exactly with partial commits
        T = 6
        pos = torch.arange(C, C + T)
        for layer in range(2):
            cache.write_staged(layer, stamp(layer, 0, pos, 1, H, D, torch.bfloat16, "cpu"),
                               stamp(layer, 1, pos, 1, H, D, torch.bfloat16, "cpu"), 3)
        n = min(T, 20 - C)
        cache.commit(n)
        C += n
    pos = torch.arange(20, 26)
    for layer in range(2):
        cache.write_staged(layer, stamp(layer, 0, pos, 2, H, D, torch.bfloat16, "cpu"),
                           stamp(layer, 1, pos, 2, H, D, torch.bfloat16, "cpu"), 3)
    bt = cache.block_tensors(3)
    assert bt.seq_len_kv[:2].tolist() == [18, 18]
    assert bt.seq_len_q[:2].tolist() == [3, 3]
    for j in range(2):
        for layer in range(2):
            check_block(cache, g, layer, 3, j, 20, 2)
    # block 0 reads full logical pages p0 p3 p4 first, block 1 p0 p4 (12 and 8 keys).
    from cache_harness import decode
    k0, _ = row_keys(cache, 0, 3, 0)
    assert decode(k0)["pos"][:12].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19]
    assert decode(k0)["pos"][12:].tolist() == [4, 5, 11, 20, 21, 22]
    k1, _ = row_keys(cache, 0, 3, 1)
    assert decode(k1)["pos"].tolist() == [0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 14, 15, 20, 21, 22,
                                         23, 24, 25]


def _fill_and_commit(cache, g, n_chunks, step=1):
    H, D, dt = cache.num_kv_heads, cache.head_dim, cache.dtype
    b = max(g.causal_block_sizes)
    for _ in range(n_chunks):
        C = cache.committed_tokens
        pos = torch.arange(C, C + b)
        for layer in range(cache.num_layers):
            cache.write_staged(layer, stamp(layer, 0, pos, step, H, D, dt, cache.device),
                               stamp(layer, 1, pos, step, H, D, dt, cache.device), b)
        cache.commit(b)


def test_write_range_updates_private_copies_for_the_next_forward():
    g, tpp = G(6, 9, 6, (3, 6)), 4
    cache = make_cache(g, tpp)
    cache.open(g)
    _fill_and_commit(cache, g, 4)  # C = 24; window of block 0: [15, 24), fixed tail 4 5
    C = cache.committed_tokens
    edit = [4, 15, 16, 23]  # fixed tail, window start page, full page, last history
    for x in edit:
        for layer in range(2):
            p = torch.tensor([x])
            cache.write_range(layer, x, stamp(layer, 0, p, 77, 2, 8, torch.float32, "cpu"),
                              stamp(layer, 1, p, 77, 2, 8, torch.float32, "cpu"))
    pos = torch.arange(C, C + 6)
    for layer in range(2):  # next forward: its rows must see the edited values
        cache.write_staged(layer, stamp(layer, 0, pos, 5, 2, 8, torch.float32, "cpu"),
                           stamp(layer, 1, pos, 5, 2, 8, torch.float32, "cpu"), 3)
    from cache_harness import decode
    seen = set()
    for j in range(2):
        check_block(cache, g, 0, 3, j, C, 5)
        d = decode(row_keys(cache, 0, 3, j)[0])
        for p, st in zip(d["pos"].tolist(), d["step"].tolist()):
            if p in edit:
                assert st == 77, f"position {p} read stale in block {j}"
                seen.add(p)
    assert seen == set(edit)


def test_zero_values_zeroes_v_and_its_private_copies_not_k():
    g, tpp = G(6, 9, 6, (3, 6)), 4
    cache = make_cache(g, tpp)
    cache.open(g)
    _fill_and_commit(cache, g, 4)
    cache.zero_values(1, 4, 2)  # the fixed tail, read through private copies
    C = cache.committed_tokens
    pos = torch.arange(C, C + 6)
    cache.write_staged(1, stamp(1, 0, pos, 5, 2, 8, torch.float32, "cpu"),
                       stamp(1, 1, pos, 5, 2, 8, torch.float32, "cpu"), 6)
    k, v = row_keys(cache, 1, 6, 0)
    from cache_harness import decode
    kpos = decode(k)["pos"]
    zeroed = v[np.isin(kpos, [4, 5])]
    assert zeroed.shape[0] == 2 and bool((zeroed == 0).all())
    others = v[~np.isin(kpos, [4, 5])]
    assert bool((others[:, :, 7] == 1).all())
    assert bool((k[:, :, 7] == 1).all())  # K untouched


def test_lifecycle_close_reopen_and_other_geometry():
    g1, g2, tpp = G(6, 9, 6, (3, 6)), G(10, 4, 4, (2, 4)), 4
    need = max(CausalKVCache.pool_tokens_for(g1, tpp), CausalKVCache.pool_tokens_for(g2, tpp))
    cache = CausalKVCache(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                          tokens_per_page=tpp, pool_tokens=need, device="cpu")
    assert not cache.is_open and cache.geometry is None
    cache.open(g1)
    addrs = {b: cache.block_tensors(b).rows.data_ptr() for b in (3, 6)}
    run_rollout(cache, g1, commits=10, seed=1)
    cache.close()
    assert not cache.is_open
    cache.open(g2)
    assert cache.geometry == g2 and cache.committed_tokens == 0
    run_rollout(cache, g2, commits=10, seed=2)
    cache.close()
    used = cache._arena.used_bytes
    cache.open(g1)  # back: same tensors, a fresh rollout
    assert cache.committed_tokens == 0
    assert {b: cache.block_tensors(b).rows.data_ptr() for b in (3, 6)} == addrs
    assert cache._arena.used_bytes == used, "reopen must not carve again"
    run_rollout(cache, g1, commits=10, seed=3)
    cache.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        cache.open(g1)


def test_failed_open_leaves_nothing_open_or_allocated():
    g, tpp = G(6, 9, 6, (3, 6)), 4
    need = CausalKVCache.pool_tokens_for(g, tpp)
    cache = CausalKVCache(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                          tokens_per_page=tpp, pool_tokens=need - tpp, device="cpu")
    used = cache._arena.used_bytes
    with pytest.raises(ValueError, match=rf"needs {need} tokens .* the pool has {need - 4}"):
        cache.open(g)
    assert not cache.is_open and cache._arena.used_bytes == used
    with pytest.raises(ValueError, match="geometry must be a framekv.specs.Geometry"):
        cache.open((6, 9, 6, (3,)))
    ok = make_cache(g, tpp)
    ok.open(g)
    with pytest.raises(ValueError, match="already open"):
        ok.open(g)
    assert ok.geometry == g


def test_pool_sizing_is_static_and_exact():
    g, tpp = G(512, 37824, 1576, (394, 1576)), 32
    plan = LayoutPlan.for_geometry(g, tpp)
    assert CausalKVCache.pool_tokens_for(g, tpp) == plan.total_pages * tpp
    nbytes = CausalKVCache.pool_bytes_for(g, num_layers=36, num_kv_heads=8, head_dim=128,
                                          dtype=torch.bfloat16, tokens_per_page=tpp)
    pool = 36 * 2 * plan.total_pages * tpp * 8 * 128 * 2
    assert nbytes % (2 << 20) == 0 and pool <= nbytes < pool + (4 << 20)


def _open_cache():
    g, tpp = G(6, 9, 6, (3, 6)), 4
    cache = make_cache(g, tpp)
    cache.open(g)
    return cache


def _kv(T, H=2, D=8, dtype=torch.float32):
    return torch.randn(T, H, D, dtype=dtype), torch.randn(T, H, D, dtype=dtype)


@pytest.mark.parametrize("call,match", [
    (lambda c: c.write_staged(0, *_kv(4), 3), "multiple of causal_block_size=3"),
    (lambda c: c.write_staged(0, *_kv(9), 3), "at most max_staged_tokens=6"),
    (lambda c: c.write_staged(0, *_kv(2), 2), r"causal_block_size must be one of \(3, 6\)"),
    (lambda c: c.write_staged(2, *_kv(3), 3), r"layer must be an integer in \[0, 2\)"),
    (lambda c: c.write_staged(0, *_kv(3, dtype=torch.float64), 3), "k must have dtype torch.float32"),
    (lambda c: c.write_staged(0, *_kv(3, H=3), 3), r"k must have shape \[T >= 1, 2, 8\]"),
    (lambda c: c.write_staged(0, _kv(3)[0], _kv(6)[1], 3), "v must have shape|same shape"),
    (lambda c: c.write_staged(0, torch.randn(3, 2, 8, device="meta"), _kv(3)[1], 3), "k must be on cpu"),
    (lambda c: c.commit(1), r"n must be an integer in \[0, staged=0\]"),
    (lambda c: c.write_range(0, 50, *_kv(1)), "position 50 is not resident"),
    (lambda c: c.write_range(0, 4, *_kv(3)), "position 6 is not resident"),
    (lambda c: c.zero_values(0, 0, 0), "n must be a positive integer"),
    (lambda c: c.zero_values(0, 5, 2), "position 6 is not resident"),
])
def test_misuse_raises_clear_errors(call, match):
    cache = _open_cache()
    with pytest.raises(ValueError, match=match):
        call(cache)


def test_commit_more_than_staged_and_closed_use():
    cache = _open_cache()
    for layer in range(cache.num_layers):
        cache.write_staged(layer, *_kv(3), 3)
    with pytest.raises(ValueError, match=r"n must be an integer in \[0, staged=3\], got 4"):
        cache.commit(4)
    cache.commit(3)
    assert cache.committed_tokens == 3 and cache.staged_tokens == 0
    cache.close()
    with pytest.raises(ValueError, match="no geometry is open"):
        cache.write_staged(0, *_kv(3), 3)
    with pytest.raises(ValueError, match="no geometry is open"):
        cache.commit(0)


@pytest.mark.parametrize("kwargs,match", [
    ({"num_layers": 0}, "num_layers must be a positive integer"),
    ({"tokens_per_page": 48}, "tokens_per_page must be a power of two, got 48"),
    ({"dtype": torch.int8}, "dtype must be one of"),
    ({"pool_tokens": -1}, "pool_tokens must be a positive integer"),
])
def test_constructor_validation(kwargs, match):
    args = dict(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                tokens_per_page=4, pool_tokens=64, device="cpu")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        CausalKVCache(**args)
