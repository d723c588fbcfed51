"""``adaln_``'s fp8 output on the CPU (the reference path): an e4m3 ``out`` with a scale
per token is ``quantize_rows`` of the output in x's dtype, bit for bit; against the
float64 definition within e4m3's rounding; rows of very different magnitudes (a
per-token modulation spread over 20 binades) each with its own scale; the arguments
refused by name before anything is written; torch.compile. The case builders are
shared with the simulator and GPU tests."""
from __future__ import annotations

import pytest
import torch

from framekv.ops import adaln_, quantize_rows_reference
from test_adaln import BF16, CPU, FP32, adaln_case, clone_case, float64_adaln

FP8 = torch.float8_e4m3fn
KEYS = ("x", "shift", "scale", "weight", "bias", "residual", "gate")


def fp8_outputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, out_scale) for an fp8 ``adaln_`` over x [B, S, N], NaN-filled scales."""
    B, S, N = x.shape
    return (torch.zeros(B, S, N, dtype=FP8, device=x.device),
            torch.full((B, S, 1), float("nan"), device=x.device))


def fp8_adaln(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``adaln_`` of ``case`` (updated in place) with an fp8 output: (q, scale)."""
    q, s = fp8_outputs(case["x"])
    adaln_(**{k: case[k] for k in KEYS}, out=q, out_scale=s)
    return q, s


