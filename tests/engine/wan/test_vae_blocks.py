"""`vae_blocks._attention`, the fused programs' one-head attention: a head wider than
`FUSED_HEAD_MAX` (the Wan VAE's 384) by two matmuls and an fp32 softmax, equal to
PyTorch's attention in fp32 and within one bf16 rounding of it in bf16; a narrow head
through PyTorch's own."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framekv.engine.wan import vae_blocks
from framekv.engine.wan.vae_blocks import FUSED_HEAD_MAX, _attention


def _qkv(C, N=3, L=37, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # frame n's keys stamped by n: a frame attending to another frame's keys fails
    q, k, v = (torch.randn(N, L, C, generator=g) for _ in range(3))
    k = k + torch.arange(N).view(N, 1, 1)
    v = v + 3 * torch.arange(N).view(N, 1, 1)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _watch_pytorch_attention(monkeypatch):
    """(the calls of PyTorch's attention from here on, the unwatched function)."""
    called, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(vae_blocks.F, "scaled_dot_product_attention",
                        lambda *a: called.append(a) or sdpa(*a))
    return called, sdpa


@pytest.mark.parametrize("C", [384, FUSED_HEAD_MAX + 8])
def test_a_wide_head_equals_pytorch_attention_in_fp32(C, monkeypatch):
    q, k, v = _qkv(C)
    called, _ = _watch_pytorch_attention(monkeypatch)
    got = _attention(q, k, v)
    assert not called                                  # the two matmuls, not PyTorch's
    monkeypatch.undo()
    want = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # per frame: frame 1 alone gives frame 1's rows
    torch.testing.assert_close(_attention(q[1:2], k[1:2], v[1:2]), got[1:2], rtol=0, atol=0)


def test_a_wide_head_in_bf16_is_one_rounding_from_fp32():
    q, k, v = _qkv(384, dtype=torch.bfloat16)
    got = _attention(q, k, v)
    assert got.dtype == torch.bfloat16
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    # the scores' and the output's bf16 roundings: a few 2^-8 of |v| (up to ~7 here)
    err = (got.float() - want).abs().max()
    assert err <= 8 * 2 ** -8 * v.float().abs().max()
    assert (got.float() - v.float().mean(1, keepdim=True)).abs().max() > 10 * err  # not flat


def test_a_narrow_head_runs_pytorch_attention(monkeypatch):
    q, k, v = _qkv(FUSED_HEAD_MAX)
    called, sdpa = _watch_pytorch_attention(monkeypatch)
    got = _attention(q, k, v)
    assert len(called) == 1
    assert torch.equal(got, sdpa(q, k, v))
