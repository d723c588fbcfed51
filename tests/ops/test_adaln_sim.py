"""``adaln_`` and ``gated_residual_`` kernels under numba's CUDA simulator, against the
torch references run on the same inputs.

Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``. Shapes stay
tiny (one Python thread per CUDA thread); CTAs are capped at 8 threads and grids at 3,
so the row loop turns several times, a thread takes several groups of four values at
N = 33 or 96, and at N = 7 some threads of a CTA have no value at all. The simulator
has no FMA, so the residual update matches the reference bit for bit; the norm's sums
run in another order than torch's, so a bf16 output may be one rounding step off.
"""
from __future__ import annotations

import pytest
import torch

from framekv.ops import _launch
from framekv.ops.adaln import adaln_, adaln_reference, gated_residual_, gated_residual_reference
from test_adaln import (BF16, FP32, adaln_case, assert_bf16_close, clone_case, fused_glue,
                        wan_case, wan_glue)

pytestmark = pytest.mark.sim

CPU = torch.device("cpu")


def test_kernel_runs_in_the_simulator():
    assert _launch.SIMULATOR and _launch.use_kernel(torch.zeros(1))


def assert_out_close(got: torch.Tensor, want: torch.Tensor, what: str = "out") -> None:
    assert got.dtype == want.dtype, what
    if got.dtype == FP32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)
    else:
        assert_bf16_close(got, want, what)


def _compare(**kw):
    got = adaln_case(CPU, **kw)
    want = clone_case(got)
    out = adaln_(**got)
    want_out = adaln_reference(**want)
    assert torch.equal(got["x"], want["x"])  # the residual update: bit for bit
    assert_out_close(out, want_out)
    return got, out


CASES = [  # (B, S, N, M, dtype, mod_dtype, parts, out_dtype, strided)
    (1, 1, 7, 1, BF16, FP32, "mod", None, False),
    (2, 3, 7, 3, FP32, FP32, "all", FP32, True),
    (2, 4, 33, 2, BF16, FP32, "all", None, True),
    (1, 5, 33, 5, BF16, BF16, "residual", BF16, False),
    (3, 2, 96, 1, FP32, BF16, "affine", BF16, False),
    (2, 3, 96, 3, BF16, FP32, "gate_mod", FP32, True),
    (1, 3, 40, 1, FP32, FP32, "bare", None, False),
    (2, 2, 33, 1, BF16, FP32, "shift_weight", None, False),
    (1, 2, 250, 2, BF16, FP32, "all", None, True),  # longer than 8 threads' registers hold
    (2, 1, 201, 1, FP32, FP32, "all", FP32, False),
]
PARTS = dict(mod=("shift", "scale"), affine=("weight", "bias"), residual=("residual",),
             all=("shift", "scale", "weight", "bias", "residual", "gate"), bare=(),
             gate_mod=("shift", "scale", "residual", "gate"), shift_weight=("shift", "weight"))


@pytest.mark.parametrize("B,S,N,M,dtype,mod_dtype,parts,out_dtype,strided", CASES)
def test_adaln_kernel_matches_reference(B, S, N, M, dtype, mod_dtype, parts, out_dtype, strided):
    flags = {k: k in PARTS[parts] for k in ("shift", "scale", "weight", "bias", "residual", "gate")}
    got, out = _compare(B=B, S=S, N=N, M=M, dtype=dtype, mod_dtype=mod_dtype, out_dtype=out_dtype,
                        strided=strided, seed=N * 7 + S, **flags)
    assert out.dtype == (out_dtype or dtype) and torch.isfinite(out.float()).all()
    if out_dtype is not None:
        assert out is got["out"]


@pytest.mark.parametrize("dtype,gate", [(BF16, True), (FP32, True), (BF16, False)])
def test_gated_residual_kernel_matches_reference(dtype, gate):
    make = lambda: adaln_case(CPU, B=2, S=6, N=33, M=3, dtype=dtype, residual=True,  # noqa: E731
                              gate=gate, strided=True, seed=11)
    got, want = make(), make()
    gated_residual_(got["x"], got["residual"], got["gate"])
    gated_residual_reference(want["x"], want["residual"], want["gate"])
    assert torch.equal(got["x"], want["x"])
    assert not torch.equal(got["x"], make()["x"])  # something changed