def composed(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The same through the two ops it stands for: ``adaln_`` into x's dtype, then
    ``quantize_rows_reference`` by token (case updated in place)."""
    h = adaln_(**{k: case[k] for k in KEYS})
    q, s = quantize_rows_reference(h.view(-1, h.shape[-1]))
    return q.view(h.shape), s.view(*h.shape[:2], 1)


def same_fp8(a, b) -> bool:
    """The same e4m3 bytes and the same scales."""
    return torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) and torch.equal(a[1], b[1])


def spread_case(device, *, B=2, S=12, N=96, dtype=BF16, octaves=20, seed=0, **kw) -> dict:
    """A case whose output rows differ in magnitude by up to 2^octaves: a per-token
    scale (M = S) with 1 + scale = 2^(-octaves s / (S - 1)) (times 1 + 0.1 noise), no
    shift, so one scale shared by rows would leave the small ones nothing."""
    case = adaln_case(device, B=B, S=S, N=N, M=S, dtype=dtype, shift=False, seed=seed, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    mag = 2.0 ** (-octaves * torch.arange(S) / (S - 1))                      # [S]
    noise = 1 + 0.1 * torch.randn(B, S, N, generator=g)
    case["scale"] = (mag[None, :, None] * noise - 1).to(device)
    return case


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("parts", ["mod", "residual_affine", "all"])
def test_fp8_out_is_quantize_rows_of_the_output_in_x_dtype(dtype, parts):
    on = dict(mod=dict(shift=True, scale=True),
              residual_affine=dict(shift=False, scale=False, weight=True, bias=True,
                                   residual=True, gate=True),
              all=dict(weight=True, bias=True, residual=True, gate=True))[parts]
    case = adaln_case(CPU, B=2, S=6, N=48, M=3, dtype=dtype, seed=3, **on)
    other = clone_case(case)
    got = fp8_adaln(case)
    assert same_fp8(got, composed(other))
    assert torch.equal(case["x"], other["x"])            # the residual update, as before
    assert got[0].dtype == FP8 and got[1].shape == (2, 6, 1)


def test_fp8_out_is_within_e4m3_rounding_of_the_float64_definition():
    case = adaln_case(CPU, B=2, S=9, N=96, M=3, weight=True, bias=True, residual=True,
                      gate=True, seed=5)
    _, want = float64_adaln(**clone_case(case))
    q, s = fp8_adaln(case)
    got = q.double() * s.double()
    # the output's bf16 rounding, then e4m3's (3 mantissa bits; subnormal steps of 2^-9 s)
    bound = (2.0 ** -4 + 2.0 ** -7) * want.abs() + 2.0 ** -9 * s.double()
    assert bool(((got - want).abs() <= bound).all())
    top = want.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(s.double(), top / 448, rtol=2 ** -7, atol=0)


def test_rows_of_very_different_magnitudes_each_get_their_own_scale():
    case = spread_case(CPU, residual=True, gate=True)
    other = clone_case(case)
    q, s = fp8_adaln(case)
    h = adaln_(**{k: other[k] for k in KEYS}).float()                     # [B, S, N]
    top = h.abs().amax(-1, keepdim=True)
    torch.testing.assert_close(s, top / 448, rtol=0, atol=0)           # the row's own
    assert float(s.max() / s.min()) > 2.0 ** 18                        # 20 binades apart
    deq = q.float() * s
    assert bool(((deq - h).abs() <= 2.0 ** -4 * h.abs() + 2.0 ** -10 * s).all())
    rel = (deq - h).norm(dim=-1) / h.norm(dim=-1)                      # every row, small too
    assert float(rel.max()) < 0.05
    assert bool((q.float().abs().amax(-1) == 448).all())               # each row's top


def test_errors_name_the_argument_and_write_nothing():
    case = adaln_case(CPU, B=2, S=3, N=16, residual=True, gate=True, seed=7)
    q, s = fp8_outputs(case["x"])
    x0 = case["x"].clone()
    kw = {k: case[k] for k in KEYS}
    bad = [
        (dict(out=q), "out_scale: expected a float32 tensor of shape \\[2, 3, 1\\]"),
        (dict(out=torch.zeros(2, 3, 16), out_scale=s), "out_scale: expected None unless out"),
        (dict(out_scale=s), "out_scale: expected None unless out"),
        (dict(out=q, out_scale=s.double()), "out_scale: expected a torch.float32 tensor"),
        (dict(out=q, out_scale=torch.zeros(2, 3)), "out_scale: expected 3 dimensions"),
        (dict(out=q, out_scale=torch.zeros(3, 2, 1).transpose(0, 1)),
         "out_scale: expected a contiguous tensor"),
        (dict(out=torch.zeros(3, 2, 16, dtype=FP8).transpose(0, 1), out_scale=s),
         "out: expected a contiguous tensor"),
        (dict(out=q[:, :2], out_scale=s), "out: expected a torch.float8_e4m3fn tensor of shape"),
    ]
    for extra, match in bad:
        with pytest.raises(ValueError, match=match):
            adaln_(**kw, **extra)
        assert torch.equal(case["x"], x0) and bool((q.view(torch.uint8) == 0).all()), match
        assert bool(torch.isnan(s).all()), match
    inside_q = q.view(torch.uint8).view(-1)[:24].view(torch.float32).view(2, 3, 1)
    with pytest.raises(ValueError, match="out_scale: expected memory apart from out"):
        adaln_(**kw, out=q, out_scale=inside_q)
    assert torch.equal(case["x"], x0) and bool((q.view(torch.uint8) == 0).all())


def test_traces_under_torch_compile():
    def step(x, r, gate, shift, scale, q, s):
        adaln_(x, residual=r, gate=gate, shift=shift, scale=scale, out=q, out_scale=s)
        return s * 2

    def make():
        return adaln_case(CPU, B=2, S=5, N=32, M=5, residual=True, gate=True, seed=9)

    got, want = make(), make()
    qa, sa = fp8_outputs(got["x"])
    qb, sb = fp8_outputs(want["x"])
    keys = ("x", "residual", "gate", "shift", "scale")
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    a = compiled(*(got[k] for k in keys), qa, sa)
    b = step(*(want[k] for k in keys), qb, sb)
    assert torch.equal(a, b) and same_fp8((qa, sa), (qb, sb))
    assert torch.equal(got["x"], want["x"])
