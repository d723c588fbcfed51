"""CachedAttention with the reference backend on CPU: exact V(j), rollouts, padding, refusals."""
from __future__ import annotations

import pytest
import torch

from attention_harness import make, onehot_visible_sets, rollout_vs_reference
from framekv.engine import CachedAttention
from framekv.engine.attention.backend import AttentionBackend, TorchSDPABackend, attend_fp32
from framekv.specs import Geometry as G


@pytest.mark.parametrize("g,tpp,sizes", [
    (G(5, 13, 6, (2, 3, 6)), 4, (6, 3, 2)),   # pin unaligned, window unaligned, fills, full
    (G(8, 16, 8, (4, 8)), 8, (8, 4)),         # everything aligned
    (G(0, 7, 4, (1, 4)), 2, (4, 1)),          # no pin, one-token blocks
    (G(20, 3, 6, (3, 6)), 16, (6, 3)),        # window smaller than a page; pin over forwards
])
def test_onehot_visible_set_is_exact(g, tpp, sizes):
    M = g.max_staged_tokens
    onehot_visible_sets(g, tpp, block_sizes=sizes, commits=(128 - M) // M)


@pytest.mark.parametrize("g,tpp,chunk,frame", [
    (G(6, 24, 12, (4, 12)), 4, 12, 4),
    (G(3, 40, 8, (2, 8)), 8, 8, 2),
    (G(0, 10, 9, (3, 9)), 2, 9, 3),
])
def test_rollout_matches_exact_window_reference(g, tpp, chunk, frame):
    err = rollout_vs_reference(g, tpp, chunk=chunk, frame=frame, chunks=12)["max_error"]
    assert err < 2e-5, err


def test_packed_equals_separate_and_padding_is_neither_staged_nor_attended():
    g, tpp = G(6, 24, 12, (4, 12)), 4
    for packed in (False, True):
        err = rollout_vs_reference(g, tpp, chunk=12, frame=4, chunks=5, pad=5, packed=packed,
                                   seed=3)["max_error"]
        assert err < 2e-5, (packed, err)
    # The pool after a padded rollout equals the pool after the same unpadded rollout.
    pools = []
    for pad in (0, 7):
        cache, (mod,) = make(g, tpp, layers=1, H=4, Hkv=2, D=16, dtype=torch.float32,
                             device="cpu", backend="reference")
        gen = torch.Generator().manual_seed(9)
        for _ in range(4):
            qkv = torch.randn(1, 12, 8, 16, generator=gen)
            junk = torch.full((1, pad, 8, 16), 1e4)
            mod(torch.cat([qkv, junk], dim=1), kv_cache=cache, seq_len=12, causal_block_size=12)
            cache.commit(12)
        pools.append(cache._pool.clone())
    assert torch.equal(pools[0], pools[1]), "padding rows reached the cache"


def test_dirty_steps_overwrite_staged_tokens():
    g, tpp = G(4, 8, 4, (4,)), 4
    cache, (mod,) = make(g, tpp, layers=1, H=2, Hkv=1, D=8, dtype=torch.float32,
                         device="cpu", backend="reference")
    final = None
    for step in range(3):  # three denoising steps write the same positions
        qkv = torch.randn(1, 4, 4, 8)
        mod(qkv, kv_cache=cache, seq_len=4)
        final = qkv
    cache.commit(4)
    slots = torch.tensor([cache.slot_of(x) for x in range(4)])
    assert torch.equal(cache.k_pool[0][slots], final[0, :, 2:3])
    assert torch.equal(cache.v_pool[0][slots], final[0, :, 3:4])


def test_dense_path_is_full_attention():
    torch.manual_seed(0)
    mod = CachedAttention(4, 2, 16, backend="reference")
    q, k, v = torch.randn(1, 9, 4, 16), torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16)
    out = mod(q, k, v)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)
    assert torch.allclose(out, want, atol=1e-5)
    assert torch.allclose(TorchSDPABackend().dense(q, k, v, 0.25), attend_fp32(q[0], k[0], v[0], 0.25)[None], atol=1e-5)


