"""``adaln_`` and ``gated_residual_`` kernels on a CUDA GPU: the real geometries (B = 2,
S = 4680 tokens, N = 1536 and 5120) in bf16 against the fp32 reference, odd shapes in
every launch mode, fp32 within 1e-5, Wan's block glue, CUDA-graph capture replayed with
new contents equal bit for bit to eager calls, and torch.compile.

On the GPU an ``x + g * r`` may be one FMA (one rounding fewer than torch's two), so
the residual update is compared within one bf16 step, and the norm is checked against
the fp32 reference computed from the kernel's own updated x.
"""
from __future__ import annotations

import pytest
import torch

from framekv.ops.adaln import adaln_, adaln_reference, gated_residual_, gated_residual_reference
from test_adaln import (BF16, FP32, adaln_case, assert_bf16_close, clone_case, fused_glue,
                        same_bits, wan_case, wan_glue)
from test_ops_gpu import _side_stream_warmup

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
MODS = ("shift", "scale", "weight", "bias")


def _check(case: dict, x_before: torch.Tensor, out: torch.Tensor) -> None:
    """The kernel's x against the reference update of x_before; out against the fp32
    reference norm of the kernel's x (each within one rounding of out's dtype)."""
    torch.cuda.synchronize()
    if case["residual"] is not None:
        want_x = x_before.clone()
        gated_residual_reference(want_x, case["residual"], case["gate"])
        if want_x.dtype == FP32:
            torch.testing.assert_close(case["x"], want_x, rtol=1e-6, atol=1e-6)
        else:
            assert_bf16_close(case["x"], want_x, "x")
    want = adaln_reference(case["x"].clone(), **{k: case[k] for k in MODS},
                           out=torch.empty(out.shape, dtype=FP32, device=CUDA))
    if out.dtype == FP32:
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    else:
        assert_bf16_close(out, want, "out", atol=_term_error(case, out.shape))


