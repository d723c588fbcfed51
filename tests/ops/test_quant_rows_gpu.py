"""``quantize_rows``'s kernel on a CUDA GPU: the Wan 1.3B and 14B GEMM inputs (a
chunk's 4680 tokens of 1536, 5120, 8960 or 13824 values), the widest row and odd ones,
bit for bit against the torch reference without GELU; with it (the kernel's sigmoid
form through the hardware's approximate exp2 and reciprocal) each scale within a few
fp32 ulps and each value within one e4m3 step, few bytes differing; every launch mode,
and a CUDA graph replayed with new contents equal to eager calls."""
from __future__ import annotations

import pytest
import torch

from framekv.ops.quant_rows import MAX_K, quantize_rows, quantize_rows_reference
from test_quant_rows import spread_rows
from test_quant_rows_sim import gelu_close, same

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("M,K", [(4680, 1536), (4680, 8960), (1560, 5120), (1560, 13824),
                                 (3, MAX_K)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_equals_the_reference_bit_for_bit(M, K, dtype):
    x = spread_rows(M, K, dtype, seed=K, device="cuda")
    assert same(quantize_rows(x), quantize_rows_reference(x))


@pytest.mark.parametrize("M,K", [(5, 24), (7, 7), (33, 50), (2, 100)])
def test_odd_shapes_in_every_launch_mode(M, K, launch_mode):
    buf = spread_rows(M, K + 8, torch.bfloat16, seed=K, device="cuda")
    x = buf[:, 3:3 + K]                      # rows of a buffer: the scalar path
    assert same(quantize_rows(x), quantize_rows_reference(x))
    gelu_close(quantize_rows(x, gelu=True), quantize_rows_reference(x, gelu=True))


@pytest.mark.parametrize("M,K", [(4680, 8960), (1560, 13824), (9, 40), (3, MAX_K)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gelu_is_within_one_e4m3_step_of_the_reference(M, K, dtype):
    x = spread_rows(M, K, dtype, seed=1, device="cuda", octaves=8) * 3
    gelu_close(quantize_rows(x, gelu=True), quantize_rows_reference(x, gelu=True))


def test_gelu_of_extreme_and_non_finite_inputs():
    """Far into either tail (GELU's exp2 overflows to inf below about -10: the value is
    -0), and NaN, inf and -inf (GELU(-inf) is NaN, left out of the scale)."""
    x = torch.linspace(-30, 30, 8960, device="cuda").repeat(4, 1)
    x[1, 5], x[2, 7], x[3, 9] = float("nan"), float("inf"), float("-inf")
    (q, s), (qr, sr) = quantize_rows(x, gelu=True), quantize_rows_reference(x, gelu=True)
    assert torch.equal(torch.isnan(q.float()), torch.isnan(qr.float()))
    assert torch.isinf(s[2]) and torch.isinf(sr[2])
    gelu_close((q[[0, 1, 3]], s[[0, 1, 3]]), (qr[[0, 1, 3]], sr[[0, 1, 3]]))


def test_a_graph_replay_equals_eager_calls():
    x = spread_rows(4680, 1536, torch.bfloat16, device="cuda")
    out = torch.empty(4680, 1536, dtype=torch.float8_e4m3fn, device="cuda")
    scale = torch.empty(4680, 1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        quantize_rows(x, out=out, scale=scale, gelu=True)      # warm (compiled, loaded)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantize_rows(x, out=out, scale=scale, gelu=True)
    x.copy_(spread_rows(4680, 1536, torch.bfloat16, seed=5, device="cuda"))
    graph.replay()
    assert same((out, scale), quantize_rows(x, gelu=True))