def _setup():
    g, tpp = G(6, 24, 12, (4, 12)), 4
    cache, (mod,) = make(g, tpp, layers=1, H=4, Hkv=2, D=16, dtype=torch.float32,
                         device="cpu", backend="reference")
    return cache, mod, torch.randn(1, 12, 8, 16)


@pytest.mark.parametrize("call,match", [
    (lambda c, m, x: m(x, kv_cache=c), "seq_len .* is required with a kv_cache"),
    (lambda c, m, x: m(x, kv_cache=c, seq_len=13), r"seq_len must be an integer in \[1, 12\]"),
    (lambda c, m, x: m(x, kv_cache=c, seq_len=12, causal_block_size=5), "positive divisor of seq_len=12"),
    (lambda c, m, x: m(x, kv_cache=c, seq_len=12, causal_block_size=6), r"causal_block_size must be one of \(4, 12\)"),
    (lambda c, m, x: m(x, kv_cache=c, seq_len=12, attn_mask=torch.ones(1)), r"unsupported arguments \['attn_mask'\]"),
    (lambda c, m, x: m(x, is_causal=True), r"unsupported arguments \['is_causal'\]"),
    (lambda c, m, x: m(x.double()), "q must have dtype in"),
    (lambda c, m, x: m(x[:, :, :7]), r"packed q must have shape \[B, S, 8, 16\]"),
    (lambda c, m, x: m(x[:, :, :4], x[:, :, 4:6]), "k and v must both be given"),
    (lambda c, m, x: m(x[:, :, :4], x[:, :, 4:7], x[:, :, 4:7]), r"k must have shape \[1, 12, 2, 16\]"),
    (lambda c, m, x: m(x, seq_len=12), "seq_len, causal_block_size and sequences need a kv_cache"),
    (lambda c, m, x: m(x[0]), r"q must be a \[B, S, H, D\] tensor"),
])
def test_refusals(call, match):
    cache, mod, x = _setup()
    with pytest.raises(ValueError, match=match):
        call(cache, mod, x)


def test_fp32_off_the_cpu_is_the_reference_backends_alone():
    """fp32 q, k, v on a device other than the CPU (meta standing in for CUDA): the
    reference backend attends in fp32 anywhere (an fp32 model's oracle on a GPU); a
    backend of the fused kernels' formats refuses them by name."""
    q = torch.randn(1, 12, 8, 16).to("meta")                       # packed [1, S, 4 + 2 * 2, D]
    out = CachedAttention(4, 2, 16, backend="reference")(q)
    assert out.shape == (1, 12, 4, 16) and out.dtype == torch.float32

    class Half(TorchSDPABackend):
        name = "half"
        dtypes = AttentionBackend.dtypes                           # the default rule

    with pytest.raises(ValueError, match=r"q must have dtype in \(torch.bfloat16, "
                       r"torch.float16\) on meta \(backend 'half'\), got torch.float32"):
        CachedAttention(4, 2, 16, backend=Half())(q)
    assert CachedAttention(4, 2, 16, backend=Half())(q.bfloat16()).dtype == torch.bfloat16


def test_backend_without_cache_support_refuses_a_cache():
    cache, _, x = _setup()
    mod = CachedAttention(4, 2, 16, backend="sdpa")
    assert not mod.supports_kv_cache
    with pytest.raises(ValueError, match="backend 'sdpa' does not support a kv_cache"):
        mod(x, kv_cache=cache, seq_len=12)
    assert cache.staged_tokens == 0, "a refused call must not stage anything"


@pytest.mark.parametrize("args,match", [
    ((6, 4, 16), r"num_heads \(6\) must be a multiple of num_kv_heads \(4\)"),
    ((4, 0, 16), "num_kv_heads must be a positive integer"),
])
def test_constructor_refusals(args, match):
    with pytest.raises(ValueError, match=match):
        CachedAttention(*args)
    with pytest.raises(ValueError, match="backend must be"):
        CachedAttention(4, 2, 16, backend="flash")


def test_cache_geometry_mismatch_is_refused():
    cache, _, x = _setup()
    mod = CachedAttention(4, 1, 16, backend="reference")
    with pytest.raises(ValueError, match="kv_cache holds 2 K/V heads of 16, the module 1 of 16"):
        mod(x[:, :, :6], kv_cache=cache, seq_len=12)
