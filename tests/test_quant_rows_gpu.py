"""``quantize_rows``'s kernel on a CUDA GPU: the Wan 1.3B and 14B GEMM inputs (a
chunk's 4680 tokens of 1536, 5120, 8960 or 13824 values), the widest row and odd ones,
bit for bit against the torch reference without GELU and within one e4m3 step with it
(tanh may differ in its last fp32 bit), every launch mode, and a CUDA graph replayed
with new contents equal to eager calls."""
from __future__ import annotations

import pytest
import torch

from framekv.ops.quant_rows import MAX_K, quantize_rows, quantize_rows_reference
from test_quant_rows import spread_rows
from test_quant_rows_sim import same

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
    gelu_close(x)


def gelu_close(x, changed: float = 1e-3) -> None:
    """With GELU: the scales within an fp32 ulp, each value within one e4m3 step, and
    at most a fraction ``changed`` of the bytes differing from the reference."""
    (q, s), (qr, sr) = quantize_rows(x, gelu=True), quantize_rows_reference(x, gelu=True)
    torch.testing.assert_close(s, sr, rtol=2e-7, atol=0)
    got, want = q.float() * s, qr.float() * sr
    assert bool(((got - want).abs() <= want.abs() * 2 ** -3 + sr * 2 ** -9).all())
    assert float((q.view(torch.uint8) != qr.view(torch.uint8)).float().mean()) <= changed


@pytest.mark.parametrize("M,K", [(4680, 8960), (1560, 13824), (9, 40)])
def test_gelu_is_within_one_e4m3_step_of_the_reference(M, K):
    gelu_close(spread_rows(M, K, torch.bfloat16, seed=1, device="cuda", octaves=8) * 3)


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
