"""Many sequences on one pool, through `CachedAttention` (CPU and GPU suites).

``onehot_sequences``: q = 0 and a one-hot V per (sequence, position), so each output
row is the mean of the one-hot rows of exactly the keys it attended: a key of another
sequence, an evicted one or a missing one shows as a wrong entry. Sequences are
stepped in random subsets and orders, at different commit counts, with resets.

``batched_vs_alone``: random K/V/Q through one pool of N sequences in batches, and the
same data through one single-sequence cache per sequence; outputs compared.
"""
from __future__ import annotations

import numpy as np
import torch

from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.cache.reference import visible_positions


def pool(geometry, tpp, N, *, layers=1, Hkv=2, D=64, dtype=torch.float32, device="cpu"):
    cache = CausalKVCache(num_layers=layers, num_kv_heads=Hkv, head_dim=D, dtype=dtype,
                          tokens_per_page=tpp, device=device, num_sequences=N,
                          pool_tokens=CausalKVCache.pool_tokens_for(geometry, tpp,
                                                                    num_sequences=N))
    cache.open(geometry)
    return cache


def onehot_sequences(geometry, tpp, *, N, steps, seed=0, H=4, Hkv=2, D=64, dtype=torch.float32,
                     device="cpu", backend="reference", packed=False, pad=0, tol=1e-6) -> dict:
    """Random batches of the N sequences (any order, B from 1 to N), one forward per
    step in a random declared block size, commit, occasional resets; every output row
    checked against its own sequence's V(j). Returns counts of what was exercised."""
    rng = np.random.default_rng(seed)
    cache = pool(geometry, tpp, N, Hkv=Hkv, D=D, dtype=dtype, device=device)
    mod = CachedAttention(H, Hkv, D, backend=backend)
    M, span = geometry.max_staged_tokens, Hkv * D // N  # one-hot codes per sequence
    seen = {"resets": 0, "batches": set(), "max_commits": 0}
    for _ in range(steps):
        B = int(rng.integers(1, N + 1))
        ids = [int(i) for i in rng.permutation(N)[:B]]
        for i in ids:  # a sequence that would run out of codes leaves and joins again
            if cache.sequence_committed_tokens(i) + M > span:
                cache.reset_sequences([i])
                seen["resets"] += 1
        b = int(rng.choice(geometry.causal_block_sizes))
        out = _onehot_forward(cache, mod, ids, b, span, pad, packed, dtype, device)  # [B, M, H, D]
        for r, i in enumerate(ids):
            C = cache.sequence_committed_tokens(i)
            for j in range(M // b):
                vis = torch.from_numpy(visible_positions(geometry, C, C + j * b, b)) + i * span
                want = torch.zeros(Hkv, D)
                want[vis // D, vis % D] = 1.0 / vis.numel()
                got = out[r, j * b:(j + 1) * b].view(b, Hkv, H // Hkv, D)
                err = (got - want[None, :, None, :]).abs().max().item()
                assert err <= tol, (f"sequence {i} (batch row {r} of {ids}) C={C} block {j}: "
                                    f"attended set differs from its V(j), error {err}")
        before = [cache.sequence_committed_tokens(i) for i in range(N)]
        cache.commit(M, sequences=ids)
        after = [cache.sequence_committed_tokens(i) for i in range(N)]
        assert after == [c + M * (i in ids) for i, c in enumerate(before)], (ids, before, after)
        seen["batches"].add(B)
        seen["max_commits"] = max(seen["max_commits"], max(after) // M)
    return seen


def _onehot_forward(cache, mod, ids, b, span, pad, packed, dtype, device):
    M, (Hkv, D), H = cache.geometry.max_staged_tokens, (cache.num_kv_heads, cache.head_dim), mod.num_heads
    B, S = len(ids), M + pad
    qkv = torch.zeros(B, S, H + 2 * Hkv, D)
    for r, i in enumerate(ids):
        C = cache.sequence_committed_tokens(i)
        code = torch.arange(C, C + M) + i * span
        qkv[r, torch.arange(M), H + Hkv + code // D, code % D] = 1   # V one-hot
        qkv[r, :, H:H + Hkv] = torch.randn(S, Hkv, D)                # any K: q = 0
    qkv = qkv.to(device, dtype)
    seq = ids
    if packed:
        out = mod(qkv, kv_cache=cache, seq_len=M, causal_block_size=b, sequences=seq)
    else:
        out = mod(qkv[:, :, :H], qkv[:, :, H:H + Hkv], qkv[:, :, H + Hkv:], kv_cache=cache,
                  seq_len=M, causal_block_size=b, sequences=seq)
    if pad:
        assert bool((out[:, M:] == 0).all()), "padding rows must be zero"
    return out[:, :M].float().cpu()


def batched_vs_alone(geometry, tpp, *, N, chunks, chunk, frame, seed=0, layers=2, H=4, Hkv=2,
                     D=16, dtype=torch.float32, device="cpu", backend="reference") -> float:
    """Each chunk: a random subset of the N sequences runs denoising forwards (one block
    of ``chunk``) and a clean pass (blocks of ``frame``) as one batch, then commits;
    every sequence also runs alone in its own cache on the same data. Returns the
    largest difference of any output."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    many = pool(geometry, tpp, N, layers=layers, Hkv=Hkv, D=D, dtype=dtype, device=device)
    alone = [pool(geometry, tpp, 1, layers=layers, Hkv=Hkv, D=D, dtype=dtype, device=device)
             for _ in range(N)]
    mods = [CachedAttention(H, Hkv, D, backend=backend, layer_idx=i) for i in range(layers)]
    worst = 0.0
    for _ in range(chunks):
        ids = [int(i) for i in rng.permutation(N)[:int(rng.integers(1, N + 1))]]
        seq = ids
        for b in (chunk, chunk, frame):
            for layer, mod in enumerate(mods):
                qkv = torch.randn(len(ids), chunk, H + 2 * Hkv, D, generator=gen).to(device, dtype)
                out = mod(qkv, kv_cache=many, seq_len=chunk, causal_block_size=b, sequences=seq)
                for r, i in enumerate(ids):
                    one = mod(qkv[r:r + 1], kv_cache=alone[i], seq_len=chunk, causal_block_size=b)
                    worst = max(worst, (out[r] - one[0]).abs().max().item())
        many.commit(chunk, sequences=seq)
        for i in ids:
            alone[i].commit(chunk)
    return worst