def _term_error(case: dict, shape) -> torch.Tensor:
    """A few fp32 ulps of |norm * (1 + scale)| + |shift|: where the two terms cancel, an
    output near zero carries their rounding (and the device's FMA contraction) error."""
    mods = {k: case[k] for k in MODS if k != "shift"}
    scaled = adaln_reference(case["x"].clone(), **mods,
                             out=torch.empty(shape, dtype=FP32, device=CUDA)).abs()
    if case["shift"] is not None:
        S, M = shape[1], case["shift"].shape[1]
        scaled += case["shift"].float().repeat_interleave(S // M, dim=1).abs()
    return 2.0 ** -20 * scaled + 1e-6


def assert_close_but_for_fma_ties(got, want, what) -> None:
    """Each value within one bf16 step of want, except where an FMA moved an x element
    by one step upstream (a rare tie): that element (and, through cancellation in later
    sums, its later values) moves by about one step of the largest value it passed
    through, and its row's outputs by far less."""
    d = (got.float() - want.float()).abs()
    near = d <= 2.0 ** -7 * torch.maximum(got.float().abs(), want.float().abs()) + 1e-6
    assert d.max() < 0.1 and (~near).float().mean() < 1e-4, (what, d.max(), (~near).sum())


def _run(**kw) -> dict:
    case = adaln_case(CUDA, **kw)
    x_before = case["x"].clone()
    out = adaln_(**case)
    _check(case, x_before, out)
    return case


REAL = [  # (N, M, affine): per sequence, per frame (3 frames of 1560), per token
    (1536, 1, False), (1536, 3, True), (1536, 4680, False), (5120, 1, True), (5120, 3, False)]


@pytest.mark.parametrize("N,M,affine", REAL)
def test_real_geometry_bf16(N, M, affine):
    _run(B=2, S=4680, N=N, M=M, dtype=BF16, weight=affine, bias=affine, residual=True,
         gate=True, seed=N + M)


@pytest.mark.parametrize("N", [1536, 5120])
def test_real_geometry_fp32(N):
    _run(B=2, S=4680, N=N, M=3, dtype=FP32, weight=True, bias=True, residual=True, gate=True,
         out_dtype=FP32, strided=True, seed=N)


ODD = [  # (B, S, N, M, dtype, out_dtype, strided)
    (1, 1, 7, 1, BF16, None, False), (2, 3, 97, 3, FP32, BF16, True),
    (3, 5, 1537, 5, BF16, FP32, True), (2, 7, 5120, 7, BF16, None, False),
    (1, 33, 300, 11, FP32, None, True), (2, 2, 4099, 1, BF16, BF16, True)]


@pytest.mark.parametrize("B,S,N,M,dtype,out_dtype,strided", ODD)
def test_odd_shapes_match_reference(B, S, N, M, dtype, out_dtype, strided, launch_mode):
    _run(B=B, S=S, N=N, M=M, dtype=dtype, out_dtype=out_dtype, strided=strided, weight=True,
         bias=True, residual=True, gate=True, seed=N)
    _run(B=B, S=S, N=N, M=M, dtype=dtype, out_dtype=out_dtype, strided=strided,
         shift=False, seed=N + 1)


@pytest.mark.parametrize("dtype,gate", [(BF16, True), (FP32, False)])
def test_gated_residual_real_geometry(dtype, gate, launch_mode):
    case = adaln_case(CUDA, B=2, S=4680, N=1536, M=3, dtype=dtype, residual=True, gate=gate,
                      seed=3)
    want = case["x"].clone()
    gated_residual_(case["x"], case["residual"], case["gate"])
    gated_residual_reference(want, case["residual"], case["gate"])
    torch.cuda.synchronize()
    if dtype == FP32:
        torch.testing.assert_close(case["x"], want, rtol=1e-6, atol=1e-6)
    else:
        assert_bf16_close(case["x"], want, "x")


def test_wans_glue_on_cuda():
    (x, attn, attn2, ff), mods, norm2 = wan_case(CUDA, B=2, S=4680, N=1536, seed=4)
    with torch.no_grad():
        want = wan_glue(x.clone(), attn, attn2, ff, mods, norm2)
        got = fused_glue(x, attn, attn2, ff, mods, norm2)
    torch.cuda.synchronize()
    for name, a, b in zip(("h1", "h2", "h3", "x"), got, want):
        assert_close_but_for_fma_ties(a, b, name)


# --- CUDA graphs ---------------------------------------------------------------------


def _refill(case: dict, g: torch.Generator) -> None:
    for k in ("shift", "scale", "gate", "residual"):
        case[k].copy_(torch.randn(case[k].shape, generator=g))


def test_graph_replay_is_eager_bit_for_bit():
    case = adaln_case(CUDA, B=2, S=4680, N=1536, M=3, weight=True, bias=True, residual=True,
                      gate=True, out_dtype=BF16, seed=5)
    x, res, out = case["x"], case["residual"], case["out"]
    out2 = torch.empty_like(out)
    def step():
        adaln_(x, shift=case["shift"], scale=case["scale"], weight=case["weight"],
               bias=case["bias"], residual=res, gate=case["gate"], out=out)
        gated_residual_(x, res, case["gate"])
        adaln_(x, shift=case["shift"], scale=case["scale"], residual=res, out=out2)

    x0 = x.clone()
    _side_stream_warmup(step)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    g = torch.Generator().manual_seed(6)
    for trial in range(3):
        _refill(case, g)
        x0.copy_(torch.randn(x0.shape, generator=g) * 2 + 3)
        x.copy_(x0)
        out.fill_(float("nan"))
        out2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        replayed = (x.clone(), out.clone(), out2.clone())
        want = clone_case(case)  # the first norm, through the reference, from x0
        want["x"].copy_(x0)
        want["out"] = torch.empty(out.shape, dtype=FP32, device=CUDA)
        want_out = adaln_reference(**want)
        x.copy_(x0)
        step()
        torch.cuda.synchronize()
        for name, a, b in zip(("x", "out", "out2"), replayed, (x, out, out2)):
            assert same_bits(a, b), (trial, name)
        assert_close_but_for_fma_ties(replayed[1], want_out, "out")


# --- torch.compile -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_traces_under_torch_compile_on_cuda(backend):
    torch._dynamo.reset()

    def step(x, r, gate, shift, scale):
        h = adaln_(x, residual=r, gate=gate, shift=shift, scale=scale)
        gated_residual_(x, h, gate)
        return h

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    make = lambda: adaln_case(CUDA, B=2, S=40, N=1536, M=4, residual=True, gate=True,  # noqa: E731
                              seed=7)
    got, want = make(), make()
    keys = ("x", "residual", "gate", "shift", "scale")
    a = compiled(*(got[k] for k in keys))
    b = step(*(want[k] for k in keys))
    torch.cuda.synchronize()
    assert same_bits(got["x"], want["x"]) and same_bits(a, b)
