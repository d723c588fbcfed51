"""GQA query packing in the cuDNN backend on an H200: exact key sets with packing on,
bf16 accuracy against the fp32 exact-window reference with and without split-KV, and
packed against unpacked outputs over the same cache. (Replay across 104 commits:
`test_split_kv_gpu.test_split_forwards_replay_bit_for_bit_across_104_commits`.)"""
from __future__ import annotations

import pytest
import torch

from attention_harness import make, onehot_visible_sets, rollout_vs_reference
from framekv.engine import CachedAttention
from framekv.engine.attention.cudnn import CudnnBackend
from framekv.specs import Geometry as G

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("g,tpp,sizes", [
    (G(5, 13, 6, (2, 3, 6)), 4, (6, 3, 2)),
    (G(3, 40, 12, (4, 12)), 32, (12, 4)),
])
def test_packed_onehot_visible_set_is_exact(g, tpp, sizes, split):
    """Query head k * g + r reads K/V head k and exactly V(j) (4 query / 2 K/V heads)."""
    M = g.max_staged_tokens
    onehot_visible_sets(g, tpp, block_sizes=sizes, commits=(128 - M) // M, H=4, Hkv=2,
                        dtype=BF16, device="cuda", backend=CudnnBackend(split=split, pack=True),
                        tol=2e-3)


@pytest.mark.parametrize("split", [1, 2, 5])
@pytest.mark.parametrize("g,tpp,chunk,frame", [
    (G(64, 1536, 256, (64, 256)), 32, 256, 64),
    (G(77, 1100, 192, (48, 192)), 16, 192, 48),   # nothing aligned
])
def test_packed_rollouts_match_exact_window_reference(g, tpp, chunk, frame, split):
    backend = CudnnBackend(split=split, pack=True)
    err = rollout_vs_reference(g, tpp, chunk=chunk, frame=frame, chunks=10, layers=2, H=8, Hkv=2,
                               D=128, dtype=BF16, device="cuda", backend=backend, seed=5,
                               packed=split == 2)
    print(f"packed S={split}: errors vs fp32 exact-window reference: {err}")
    assert all(p.packed for p in backend._plans.values())
    assert err["max_rel_error"] <= 8e-3, err


@pytest.mark.parametrize("b,split", [(1576, 5), (394, 5), (394, 1)])
def test_packed_equals_unpacked_within_bf16(b, split):
    """The seed geometry's heads (32 / 8 of 128) over a full window: one layer's output
    with packing on and off, over the same cache and queries."""
    g, tpp, T = G(394, 36 * 394, 1576, (394, 1576)), 32, 1576
    cache, _ = make(g, tpp, layers=1, H=32, Hkv=8, D=128, dtype=BF16, device="cuda",
                    backend="reference")
    gen = torch.Generator(device="cuda").manual_seed(b + split)
    while cache.committed_tokens < g.pin_tokens + g.window_tokens:
        kv = torch.randn(2, T, 8, 128, device="cuda", generator=gen).to(BF16)
        cache.write_staged(0, kv[0], kv[1], T)
        cache.commit(T)
    qkv = torch.randn(1, T, 48, 128, device="cuda", generator=gen).to(BF16)
    outs = {}
    for pack in (False, True):
        mod = CachedAttention(32, 8, 128, backend=CudnnBackend(split=split, pack=pack))
        outs[pack] = mod(qkv, kv_cache=cache, seq_len=T, causal_block_size=b)[0].float()
        assert mod.plan_for(cache, T, b).packed == pack
    diff = (outs[True] - outs[False]).abs().max().item()
    scale = outs[False].abs().max().item()
    print(f"b={b} S={split}: packed vs unpacked max |diff| {diff:.2e} (output max {scale:.2e})")
    assert diff <= 2 * 2 ** -8 * scale, (diff, scale)
    cache.shutdown()
