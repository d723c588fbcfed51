"""Cached-attention rollouts against the fp32 exact-window reference (CPU and GPU suites)."""
from __future__ import annotations

import torch

from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.cache.reference import ExactWindowReference, visible_positions


def make(geometry, tpp, *, layers, H, Hkv, D, dtype, device, backend, kv_dtype=None):
    """A cache opened at ``geometry`` (pool dtype ``kv_dtype``, default ``dtype``) and
    one `CachedAttention` per layer."""
    cache = CausalKVCache(num_layers=layers, num_kv_heads=Hkv, head_dim=D,
                          dtype=dtype if kv_dtype is None else kv_dtype,
                          tokens_per_page=tpp, device=device,
                          pool_tokens=CausalKVCache.pool_tokens_for(geometry, tpp))
    cache.open(geometry)
    mods = [CachedAttention(H, Hkv, D, backend=backend, layer_idx=i) for i in range(layers)]
    return cache, mods


def rollout_vs_reference(geometry, tpp, *, chunk, frame, chunks, steps=2, layers=2, H=4,
                         Hkv=2, D=16, dtype=torch.float32, device="cpu", backend="reference",
                         pad=0, packed=False, seed=0, many_keys=1024, kv_dtype=None):
    """Denoising forwards (one block of ``chunk``) then a clean pass (blocks of ``frame``),
    ``steps`` forwards overwriting the same positions, commit; every forward compared
    with the reference.

    Returns {"max_error": over every forward, "max_error_many_keys": over forwards
    whose every block attends >= ``many_keys`` keys (outputs then have the small
    magnitude of real rollouts), "max_rel_error": max error / max |reference|,
    "mean_error": the mean |error| over every output value}. ``kv_dtype``: the pool's
    dtype (default ``dtype``; the reference keeps the unquantized K/V).
    """
    gen = torch.Generator().manual_seed(seed)
    cache, mods = make(geometry, tpp, layers=layers, H=H, Hkv=Hkv, D=D, dtype=dtype,
                       device=device, backend=backend, kv_dtype=kv_dtype)
    ref = ExactWindowReference(geometry, layers)
    worst = {"max_error": 0.0, "max_error_many_keys": 0.0, "max_rel_error": 0.0}
    total, count = 0.0, 0
    for _ in range(chunks):
        for b in [chunk] * steps + [frame]:
            S = chunk + pad
            for layer, mod in enumerate(mods):
                qkv = torch.randn(1, S, H + 2 * Hkv, D, generator=gen).to(device, dtype)
                q, k, v = qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:]
                out = (mod(qkv, kv_cache=cache, seq_len=chunk, causal_block_size=b) if packed
                       else mod(q, k, v, kv_cache=cache, seq_len=chunk, causal_block_size=b))
                ref.write(layer, ref.committed, k[0, :chunk], v[0, :chunk])
                want = ref.attention(layer, q[0], chunk, b)
                diff = (out[0, :chunk].float().cpu() - want[:chunk]).abs()
                err = diff.max().item()
                total, count = total + diff.sum().item(), count + diff.numel()
                keys = min(visible_positions(geometry, ref.committed, ref.committed + j * b, b).size
                           for j in range(chunk // b))
                worst["max_error"] = max(worst["max_error"], err)
                worst["max_rel_error"] = max(worst["max_rel_error"], err / want.abs().max().item())
                if keys >= many_keys:
                    worst["max_error_many_keys"] = max(worst["max_error_many_keys"], err)
                if pad:
                    assert bool((out[0, chunk:] == 0).all()), "padding rows must be zero"
        cache.commit(chunk)
        ref.commit(chunk)
    worst["mean_error"] = total / max(count, 1)
    return worst


def onehot_visible_sets(geometry, tpp, *, block_sizes, commits, H=2, Hkv=2, D=64,
                        dtype=torch.float32, device="cpu", backend="reference", tol=1e-6,
                        kv_dtype=None):
    """q = 0 and a one-hot V per position: each output row is the mean of V(j)'s one-hot
    rows, so the positions a block attended are read back exactly (the value 1/|V(j)| on
    each of them, 0 elsewhere). Position x is one-hot at head x // D, dim x % D. 0 and 1
    are exact in every pool dtype, fp8 included."""
    cache, (mod,) = make(geometry, tpp, layers=1, H=H, Hkv=Hkv, D=D, dtype=dtype,
                         device=device, backend=backend, kv_dtype=kv_dtype)
    limit = Hkv * D
    M = geometry.max_staged_tokens
    for c in range(commits):
        C = cache.committed_tokens
        assert C + M <= limit, "rollout longer than the one-hot code"
        b = block_sizes[c % len(block_sizes)]
        pos = torch.arange(C, C + M)
        v = torch.zeros(1, M, Hkv, D)
        v[0, torch.arange(M), pos // D, pos % D] = 1
        k = torch.randn(1, M, Hkv, D)
        q = torch.zeros(1, M, H, D)
        out = mod(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype),
                  kv_cache=cache, seq_len=M, causal_block_size=b)[0].float().cpu()  # [M, H, D]
        group = H // Hkv
        for j in range(M // b):
            want = torch.zeros(Hkv, D)
            vis = torch.from_numpy(visible_positions(geometry, C, C + j * b, b))
            want[vis // D, vis % D] = 1.0 / vis.numel()
            got = out[j * b:(j + 1) * b].view(b, Hkv, group, D)
            assert (got - want[None, :, None, :]).abs().max().item() <= tol, (
                f"commit {c} block {j}: attended set differs from V(j) = {vis.tolist()}")
        cache.commit(M)
    return cache
