"""An fp8 pool on a CUDA device: sizing against the driver, the same bytes as the CPU
formula, exact visible sets, and the fp8 rollout replayed bit for bit against eager."""
from __future__ import annotations

import pytest
import torch

from attention_harness import onehot_visible_sets
from framekv.engine import CausalKVCache
from framekv.engine.cache.quant import FP8
from framekv.engine.rollout import Rollout
from framekv.specs import Geometry as G
from test_cache_gpu import _free
from test_rollout_gpu import WIDE, steps_equal_eager

pytestmark = pytest.mark.gpu


def test_fp8_pool_bytes_for_equals_driver_allocation():
    g, tpp = G(512, 37824, 1576, (394, 1576)), 32
    kw = dict(num_layers=4, num_kv_heads=8, head_dim=128, dtype=FP8, tokens_per_page=tpp)
    free0 = _free()
    cache = CausalKVCache(**kw, pool_tokens=CausalKVCache.pool_tokens_for(g, tpp), device="cuda")
    cache.open(g)
    used = free0 - _free()
    assert used == CausalKVCache.pool_bytes_for(g, **kw) == cache.pool_bytes
    cache.shutdown()


def test_cuda_writes_the_bytes_and_statistics_of_the_cpu_formula():
    g = G(4, 16, 8, (8,))
    gen = torch.Generator().manual_seed(5)
    k = (torch.randn(8, 2, 16, generator=gen) * 30).to(torch.bfloat16)
    v = (torch.randn(8, 2, 16, generator=gen) * 200).to(torch.bfloat16)   # some saturate
    pools = {}
    for dev in ("cpu", "cuda"):
        c = CausalKVCache(num_layers=1, num_kv_heads=2, head_dim=16, dtype=FP8, tokens_per_page=4,
                          device=dev, pool_tokens=CausalKVCache.pool_tokens_for(g, 4))
        c.open(g)
        c.set_kv_scales(torch.tensor([[[0.25, 0.5], [0.5, 1.0]]]))
        c.write_staged(0, k.to(dev), v.to(dev), 8)
        c.commit(8)
        pools[dev] = (c._pool.view(torch.uint8).cpu(), c.kv_stats())
    assert torch.equal(pools["cpu"][0], pools["cuda"][0])
    assert pools["cpu"][1] == pools["cuda"][1] and pools["cuda"][1]["saturated"][0][1] > 0


@pytest.mark.parametrize("g,tpp,sizes", [(G(5, 13, 6, (2, 3, 6)), 4, (6, 3, 2)),
                                         (G(20, 3, 6, (3, 6)), 16, (6, 3))])
def test_onehot_visible_set_is_exact_with_an_fp8_pool_on_cuda(g, tpp, sizes):
    M = g.max_staged_tokens
    onehot_visible_sets(g, tpp, block_sizes=sizes, commits=(128 - M) // M,
                        dtype=torch.bfloat16, device="cuda", kv_dtype=FP8, tol=1e-2)


@pytest.mark.parametrize("backend", ["reference", "cudnn"])
def test_fp8_graph_replay_equals_eager_bit_for_bit(backend):
    """The fused staging quantizes K/V (and, for cuDNN, Q) inside the captured chunk;
    replays equal eager bit for bit, and nothing saturates at unit scales."""
    eager = Rollout(WIDE, "cuda", use_graphs=False, kv_dtype="fp8", backend=backend)
    graphed = Rollout(WIDE, "cuda", use_graphs=True, kv_dtype="fp8", backend=backend,
                      model=eager.model)
    assert graphed.cache.dtype == FP8
    steps_equal_eager(eager, graphed, 20, f"fp8 replay ({backend})")
    assert graphed.cache.kv_stats()["saturated"] == eager.cache.kv_stats()["saturated"]
    eager.close()
    graphed.close()
