"""Stamped-K/V rollouts through a real `CausalKVCache`, shared by the CPU and GPU suites.

Every K/V value is a stamp: small integers (exact in bf16) spread over the head
dim that encode (layer, K or V, head, position, denoising step). Reading a block's
row back through the cache's own tensors (rows, seq_len_kv, the pool) and decoding
the stamps gives the set of positions the row resolves to, which must equal V(j)
exactly: no evicted key, no later block, no duplicate, no padding, no other layer.
"""
from __future__ import annotations

import numpy as np
import torch

from framekv.engine.cache.reference import visible_positions

BASE = 128  # digit base: every stamp element is an integer < 128, exact in bf16


def stamp(layer: int, kind: int, positions: torch.Tensor, step: int, H: int, D: int,
          dtype, device) -> torch.Tensor:
    """[T, H, D] stamps; kind 0 = K, 1 = V. Needs D >= 8."""
    T = positions.numel()
    out = torch.zeros(T, H, D, dtype=torch.float32)
    pos = positions.to(torch.int64).cpu()
    out[:, :, 0] = layer
    out[:, :, 1] = kind
    out[:, :, 2] = torch.arange(H, dtype=torch.float32)[None, :]
    out[:, :, 3] = (pos % BASE).float()[:, None]
    out[:, :, 4] = ((pos // BASE) % BASE).float()[:, None]
    out[:, :, 5] = ((pos // BASE**2) % BASE).float()[:, None]
    out[:, :, 6] = step % BASE
    out[:, :, 7] = 1  # 'written' marker: never-written (zero) memory decodes as invalid
    return out.to(dtype).to(device)


def decode(x: torch.Tensor) -> dict[str, np.ndarray]:
    """Stamps [N, H, D] -> per-key fields (checked identical across heads)."""
    f = x.float().cpu().numpy()
    heads = f[:, :, 2]
    assert (heads == np.arange(f.shape[1])[None, :]).all(), "head mix-up"
    f0 = f[:, 0, :]
    for i in (0, 1, 3, 4, 5, 6, 7):
        assert (f[:, :, i] == f0[:, None, i]).all(), "a key mixes heads"
    pos = f0[:, 3] + BASE * f0[:, 4] + BASE**2 * f0[:, 5]
    return {"layer": f0[:, 0].astype(int), "kind": f0[:, 1].astype(int),
            "pos": pos.astype(np.int64), "step": f0[:, 6].astype(int),
            "written": f0[:, 7].astype(int)}


def row_keys(cache, layer: int, b: int, j: int, sequence: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V a paged kernel reads for block j of a sequence: whole pages in row order,
    cut at seq_len_kv."""
    bt = cache.block_tensors(b, sequence)
    tpp = cache.tokens_per_page
    pages = bt.rows[j].to(torch.int64)
    n = int(bt.seq_len_kv[j])
    slots = (pages[:, None] * tpp + torch.arange(tpp, device=pages.device)[None, :]).reshape(-1)[:n]
    return cache.k_pool[layer][slots], cache.v_pool[layer][slots]


def check_block(cache, geometry, layer: int, b: int, j: int, committed: int,
                staged_step: int, committed_steps: dict[int, int] | None = None,
                sequence: int = 0) -> None:
    """Block j's row resolves to exactly V(j), with the right layer, kind and values."""
    s = committed + j * b
    want = visible_positions(geometry, committed, s, b)
    k, v = row_keys(cache, layer, b, j, sequence)
    for kind, x in ((0, k), (1, v)):
        d = decode(x)
        assert (d["written"] == 1).all(), f"block {j}: unwritten key"
        assert (d["layer"] == layer).all(), f"block {j}: another layer's key"
        assert (d["kind"] == kind).all(), f"block {j}: K/V mix-up"
        got = np.sort(d["pos"])
        assert got.size == want.size and np.array_equal(got, want), (
            f"layer {layer} b {b} block {j} s {s}: row resolves to {got.tolist()[:40]}..., "
            f"V(j) is {want.tolist()[:40]}...")
        staged = d["pos"] >= committed
        assert (d["step"][staged] == staged_step % BASE).all(), "stale staged key"
        if committed_steps is not None:
            for p, st in zip(d["pos"][~staged].tolist(), d["step"][~staged].tolist()):
                assert committed_steps[p] % BASE == st, f"position {p}: stale committed value"


def run_rollout(cache, geometry, *, commits: int, seed: int, check_every: int = 1,
                steps_per_chunk: int = 2, layers=None, on_commit=None,
                history: dict[int, int] | None = None, sequence: int = 0,
                partial_commits: bool = True) -> int:
    """Drive a random rollout through the public API; check every block's row.

    Each chunk: ``steps_per_chunk`` forwards overwrite the same staged positions
    (the last one's values must be what commit keeps), random declared block size,
    random T; then commit a random n <= T. Returns the final committed count.
    ``history`` (position -> step of its committed value) carries over between calls
    on one rollout. ``sequence``: the pool sequence driven (put in use first);
    ``partial_commits=False``: every chunk commits all it staged (as a chunk cycle does).
    """
    if cache.num_sequences > 1:
        cache.use_sequences([sequence])
    rng = np.random.default_rng(seed)
    H, D, dev, dt = cache.num_kv_heads, cache.head_dim, cache.device, cache.dtype
    layers = list(range(cache.num_layers)) if layers is None else layers
    M = geometry.max_staged_tokens
    last_step: dict[int, int] = {} if history is None else history
    step = max(last_step.values(), default=0)
    for c in range(commits):
        C = cache.sequence_committed_tokens(sequence)
        b = int(rng.choice(geometry.causal_block_sizes))
        T = b * int(rng.integers(1, M // b + 1))
        pos = torch.arange(C, C + T)
        check = c % check_every == 0
        for _ in range(steps_per_chunk):
            step += 1
            for layer in layers:
                cache.write_staged(layer, stamp(layer, 0, pos, step, H, D, dt, dev),
                                   stamp(layer, 1, pos, step, H, D, dt, dev), b)
            if check:
                for layer in layers:
                    for j in range(T // b):
                        check_block(cache, geometry, layer, b, j, C, step, last_step,
                                    sequence)
        n = T if rng.random() < 0.8 or not partial_commits else int(rng.integers(0, T + 1))
        cache.commit(n)
        for p in range(C, C + n):
            last_step[p] = step
        if on_commit is not None:
            on_commit(c)
    return cache.sequence_committed_tokens(sequence)
