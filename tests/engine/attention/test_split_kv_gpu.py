"""Split-KV in the cuDNN backend on an H200: exact key sets, bf16 accuracy against the
fp32 exact-window reference, and graph replay across commits."""
from __future__ import annotations

import pytest
import torch

from attention_harness import onehot_visible_sets, rollout_vs_reference
from framekv import specs
from framekv.engine.attention.cudnn import CudnnBackend
from framekv.bench.stack import AttentionStack, KVShape
from framekv.graphs import GraphCache
from framekv.specs import Geometry as G

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.mark.parametrize("split", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("g,tpp,sizes", [
    (G(5, 13, 6, (2, 3, 6)), 4, (6, 3, 2)),
    (G(3, 40, 12, (4, 12)), 32, (12, 4)),
])
def test_split_onehot_visible_set_is_exact(g, tpp, sizes, split):
    # Short rows: many sub-rows hold no key at all and must not reach the output.
    M = g.max_staged_tokens
    onehot_visible_sets(g, tpp, block_sizes=sizes, commits=(128 - M) // M, dtype=BF16,
                        device="cuda", backend=CudnnBackend(split=split), tol=2e-3)


@pytest.mark.parametrize("split", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("g,tpp,chunk,frame", [
    (G(64, 1536, 256, (64, 256)), 32, 256, 64),
    (G(77, 1100, 192, (48, 192)), 16, 192, 48),
])
def test_split_rollouts_match_exact_window_reference(g, tpp, chunk, frame, split):
    err = rollout_vs_reference(g, tpp, chunk=chunk, frame=frame, chunks=10, layers=2, H=8, Hkv=2,
                               D=128, dtype=BF16, device="cuda",
                               backend=CudnnBackend(split=split), seed=2)
    print(f"S={split}: errors vs fp32 exact-window reference: {err}")
    # One bf16 rounding more than the unsplit path (the partial outputs are stored in
    # bf16 before the fp32 merge): up to two bf16 ulps (2 * 2^-8) of the output scale.
    assert err["max_rel_error"] <= 8e-3, err


def test_seed_geometry_auto_split_is_within_5e4_of_the_reference():
    preset = specs.load_preset("seed-bench")
    g = preset.rollout.geometry()
    backend = CudnnBackend()  # the wave model
    assert backend.layout_for(g, 32, 32, 1576, 1576, "cuda", num_kv_heads=8) == (True, 5)
    assert backend.layout_for(g, 32, 32, 1576, 394, "cuda", num_kv_heads=8) == (True, 5)
    err = rollout_vs_reference(g, 32, chunk=1576, frame=394, chunks=26, steps=1, layers=1, H=32,
                               Hkv=8, D=128, dtype=BF16, device="cuda", backend=backend, seed=3,
                               many_keys=30000)
    print(f"seed geometry, packed S=5 denoise / packed S=5 clean: {err}")
    assert err["max_error_many_keys"] <= 5e-4, err


@pytest.mark.parametrize("splits,pack", [
    ((5, 2), False),
    ((5, 5), True),    # packed GQA rows, split: the merge reads the packed partials
    ((1, 1), True),    # packed without split: the output copied back
])
def test_split_forwards_replay_bit_for_bit_across_104_commits(splits, pack):
    preset = specs.load_preset("seed-bench")
    g, T, frame = preset.rollout.geometry(), 1576, 394
    kv = KVShape(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16",
                 tokens_per_page=32)
    backend = CudnnBackend(split={1576: splits[0], 394: splits[1]}, pack=pack)
    stacks = [AttentionStack(kv, [g], device="cuda", num_heads=32, backend=backend)
              for _ in range(2)]
    eager, graphed = stacks
    graphs = GraphCache("cuda", debug=True)
    req = graphed.chunk_request(g, T, denoise_steps=1, clean_block=frame, chain=True)
    assert req.key.splits == splits and req.key.packed == (pack, pack)
    graphs.capture(req.key, req.fn, req.inputs, after_replay=req.after_replay)
    for s in stacks:
        s.reset()
        s.cache.open(g)
    for i in range(104):
        gen = torch.Generator(device="cuda").manual_seed(i)
        x = torch.randn(eager.qkv_shape(T), device="cuda", generator=gen).to(BF16)
        want = eager.chunk(x, T, denoise_steps=1, clean_block=frame, chain=True)
        got = graphs.replay(req.key, {"qkv": x})
        for w, o in zip(want, got):
            assert torch.isfinite(w).all() and torch.equal(w, o), f"chunk {i}"
    assert torch.equal(eager.cache.k_pool, graphed.cache.k_pool)
    for s in stacks:
        s.cache.shutdown()


def test_a_plan_serves_every_layer_and_prepare_follows_commits():
    """One backend, one plan per forward for every layer (one cuDNN graph built); the
    plan's ``prepare`` is what keeps split sub-rows right after a commit: skipped, the
    forward reads the previous rows (the negative control)."""
    from framekv.engine import CachedAttention, CausalKVCache

    g, tpp, T = G(64, 1536, 256, (64, 256)), 32, 256
    backend = CudnnBackend(split=2)
    cache = CausalKVCache(num_layers=3, num_kv_heads=2, head_dim=128, dtype=BF16,
                          tokens_per_page=tpp, device="cuda",
                          pool_tokens=CausalKVCache.pool_tokens_for(g, tpp))
    cache.open(g)
    fast = [CachedAttention(8, 2, 128, backend=backend, layer_idx=i) for i in range(3)]
    ref = [CachedAttention(8, 2, 128, backend="reference", layer_idx=i) for i in range(3)]
    plan = fast[0].plan_for(cache, T, T)
    assert all(m.plan_for(cache, T, T) is plan for m in fast) and plan.splits == 2
    gen = torch.Generator(device="cuda").manual_seed(0)

    def qkv():
        return torch.randn(1, T, 12, 128, device="cuda", generator=gen).to(BF16)

    def err(a, b):
        return float((a.float() - b.float()).abs().max())

    for _ in range(8):
        x = qkv()
        plan.prepare()                                  # once for the three layers
        got = [m(x, kv_cache=cache, seq_len=T, causal_block_size=T, plan=plan) for m in fast]
        want = [m(x, kv_cache=cache, seq_len=T, causal_block_size=T) for m in ref]
        assert max(err(a, b) for a, b in zip(got, want)) < 2e-2
        cache.commit(T)
    x = qkv()
    want = ref[0](x, kv_cache=cache, seq_len=T, causal_block_size=T)
    stale = fast[0](x, kv_cache=cache, seq_len=T, causal_block_size=T, plan=plan)
    plan.prepare()
    fresh = fast[0](x, kv_cache=cache, seq_len=T, causal_block_size=T, plan=plan)
    print(f"stale sub-rows: error {err(stale, want):.3e}; prepared: {err(fresh, want):.3e}")
    assert err(stale, want) > 0.05 and err(fresh, want) < 2e-2
    assert backend.plans_built == 1
    cache.shutdown()
