"""`ConvPlans` on a CUDA GPU: conv + bias (+ residual) graphs against torch's fp32
convolution of the same bf16 values (3-D causal shapes, 2-D, odd sizes, a batch), the
plan timed once per key and reused, a replay inside a CUDA graph equal to the eager
call, and a key first seen while capturing refused."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framekv.engine.wan.conv_plans import ConvPlans

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def case(N, C, K, S, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    fmt = torch.channels_last_3d if len(S) == 3 else torch.channels_last
    x = torch.randn(N, C, *S, generator=g).to("cuda", BF16).contiguous(memory_format=fmt)
    w = (torch.randn(K, C, *k, generator=g) / (C * 9) ** 0.5).to("cuda", BF16)
    b = torch.randn(K, generator=g).to("cuda", BF16)
    return x, w.contiguous(memory_format=fmt), b


def reference(x, w, b, pad, r=None):
    conv = F.conv3d if x.dim() == 5 else F.conv2d
    y = conv(x.float(), w.float(), b.float(), padding=pad)
    return y if r is None else y + r.float()


@pytest.mark.parametrize("N,C,K,S,k,pad", [
    (1, 96, 96, (5, 30, 52), (3, 3, 3), (0, 1, 1)),      # a steady chunk's causal conv
    (2, 16, 384, (3, 7, 9), (3, 3, 3), (0, 1, 1)),       # conv_in, a batch, odd sizes
    (1, 384, 768, (4, 6, 10), (3, 1, 1), (0, 0, 0)),     # a time upsample's conv
    (3, 192, 96, (24, 40), (3, 3), (1, 1)),              # a spatial upsample's conv
    (1, 96, 8, (3, 16, 16), (3, 3, 3), (0, 1, 1)),       # conv_out, channels padded to 8
])
@pytest.mark.parametrize("residual", [False, True])
def test_graphs_equal_torchs_convolution(N, C, K, S, k, pad, residual):
    plans = ConvPlans(torch.device("cuda"), allow_torch=False)
    x, w, b = case(N, C, K, S, k)
    want_shape = reference(x, w, b, pad).shape
    r = torch.randn(want_shape, device="cuda").to(BF16) if residual else None
    if r is not None:
        r = r.contiguous(memory_format=x.suggest_memory_format() if x.dim() == 4
                         else torch.channels_last_3d)
    y = plans(x, w, b, pad, r)
    want = reference(x, w, b, pad, r)
    assert y.shape == want.shape and y.dtype == BF16
    assert y.is_contiguous(memory_format=torch.channels_last_3d if x.dim() == 5
                           else torch.channels_last)
    err = (y.float() - want).abs().max()
    assert err <= 2 ** -7 * want.abs().max() + 1e-2, float(err)     # a bf16 rounding or two
    assert torch.equal(plans(x, w, b, pad, r), y) and len(plans) == 1
    assert plans._exe[next(iter(plans._exe))] is not None             # a cuDNN graph ran


def test_a_captured_replay_equals_the_eager_call_and_new_keys_are_refused_in_capture():
    plans = ConvPlans(torch.device("cuda"), allow_torch=False)
    x, w, b = case(1, 96, 96, (4, 20, 24), (3, 3, 3))
    want = plans(x, w, b, (0, 1, 1))                              # builds and times the key
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        plans(x, w, b, (0, 1, 1))
        with torch.cuda.graph(graph, stream=side):
            out = plans(x, w, b, (0, 1, 1))
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    x2, w2, b2 = case(1, 96, 96, (4, 20, 26), (3, 3, 3), seed=1)
    bad = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), pytest.raises(RuntimeError, match="inside CUDA graph capture"):
        with torch.cuda.graph(bad, stream=side):
            plans(x2, w2, b2, (0, 1, 1))
