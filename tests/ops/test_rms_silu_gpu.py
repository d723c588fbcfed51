"""``rms_norm_silu``'s kernel on a CUDA GPU: the Wan VAE's row widths (96, 192, 384) and
odd ones, with and without a bias, bf16 within one rounding of the fp32 reference, fp32
within 1e-5, rows in a slice of a buffer, and a CUDA graph replayed with new contents
equal to eager calls."""
from __future__ import annotations

import pytest
import torch

from framekv.ops.rms_silu import rms_norm_silu, rms_norm_silu_reference
from test_rms_silu import stamped

pytestmark = pytest.mark.gpu


def _close(got, x, gamma, silu=True, bias=None):
    want = rms_norm_silu_reference(x.float(), gamma.float(), silu=silu,
                                   bias=None if bias is None else bias.float())
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        step = want.abs().clamp_min(2 ** -120) * 2 ** -8       # one bf16 rounding
        assert bool(((got.float() - want).abs() <= step).all())


@pytest.mark.parametrize("B,M,N", [(1, 40000, 96), (2, 3001, 192), (1, 777, 384), (3, 5, 7),
                                   (1, 33, 50), (2, 9, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_against_the_fp32_reference(B, M, N, dtype):
    x, gamma = stamped(B, M, N, dtype=dtype, device="cuda")
    for silu in (True, False):
        _close(rms_norm_silu(x, gamma, silu=silu), x, gamma, silu)
    bias = torch.linspace(-2, 2, N, device="cuda", dtype=dtype)
    _close(rms_norm_silu(x, gamma, bias=bias), x, gamma, True, bias)


def test_rows_in_a_buffer_slice_and_a_graph_replay():
    x, gamma = stamped(2, 4096, 96, dtype=torch.bfloat16, device="cuda")
    buf = torch.zeros(2, 4098, 96, dtype=torch.bfloat16, device="cuda")
    rms_norm_silu(x, gamma, out=buf[:, 2:])
    _close(buf[:, 2:], x, gamma)
    assert bool((buf[:, :2] == 0).all())
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rms_norm_silu(x, gamma, out=buf[:, 2:])                # warm (compiled, loaded)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rms_norm_silu(x, gamma, out=buf[:, 2:])
    x.copy_(stamped(2, 4096, 96, dtype=torch.bfloat16, seed=5, device="cuda")[0])
    graph.replay()
    assert torch.equal(buf[:, 2:], rms_norm_silu(x, gamma))


def test_three_taps_of_a_folded_conv_buffer_equal_one_output():
    # [B, T, R, 3, N]: tap k gets x's first T - 2 + k steps from step 2 - k on (the Wan
    # VAE's last stage: 96 channels, 12 steps)
    B, T, R, N = 1, 12, 4160, 96
    x, gamma = stamped(B, T * R, N, dtype=torch.bfloat16, device="cuda")
    bias = torch.linspace(-2, 2, N, device="cuda")
    buf = torch.zeros(B, T, R, 3, N, dtype=torch.bfloat16, device="cuda")
    outs = tuple(buf[:, 2 - k:, :, k].view(B, -1, N) for k in range(3))
    rms_norm_silu(x, gamma, bias=bias, out=outs)
    want = rms_norm_silu(x, gamma, bias=bias).view(B, T, R, N)
    for k in range(3):
        assert torch.equal(buf[:, 2 - k:, :, k], want[:, :T - 2 + k])
        assert bool((buf[:, :2 - k, :, k] == 0).all())
