"""The cache's device commit path (advance, rotate, layout, copy kernels) under numba's
simulator: the same rollouts as on a GPU, on CPU tensors."""
from __future__ import annotations

import pytest
import torch

from cache_harness import run_rollout
from framekv.engine import CausalKVCache
from framekv.specs import Geometry as G

pytestmark = pytest.mark.sim


@pytest.mark.parametrize("g,tpp", [
    (G(6, 9, 6, (3, 6)), 4),
    (G(5, 13, 4, (2, 4)), 2),
    (G(3, 2, 3, (1, 3)), 8),
])
def test_kernel_commits_resolve_rows_to_exact_visible_sets(g, tpp):
    cache = CausalKVCache(num_layers=2, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16,
                          tokens_per_page=tpp, device="cpu",
                          pool_tokens=CausalKVCache.pool_tokens_for(g, tpp))
    cache.open(g)
    run_rollout(cache, g, commits=12, seed=tpp, steps_per_chunk=1)
    # The device counters advanced by the kernels agree with the host mirror.
    assert cache._open.seqs[0].counters[:2].tolist() == [cache.committed_tokens, cache._open.seqs[0].host.ring_base]
