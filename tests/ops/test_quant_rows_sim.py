"""``quantize_rows``'s kernel under numba's CUDA simulator against the torch reference,
bit for bit without GELU: row widths where a thread holds one to several groups, a
partial last group (K not a multiple of 8: the scalar path), bf16 and fp32 rows of very
different magnitudes, zero and NaN rows, rows in a slice of a buffer; with GELU (the
kernel's sigmoid form, exp2 and division exact here) each row's scale within a few fp32
ulps of the reference's and every value within one e4m3 step.
Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``."""
from __future__ import annotations

import math

import pytest
import torch

from framekv.ops import _launch
from framekv.ops.quant_rows import _layout, quantize_rows, quantize_rows_reference
from test_quant_rows import spread_rows

pytestmark = pytest.mark.sim


def same(a, b) -> bool:
    """The same bytes and scales; NaN bytes compared as NaN (torch keeps a NaN's sign)."""
    (qa, sa), (qb, sb) = a, b
    nan = torch.isnan(qb.float())
    return (torch.equal(torch.isnan(qa.float()), nan) and torch.equal(sa, sb)
            and torch.equal(qa.view(torch.uint8)[~nan], qb.view(torch.uint8)[~nan]))


def test_kernel_runs_in_the_simulator():
    assert _launch.SIMULATOR and _launch.use_kernel(torch.zeros(1))


def test_layouts():
    # the simulator's warps are 4 threads: as few as hold a row in at most 4 groups of 8
    assert _layout(96) == (4, 3) and _layout(7) == (4, 1) and _layout(256) == (8, 4)
    assert _layout(264) == (12, 3)


def gelu_close(got, want, changed: float = 1e-3) -> None:
    """GELU's quantization against the reference's: each row's scale within a few fp32
    ulps (rtol 2^-18), each value within one e4m3 step, and at most a fraction
    ``changed`` of the bytes (or one) differing (module doc of `quant_rows`)."""
    (q, s), (qr, sr) = got, want
    torch.testing.assert_close(s, sr, rtol=2 ** -18, atol=0)
    a, b = q.float() * s, qr.float() * sr
    nan = torch.isnan(b)                                      # NaN where the input is
    assert torch.equal(torch.isnan(a), nan)
    assert bool(((a - b).abs() <= b.abs() * 2 ** -3 + sr * 2 ** -9)[~nan].all())
    differ = int((q.view(torch.uint8) != qr.view(torch.uint8)).sum())
    assert differ <= max(1, changed * q.numel()), differ


@pytest.mark.parametrize("M,K", [(3, 8), (5, 96), (2, 7), (4, 50), (3, 256), (2, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [False, True])
def test_kernel_equals_the_reference(M, K, dtype, gelu):
    x = spread_rows(M, K, dtype, seed=K)
    got, want = quantize_rows(x, gelu=gelu), quantize_rows_reference(x, gelu=gelu)
    if gelu:
        gelu_close(got, want)
    else:
        assert same(got, want)


def test_zero_nan_and_infinite_rows_and_a_buffer_slice():
    buf = spread_rows(6, 40, seed=3, octaves=4)
    x = buf[1:5, 4:36]
    x[0] = 0
    x[1, 7] = math.nan
    x[2, 2] = -math.inf
    assert same(quantize_rows(x), quantize_rows_reference(x))
    # GELU(-inf) is NaN: left out of the row's scale like any NaN
    got, want = quantize_rows(x, gelu=True), quantize_rows_reference(x, gelu=True)
    assert torch.isnan(got[0][2, 2].float()) and torch.isfinite(got[1][2])
    gelu_close(got, want)
