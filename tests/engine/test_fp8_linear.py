"""`Fp8Linear` on the CPU (torch's CPU ``_scaled_mm``) against the fp32 product: rows of
the input and output channels of the weight spread over 24 binades, so that a scale
shared between rows, laid along the wrong dimension or applied to the wrong row fails
the same bounds that the per-row layout meets (the wrong layouts are emulated and
checked to fail them); the layer equal to its fp32 formula; GELU before the
quantizer; ``gemm_dtype`` names; shapes refused by naming the layer; an input the norm
wrote as e4m3 (`adaln_for`) giving the layer's output on the norm's own; fast
accumulation a checked per-layer choice."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framekv.engine.fp8_linear import (FP8, Fp8Linear, Fp8Rows, adaln_for,
                                       fp8_linear_reference, resolve_gemm_dtype)
from framekv.ops import quantize_rows_reference
from test_quant_rows import spread_rows

#: Per element, the error of an fp8 GEMM over sqrt(sum_k x^2 w^2) (its natural size:
#: each product is off by up to 2^-4 of itself in each operand, and the roundings of
#: K products add like a random walk). Measured on these inputs with the per-row
#: layout: 0.03 on average (the RMS of e4m3's relative rounding, 0.026 per operand),
#: at most 0.04 averaged over any row or column and 0.13 for one element. Any scale
#: shared by rows of other magnitudes zeroes the small rows (0.3 to 1 averaged over
#: them); a scale of the wrong row is off by orders of magnitude.
MEAN_BOUND, ROW_BOUND, MAX_BOUND = 0.04, 0.06, 0.25


def normalized_errors(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - x w^T| / sqrt(x^2 (w^2)^T) per element, in fp64 (the module doc's size)."""
    x, w = x.double(), w.double()
    return (y.double() - x @ w.t()).abs() / ((x * x) @ (w * w).t()).sqrt()


def within_bounds(e: torch.Tensor) -> bool:
    return (float(e.mean()) <= MEAN_BOUND and float(e.mean(1).max()) <= ROW_BOUND
            and float(e.mean(0).max()) <= ROW_BOUND and float(e.max()) <= MAX_BOUND)


def operands(M=64, K=128, N=96, seed=0):
    """x [M, K] rows and w [N, K] output channels each spread over 24 binades."""
    x = spread_rows(M, K, seed=seed)
    w = spread_rows(N, K, seed=seed + 1) / K ** 0.5
    return x, w


def dequant(t, s):
    return t.float() * s


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_scales_keep_every_row_and_channel_within_e4m3_rounding(dtype):
    x, w = operands()
    x, w = x.to(dtype), w.to(dtype)
    y = Fp8Linear(w, name="t")(x)
    assert y.dtype == dtype and y.shape == (64, 96)
    e = normalized_errors(y, x.float(), w.float())
    assert within_bounds(e), (float(e.mean()), float(e.mean(1).max()), float(e.max()))
    # and the worst case, always: 2^-4 per operand, the output's rounding beside it
    want = x.float() @ w.float().t()
    bound = (2 ** -3 + 2 ** -8) * (x.float().abs() @ w.float().abs().t()) + want.abs() * 2 ** -8
    assert bool(((y.float() - want).abs() <= bound).all())