def test_the_norm_reads_the_rounded_residual_sum():
    # |x| in [1, 4): half a bf16 ulp is at least 2^-8, so x + r with |r| = 2^-9 rounds
    # back to x. The norm must see that stored x, not the fp32 sum (whose norm differs
    # by about 2^-9 / std: far more than the tolerance).
    g = torch.Generator().manual_seed(15)
    x = (torch.rand(2, 3, 10, generator=g) * 3 + 1).to(BF16)
    r = torch.tensor([2.0 ** -9, -2.0 ** -9]).repeat(5).expand(2, 3, 10)
    x0 = x.clone()
    out = adaln_(x, residual=r, out=torch.empty(2, 3, 10))
    assert torch.equal(x, x0)
    norm = lambda v: torch.nn.functional.layer_norm(v.float(), (10,), eps=1e-6)  # noqa: E731
    torch.testing.assert_close(out, norm(x0), rtol=1e-5, atol=1e-5)
    assert (out - norm(x0.float() + r)).abs().max() > 1e-4


def test_wans_glue_through_the_kernels():
    (x, attn, attn2, ff), mods, norm2 = wan_case(CPU, B=2, S=6, N=33, per_token=True, seed=2)
    with torch.no_grad():
        want = wan_glue(x.clone(), attn, attn2, ff, mods, norm2)
        got = fused_glue(x, attn, attn2, ff, mods, norm2)
    for name, a, b in zip(("h1", "h2", "h3", "x"), got, want):
        assert_bf16_close(a, b, name)


def test_ops_take_new_contents_and_eps():
    case = adaln_case(CPU, B=2, S=4, N=33, M=2, weight=True, bias=True, residual=True,
                      gate=True, out_dtype=BF16, strided=True, seed=12)
    g = torch.Generator().manual_seed(13)
    for _ in range(2):
        for k in ("shift", "scale", "gate", "residual"):
            case[k].copy_(torch.randn(case[k].shape, generator=g))
        want = clone_case(case)
        assert adaln_(**case, eps=1e-5) is case["out"]
        adaln_reference(**want, eps=1e-5)
        assert torch.equal(case["x"], want["x"])
        assert_out_close(case["out"], want["out"])
        gated_residual_(case["x"], case["residual"], case["gate"])
        gated_residual_reference(want["x"], want["residual"], want["gate"])
        assert torch.equal(case["x"], want["x"])


def test_block_and_grid_sizes(monkeypatch):
    # Blocks of exactly N / 8 threads (THREAD_STEP 1: 12 at N = 96, one at N = 7, whose
    # block sum is one run), then whole warps of 32 (most lanes past the row's end).
    # MAX_THREADS and MAX_BLOCKS bind neither: one CTA per row, holding the whole row.
    for threads, blocks in ((1, 3), (32, 1)):
        monkeypatch.setattr(_launch, "MAX_THREADS", threads)
        monkeypatch.setattr(_launch, "THREAD_STEP", threads)
        monkeypatch.setattr(_launch, "MAX_BLOCKS", blocks)
        for N in (96, 7):
            _compare(B=2, S=2, N=N, M=2, weight=True, residual=True, gate=True, seed=N + threads)


@pytest.mark.parametrize("dtype", [BF16, FP32])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_vector_path_and_scalar_path_both_match_the_reference(dtype, offset):
    """Aligned tensors (N a multiple of 4, 4-element aligned rows) take the vector path
    (four consecutive values per access); x one element off takes the scalar one."""
    from framekv.ops._float import vector_aligned

    g = torch.Generator().manual_seed(11)
    B, S, N = 2, 3, 96
    base = torch.randn(B * S * N + 4, generator=g).to(dtype)
    x = base[offset:offset + B * S * N].view(B, S, N)
    mods = {k: torch.randn(B, 1, N, generator=g) for k in ("shift", "scale", "gate")}
    res = torch.randn(B, S, N, generator=g).to(dtype)
    assert vector_aligned(x) == (offset == 0) and vector_aligned(res)
    xr = x.clone()
    out = adaln_(x, residual=res, **mods)
    want = adaln_reference(xr, residual=res, **mods)
    assert torch.equal(x, xr)
    assert_out_close(out, want)
    y = torch.randn(B, S, N, generator=g).to(dtype)
    xr = x.clone()
    gated_residual_(x, y, mods["gate"])
    gated_residual_reference(xr, y, mods["gate"])
    assert torch.equal(x, xr)
