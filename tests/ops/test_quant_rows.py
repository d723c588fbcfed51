"""``quantize_rows`` on the CPU (the torch reference): each row's scale is its largest
|value| over 448, the dequantized row within e4m3's rounding of the input for rows of
very different magnitudes, GELU-tanh before quantizing, zero and non-finite rows, rows
that are a slice of a buffer, and every argument error named before anything is
written. The kernel's tests: ``_sim`` (numba's simulator) and ``_gpu``."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from framekv.ops.quant_rows import MAX_K, MIN_SCALE, quantize_rows

FP8 = torch.float8_e4m3fn


def spread_rows(M, K, dtype=torch.float32, seed=0, device="cpu", octaves=24):
    """Unit-normal rows, row m scaled by 2^(-octaves * m / (M - 1)): magnitudes across
    ``octaves`` binades, so a scale shared between rows leaves the small ones nothing."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 2.0 ** (-octaves * torch.arange(M) / max(M - 1, 1))[:, None]
    return x.to(device, dtype)


def dequantized(q, s):
    return q.float() * s


def test_each_row_is_within_e4m3_rounding_of_itself():
    x = spread_rows(12, 96)
    q, s = quantize_rows(x)
    assert q.dtype == FP8 and q.shape == (12, 96) and s.shape == (12, 1)
    assert s.dtype == torch.float32 and q.is_contiguous() and s.is_contiguous()
    torch.testing.assert_close(s, x.abs().amax(1, keepdim=True) / 448, rtol=0, atol=0)
    err = (dequantized(q, s) - x).abs()
    assert bool((err <= x.abs() * 2 ** -4 + s * 2 ** -10).all())
    # the largest |x| of each row is e4m3's largest value, exactly
    top = x.abs().argmax(1)
    assert bool((q.float().abs()[torch.arange(12), top] == 448).all())
    # and a row's error is a few percent of it, however small the row
    rel = (dequantized(q, s) - x).norm(dim=1) / x.norm(dim=1)
    assert float(rel.max()) < 0.05


def test_bf16_rows_and_a_slice_of_a_buffer():
    buf = spread_rows(6, 80, torch.bfloat16)
    x = buf[1:5, 8:72]                                        # rows 80 apart, 64 values
    q, s = quantize_rows(x)
    q2, s2 = quantize_rows(x.contiguous())
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    torch.testing.assert_close(s, x.float().abs().amax(1, keepdim=True) / 448, rtol=0, atol=0)


def test_gelu_is_applied_before_the_row_is_quantized():
    x = spread_rows(5, 48, octaves=6) * 4
    q, s = quantize_rows(x, gelu=True)
    q2, s2 = quantize_rows(F.gelu(x, approximate="tanh"))
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    assert not torch.equal(s, quantize_rows(x)[1])


def test_zero_and_non_finite_rows():
    x = spread_rows(4, 16, octaves=2)
    x[0] = 0
    x[1, 3] = math.nan
    x[2, 5] = math.inf
    q, s = quantize_rows(x)
    assert float(s[0]) == MIN_SCALE and bool((q[0].float() == 0).all())
    # a NaN stays a NaN and is left out of its row's scale
    assert math.isnan(float(q[1, 3])) and float(s[1]) == float(x[1].nan_to_num(0).abs().max() / 448)
    assert bool(torch.isfinite(q[1].float()).sum() == 15)
    # an infinite value makes the scale infinite: the row is zeros and NaN, never finite
    # values that hide it
    assert math.isinf(float(s[2])) and math.isnan(float(q[2, 5]))
    assert bool((q[2].float().nan_to_num(0) == 0).all())


def test_out_and_scale_are_written_where_given():
    x = spread_rows(3, 32)
    out, scale = torch.empty(3, 32, dtype=FP8), torch.empty(3, 1)
    q, s = quantize_rows(x, out=out, scale=scale)
    assert q is out and s is scale
    q2, s2 = quantize_rows(x)
    assert torch.equal(out.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, s2)


def test_errors_name_the_argument_and_write_nothing():
    x = spread_rows(4, 16)
    out = torch.zeros(4, 16, dtype=FP8)
    scale = torch.full((4, 1), 3.0)
    wide = torch.zeros(1, MAX_K + 1)
    cases = [
        (dict(x=x[0]), r"x: expected 2 dimensions \[M, K\]"),
        (dict(x=x.int()), "x must have dtype"),
        (dict(x=x.t()), "x: expected a contiguous last dimension"),
        (dict(x=wide), f"x: expected 1 <= K <= {MAX_K}"),
        (dict(gelu=1), "gelu: expected True or False"),
        (dict(out=out.float()), "out: expected a torch.float8_e4m3fn tensor of shape"),
        (dict(out=out[:3]), r"out: expected a torch.float8_e4m3fn tensor of shape \[4, 16\]"),
        (dict(out=torch.zeros(16, 4, dtype=FP8).t()), "out: expected a contiguous tensor"),
        (dict(scale=scale.view(1, 4)), r"scale: expected a torch.float32 tensor of shape \[4, 1\]"),
        (dict(scale=scale.double()), "scale: expected a torch.float32"),
    ]
    for kw, match in cases:
        args = dict(x=x, out=out, scale=scale) | kw
        with pytest.raises(ValueError, match=match):
            quantize_rows(args.pop("x"), **args)
        assert bool((out.float() == 0).all()) and bool((scale == 3.0).all()), match
    with pytest.raises(ValueError, match="scale: expected memory apart from x"):
        quantize_rows(x, scale=x.view(-1)[:4].view(4, 1))