def test_wrong_scale_layouts_fail_those_bounds():
    """The bounds above are tight enough to catch a scale in the wrong place."""
    x, w = operands()

    def per_tensor(t):
        s = t.abs().max() / 448
        return dequant((t / s).clamp(-448, 448).to(FP8), s)

    def per_row(t):
        return dequant(*quantize_rows_reference(t))

    q, s = quantize_rows_reference(x)
    qc, sc = quantize_rows_reference(x.t().contiguous())
    wrong = {"per-tensor": per_tensor(x) @ per_tensor(w).t(),
             "weight per-tensor": per_row(x) @ per_tensor(w).t(),
             "input per-tensor": per_tensor(x) @ per_row(w).t(),
             "input per column": dequant(qc, sc).t() @ per_row(w).t(),
             "scales of other rows": dequant(q, s.flip(0)) @ per_row(w).t()}
    assert within_bounds(normalized_errors(per_row(x) @ per_row(w).t(), x, w))
    for name, y in wrong.items():
        assert not within_bounds(normalized_errors(y, x, w)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_is_its_fp32_formula_rounded_once(dtype):
    x, w = operands(M=40, K=64, N=48, seed=3)
    bias = torch.linspace(-1, 1, 48)
    layer = Fp8Linear(w.to(dtype), bias.to(dtype), name="t")
    x3 = x.to(dtype).view(2, 20, 64)                                       # [B, S, K]
    got = layer(x3)
    want = fp8_linear_reference(layer, x3)
    assert got.shape == (2, 20, 48) and want.dtype == torch.float32
    step = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -20
    assert bool(((got.float() - want).abs() <= want.abs() * step + 1e-6 * want.abs().max()).all())
    # the bias is added once, after the scales
    no_bias = Fp8Linear(w.to(dtype), name="t")(x3).float()
    torch.testing.assert_close(got.float() - no_bias, bias.to(dtype).float().expand_as(no_bias),
                               rtol=0, atol=4 * step * float(want.abs().max()))


def test_gelu_is_applied_to_the_input_before_it_is_quantized():
    x, w = operands(M=16, K=64, N=32, seed=5)
    layer = Fp8Linear(w, name="t")
    x = x * 8
    got = layer(x, gelu=True)
    assert torch.equal(got, layer(F.gelu(x, approximate="tanh")))
    torch.testing.assert_close(got, fp8_linear_reference(layer, x, gelu=True), rtol=1e-5, atol=1e-6)
    e = normalized_errors(got, F.gelu(x, approximate="tanh"), w)
    assert float(e.mean()) <= MEAN_BOUND


def test_inputs_of_any_strides():
    x, w = operands(M=12, K=32, N=16)
    layer = Fp8Linear(w, name="t")
    buf = torch.zeros(12, 48)
    buf[:, 8:40] = x
    assert torch.equal(layer(buf[:, 8:40]), layer(x))                     # rows 48 apart
    assert torch.equal(layer(x.t().contiguous().t()), layer(x))           # column major
    assert layer.nbytes == 16 * 32 + 16 * 4


def test_gemm_dtype_names_resolve_against_the_model_dtype():
    assert resolve_gemm_dtype(None, torch.bfloat16) is torch.bfloat16
    assert resolve_gemm_dtype("bf16", torch.float32) is torch.float32
    assert resolve_gemm_dtype("fp8", torch.float32) is FP8
    assert resolve_gemm_dtype(FP8, torch.bfloat16) is FP8
    assert resolve_gemm_dtype(torch.float32, torch.float32) is torch.float32
    for bad in ("fp16", "FP8", torch.float16, 8):
        with pytest.raises(ValueError) as exc:
            resolve_gemm_dtype(bad, torch.bfloat16)
        msg = str(exc.value)
        assert msg.startswith("gemm_dtype must be None, 'bf16'") and f"got {bad!r}" in msg


@pytest.mark.parametrize("shape", [(24, 32), (32, 24), (40, 8)])
def test_features_not_multiples_of_16_name_the_layer(shape):
    with pytest.raises(ValueError) as exc:
        Fp8Linear(torch.randn(*shape), name="blocks.1.fc2")
    msg = str(exc.value)
    assert msg.startswith("blocks.1.fc2: fp8 GEMMs need in and out features that are "
                          "multiples of 16") and f"[{shape[0]}, {shape[1]}]" in msg


def test_other_bad_arguments_name_the_layer():
    w = torch.randn(32, 16)
    with pytest.raises(ValueError, match=r"blocks.0.qkv: the weight must be a \[out, in\]"):
        Fp8Linear(w[0], name="blocks.0.qkv")
    with pytest.raises(ValueError, match=r"blocks.0.qkv: the bias must be \[32\], got \[16\]"):
        Fp8Linear(w, torch.zeros(16), name="blocks.0.qkv")
    with pytest.raises(ValueError, match=r"proj: expected inputs of 16 features, got shape \[2, 32\]"):
        Fp8Linear(w, name="proj")(torch.zeros(2, 32))


# ----------------------------------------------------------------- inputs quantized by the norm
def test_a_norm_writing_the_fp8_input_is_the_layer_on_the_norms_output():
    """`adaln_for` hands an fp8 layer its input as e4m3 rows written by the norm itself:
    the layer's output is the one it gives the norm's output in the model's dtype."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(2, 10, 64, generator=g) * 3 + 1                       # [B, S, K]
    mods = dict(shift=torch.randn(2, 1, 64, generator=g), scale=torch.randn(2, 1, 64, generator=g))
    layer = Fp8Linear(torch.randn(48, 64, generator=g) / 8, torch.randn(48, generator=g),
                      name="t")
    rows = adaln_for(layer, x, **mods, eps=1e-6)
    assert isinstance(rows, Fp8Rows) and rows.q.dtype == FP8 and rows.scale.shape == (2, 10, 1)
    assert rows.dtype == x.dtype and rows.shape == x.shape
    h = adaln_for(None, x, **mods, eps=1e-6)                               # the model's dtype
    assert isinstance(h, torch.Tensor) and h.dtype == x.dtype
    assert torch.equal(layer(rows), layer(h))
    torch.testing.assert_close(fp8_linear_reference(layer, rows), fp8_linear_reference(layer, h),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="t: an input quantized already cannot take GELU"):
        layer(rows, gelu=True)
    with pytest.raises(ValueError, match=r"t: expected inputs of 64 features, got shape \[2, 10"):
        layer(Fp8Rows(rows.q[..., :32], rows.scale, x.dtype))


def test_fast_accumulation_is_a_checked_choice_of_each_layer():
    w = torch.randn(32, 16)
    assert not Fp8Linear(w, name="t").fast_accum
    assert Fp8Linear(w, name="t", fast_accum=True).fast_accum
    with pytest.raises(ValueError, match="blocks.0.fc2: fast_accum must be True or False, got 1"):
        Fp8Linear(w, name="blocks.0.fc2", fast_accum=1)
