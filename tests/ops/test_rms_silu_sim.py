"""``rms_norm_silu``'s kernel under numba's CUDA simulator against the torch reference:
row widths where a lane holds one to several groups, a partial last group (N not a
multiple of 4: the scalar path), segments past the last row, slices of a buffer.
Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``."""
from __future__ import annotations

import pytest
import torch

from framekv.ops import _launch
from framekv.ops.rms_silu import _segment, rms_norm_silu, rms_norm_silu_reference
from test_rms_silu import stamped

pytestmark = pytest.mark.sim


def test_kernel_runs_in_the_simulator():
    assert _launch.SIMULATOR and _launch.use_kernel(torch.zeros(1))


@pytest.mark.parametrize("B,M,N", [(1, 3, 8), (2, 5, 96), (1, 3, 7), (3, 2, 50), (1, 2, 384)])
@pytest.mark.parametrize("silu", [True, False])
def test_kernel_equals_the_reference(B, M, N, silu):
    x, gamma = stamped(B, M, N)
    got = rms_norm_silu(x, gamma, silu=silu)
    torch.testing.assert_close(got, rms_norm_silu_reference(x, gamma, silu=silu),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("B,M,N,dtype", [(2, 5, 96, torch.float32), (1, 3, 7, torch.float32),
                                         (2, 3, 24, torch.bfloat16)])
def test_a_bias_is_added_before_the_norm(B, M, N, dtype):
    x, gamma = stamped(B, M, N, dtype=dtype)
    bias = torch.linspace(-2, 2, N, dtype=dtype)
    got = rms_norm_silu(x, gamma, bias=bias).float()
    want = rms_norm_silu_reference(x, gamma, bias=bias).float()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:                                          # one bf16 rounding apart at most
        assert bool(((got - want).abs() <= want.abs() * 2 ** -8 + 1e-30).all())
    assert (got - rms_norm_silu(x, gamma).float()).abs().max() > 0.1


def test_bf16_rows_in_a_buffer_slice():
    x, gamma = stamped(2, 3, 24, dtype=torch.bfloat16)
    buf = torch.zeros(2, 5, 24, dtype=torch.bfloat16)
    rms_norm_silu(x, gamma, out=buf[:, 2:])
    want = rms_norm_silu_reference(x, gamma)
    assert (buf[:, 2:].float() - want.float()).abs().max() <= 2 ** -7 * want.float().abs().max()
    assert bool((buf[:, :2] == 0).all())


def test_segments():
    assert _segment(96) == (8, 3) and _segment(192) == (16, 3) and _segment(384) == (32, 3)
    assert _segment(8) == (1, 2) and _segment(1024) == (32, 8)


@pytest.mark.parametrize("N,dtype", [(24, torch.bfloat16), (7, torch.float32)])
def test_three_taps_from_one_read(N, dtype):
    # the time taps of a folded conv's input (test_rms_silu's buffer), the vector path
    # (N = 24) and the scalar one (N = 7), rows past each tap's M_i left alone
    B, T, R = 2, 3, 5
    x, gamma = stamped(B, T * R, N, dtype=dtype, seed=4)
    bias = torch.linspace(-1, 1, N, dtype=dtype)
    buf = torch.full((B, T, R, 3, N), 9.0, dtype=dtype)
    outs = tuple(buf[:, 2 - k:, :, k].view(B, -1, N) for k in range(3))
    rms_norm_silu(x, gamma, bias=bias, out=outs)
    want = rms_norm_silu_reference(x, gamma, bias=bias).view(B, T, R, N)
    for k in range(3):
        torch.testing.assert_close(buf[:, 2 - k:, :, k].float(), want[:, :T - 2 + k].float(),
                                   rtol=2 ** -7, atol=1e-6)
        assert bool((buf[:, :2 - k, :, k] == 9.0).all())
