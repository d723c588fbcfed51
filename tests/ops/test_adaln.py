"""CPU tests of ``adaln_`` and ``gated_residual_``: the torch references against
independent compositions (a float64 LayerNorm written out by hand with per-token
modulation rows gathered by index, the reference model's ``modulate``, diffusers'
``FP32LayerNorm`` in the glue of Wan's block), the public ops on CPU (the reference
path), argument validation (each failure names the argument and changes nothing) and
torch.compile. Also the case builders and the bf16 comparison shared by
the simulator and GPU tests.
"""
from __future__ import annotations

import pytest
import torch

from framekv.engine.model.blocks import modulate
from framekv.ops.adaln import adaln_, adaln_reference, gated_residual_, gated_residual_reference

CPU = torch.device("cpu")
META = torch.device("meta")
BF16, FP32 = torch.bfloat16, torch.float32
EPS = 1e-6

# --- case builders (shared with the simulator and GPU tests) --------------------------


def _randn(g, *shape, dtype, device, scale=1.0, offset=0.0):
    return (torch.randn(*shape, generator=g) * scale + offset).to(device=device, dtype=dtype)


def adaln_case(device, *, B=2, S=6, N=7, M=1, dtype=BF16, mod_dtype=FP32, shift=True,
               scale=True, weight=False, bias=False, residual=False, gate=False,
               out_dtype=None, strided=False, seed=0) -> dict:
    """Keyword arguments of ``adaln_`` (every key present, None when absent), drawn
    afresh from ``seed``. x has a mean far from 0 (two-pass statistics matter).
    strided: x, residual and out are [B, S, N] windows of wider token-major buffers,
    and shift/scale/gate are rows of one packed [B, M, 3, N + 1] tensor."""
    g = torch.Generator().manual_seed(seed)

    def rows(scale_=1.0, offset=0.0, dt=dtype):
        if strided:  # [S, B, N + 5] buffer -> [B, S, N] with strides (N+5, B*(N+5), 1)
            wide = _randn(g, S, B, N + 5, dtype=dt, device=device, scale=scale_, offset=offset)
            return wide.transpose(0, 1)[:, :, 3:N + 3]
        return _randn(g, B, S, N, dtype=dt, device=device, scale=scale_, offset=offset)

    case = dict(x=rows(2.0, 3.0), residual=rows() if residual else None)
    packed = _randn(g, B, M, 3, N + 1, dtype=mod_dtype, device=device, scale=0.5)
    for k, (name, on) in enumerate((("shift", shift), ("scale", scale), ("gate", gate))):
        mod = packed[:, :, k, :N] if strided else packed[:, :, k, :N].contiguous()
        case[name] = mod if on else None
    case["weight"] = _randn(g, N, dtype=mod_dtype, device=device, scale=0.5, offset=1.0) \
        if weight else None
    case["bias"] = _randn(g, N, dtype=mod_dtype, device=device, scale=0.5) if bias else None
    case["out"] = None
    if out_dtype is not None:  # NaN everywhere, so a missed element shows
        case["out"] = rows(dt=out_dtype).fill_(float("nan"))
    return case


def float64_adaln(x, *, shift=None, scale=None, weight=None, bias=None, residual=None,
                  gate=None, out=None, eps=EPS):
    """(x after the residual, rounded to x's dtype, as float64; out before its last
    rounding, float64), computed from the definition: per-token rows by index."""
    B, S, N = x.shape

    def per_token(t):
        return t.double()[:, torch.arange(S) // (S // t.shape[1])]

    xd = x.double()
    if residual is not None:
        upd = residual.double() * (per_token(gate) if gate is not None else 1.0)
        xd = (xd + upd).to(x.dtype).double()
    mean = xd.mean(-1, keepdim=True)
    y = (xd - mean) / torch.sqrt(((xd - mean) ** 2).mean(-1, keepdim=True) + eps)
    y = y * (weight.double() if weight is not None else 1.0)
    y = y + (bias.double() if bias is not None else 0.0)
    y = y * (1 + per_token(scale)) if scale is not None else y
    return xd, (y + per_token(shift) if shift is not None else y)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, what: str = "",
                      atol=1e-6) -> None:
    """got within one bf16 rounding step of want (two roundings of nearly equal fp32
    values may land one ulp apart; ulp(v) <= 2^-7 |v|), plus ``atol`` (a number or a
    tensor like got: the fp32 error of the terms a value was summed from)."""
    g, w = got.float(), want.float()
    assert torch.isfinite(g).all(), what
    bound = 2.0 ** -7 * torch.maximum(g.abs(), w.abs()) + atol
    bad = (g - w).abs() > bound
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements off, "
                           f"e.g. {g[bad][:4]} vs {w[bad][:4]}")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN included) of two float tensors of one dtype."""
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and torch.equal(a.view(bits[a.dtype]), b.view(bits[b.dtype]))


def clone_case(case: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


# --- the references against independent compositions ---------------------------------

GEOMETRIES = [  # (B, S, N, M)
    (1, 1, 7, 1), (2, 6, 7, 1), (2, 6, 96, 3), (3, 5, 96, 5), (2, 9, 1536, 3),
    (1, 4, 1536, 4), (2, 15, 33, 15),
]


@pytest.mark.parametrize("B,S,N,M", GEOMETRIES)
@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("parts", ["mod", "affine", "residual", "all", "bare", "shift", "scale"])
def test_reference_matches_float64_definition(B, S, N, M, strided, parts):
    on = dict(mod=("shift", "scale"), affine=("weight", "bias"), residual=("residual", "gate"),
              all=("shift", "scale", "weight", "bias", "residual", "gate"), bare=(),
              shift=("shift", "bias"), scale=("scale", "weight", "residual"))[parts]
    flags = {k: k in on for k in ("shift", "scale", "weight", "bias", "residual", "gate")}
    case = adaln_case(CPU, B=B, S=S, N=N, M=M, dtype=FP32, strided=strided, seed=N + S, **flags)
    want_x, want = float64_adaln(**case)
    got = adaln_reference(**case)
    assert got.dtype == FP32 and got.shape == (B, S, N)
    torch.testing.assert_close(case["x"].double(), want_x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_reference_is_the_models_modulate():
    case = adaln_case(CPU, B=2, S=10, N=96, dtype=FP32, seed=3)
    want = modulate(case["x"], case["shift"], case["scale"])
    torch.testing.assert_close(adaln_reference(**case), want, rtol=1e-5, atol=1e-5)


def wan_glue(x, attn, attn2, ff, mods, norm2, eps=EPS):
    """Wan's block glue as diffusers writes it (WanTransformerBlock.forward), the
    sublayers' outputs given: returns (norm1 out, norm2 out, norm3 out, new x)."""
    from diffusers.models.normalization import FP32LayerNorm

    shift, scale, gate, c_shift, c_scale, c_gate = mods
    N = x.shape[-1]
    norm = FP32LayerNorm(N, eps, elementwise_affine=False)
    h1 = (norm(x.float()) * (1 + scale) + shift).type_as(x)
    x = (x.float() + attn * gate).type_as(x)
    h2 = norm2(x.float()).type_as(x)
    x = x + attn2
    h3 = (norm(x.float()) * (1 + c_scale) + c_shift).type_as(x)
    x = (x.float() + ff.float() * c_gate).type_as(x)
    return h1, h2, h3, x


def fused_glue(x, attn, attn2, ff, mods, norm2, eps=EPS):
    """The same glue through the fused ops (x updated in place)."""
    shift, scale, gate, c_shift, c_scale, c_gate = mods
    h1 = adaln_(x, shift=shift, scale=scale, eps=eps)
    h2 = adaln_(x, residual=attn, gate=gate, weight=norm2.weight, bias=norm2.bias, eps=eps)
    h3 = adaln_(x, residual=attn2, shift=c_shift, scale=c_scale, eps=eps)
    gated_residual_(x, ff, c_gate)
    return h1, h2, h3, x


def wan_case(device, *, B=2, S=12, N=96, per_token=False, seed=0):
    """Inputs of one Wan block's glue: bf16 activations, fp32 modulation [B, 1, N]
    (or per token [B, S, N], rows of a packed [B, S, 6, N] as Wan 2.2 chunks them)."""
    from diffusers.models.normalization import FP32LayerNorm

    g = torch.Generator().manual_seed(seed)
    acts = [_randn(g, B, S, N, dtype=BF16, device=device, scale=s, offset=o)
            for s, o in ((2.0, 1.0), (1.0, 0.0), (1.0, 0.0), (1.0, 0.0))]
    packed = _randn(g, B, S if per_token else 1, 6, N, dtype=FP32, device=device, scale=0.3)
    mods = tuple(packed[:, :, k] for k in range(6))
    norm2 = FP32LayerNorm(N, EPS, elementwise_affine=True).to(device)
    with torch.no_grad():
        norm2.weight.copy_(_randn(g, N, dtype=FP32, device=device, scale=0.3, offset=1.0))
        norm2.bias.copy_(_randn(g, N, dtype=FP32, device=device, scale=0.3))
    return acts, mods, norm2


@pytest.mark.parametrize("per_token", [False, True])
def test_fused_ops_are_wans_glue_on_cpu(per_token):
    (x, attn, attn2, ff), mods, norm2 = wan_case(CPU, per_token=per_token, seed=1)
    with torch.no_grad():
        want = wan_glue(x.clone(), attn, attn2, ff, mods, norm2)
        got = fused_glue(x, attn, attn2, ff, mods, norm2)
    for name, a, b in zip(("h1", "h2", "h3", "x"), got, want):
        assert a.dtype == BF16 and torch.equal(a, b), name


@pytest.mark.parametrize("x_dtype,y_dtype,gate_dtype", [(BF16, BF16, FP32), (FP32, BF16, BF16),
                                                        (BF16, FP32, None)])
def test_gated_residual_reference_rounds_once(x_dtype, y_dtype, gate_dtype):
    g = torch.Generator().manual_seed(4)
    x = _randn(g, 2, 6, 33, dtype=x_dtype, device=CPU)
    y = _randn(g, 2, 6, 33, dtype=y_dtype, device=CPU)
    gate = None if gate_dtype is None else _randn(g, 2, 3, 33, dtype=gate_dtype, device=CPU)
    gd = 1.0 if gate is None else gate.double().repeat_interleave(2, dim=1)
    want = (x.double() + y.double() * gd).to(x_dtype)  # one rounding from (almost) exact
    gated_residual_reference(x, y, gate)
    if x_dtype == BF16:
        assert_bf16_close(x, want)
    else:
        torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)


# --- the public ops on CPU -----------------------------------------------------------


@pytest.mark.parametrize("out_dtype", [None, BF16, FP32])
def test_public_op_runs_the_reference(out_dtype):
    def make():
        return adaln_case(CPU, S=8, N=33, M=4, weight=True, bias=True, residual=True,
                          gate=True, out_dtype=out_dtype, strided=True, seed=5)

    got, want = make(), make()
    out = adaln_(**got)
    assert out is got["out"] if out_dtype is not None else out.is_contiguous()
    assert out.dtype == (out_dtype or BF16)
    assert torch.equal(out, adaln_reference(**want)) and torch.equal(got["x"], want["x"])


def test_custom_ops_are_registered():
    case = adaln_case(CPU, residual=True, gate=True, out_dtype=FP32, seed=6)
    want = clone_case(case)
    torch.ops.framekv.adaln_(case["x"], case["out"], case["shift"], case["scale"], None, None,
                             case["residual"], case["gate"], EPS, None)
    adaln_reference(**want)
    assert torch.equal(case["out"], want["out"]) and torch.equal(case["x"], want["x"])
    torch.ops.framekv.gated_residual_(case["x"], case["residual"], None)
    gated_residual_reference(want["x"], want["residual"])
    assert torch.equal(case["x"], want["x"])


def test_empty_shapes_are_no_ops():
    for shape in ((0, 4, 8), (2, 0, 8), (2, 4, 0)):
        x = torch.ones(shape, dtype=BF16)
        out = adaln_(x, residual=torch.ones(shape), out=torch.zeros(shape))
        assert out.shape == shape and torch.equal(x, torch.ones(shape, dtype=BF16))


def test_traces_under_torch_compile():
    torch._dynamo.reset()

    def step(x, r, gate, shift, scale):
        h = adaln_(x, residual=r, gate=gate, shift=shift, scale=scale)
        gated_residual_(x, h, gate)
        return h.float().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    make = lambda: adaln_case(CPU, S=6, N=33, M=2, residual=True, gate=True, seed=9)  # noqa: E731
    got, want = make(), make()
    keys = ("x", "residual", "gate", "shift", "scale")
    a = compiled(*(got[k] for k in keys))
    b = step(*(want[k] for k in keys))
    assert torch.equal(got["x"], want["x"]) and torch.equal(a, b)


# --- validation ----------------------------------------------------------------------


def _bad_cases():
    """(name, change to a valid call's kwargs, message start)."""
    x_like = lambda **kw: torch.zeros(2, 6, 7, **kw)  # noqa: E731
    wide = torch.zeros(2, 6, 14)
    return [
        ("x not a tensor", dict(x=[1.0]), "x: expected a torch.Tensor"),
        ("x 2-D", dict(x=torch.zeros(6, 7)), "x: expected 3 dimensions"),
        ("x fp16", dict(x=x_like(dtype=torch.float16)), "x must have dtype bfloat16 or float32"),
        ("x strided N", dict(x=wide[:, :, ::2]), "x: expected a contiguous last dimension"),
        ("x broadcast, written", dict(x=torch.zeros(2, 1, 7).expand(2, 6, 7), residual=x_like()),
         "x: expected no zero strides"),
        ("out shape", dict(out=torch.zeros(2, 6, 8)), r"out: expected shape \(2, 6, 7\)"),
        ("out fp16", dict(out=x_like(dtype=torch.float16)), "out must have dtype"),
        ("out device", dict(out=x_like(device=META)), "out: expected device cpu"),
        ("out is x", "out_is_x", "out: expected memory apart from x"),
        ("out overlaps shift", "out_overlaps_shift", "out: expected memory apart from shift"),
        ("residual shape", dict(residual=torch.zeros(2, 5, 7)), "residual: expected shape"),
        ("residual fp16", dict(residual=x_like(dtype=torch.float16)), "residual must have"),
        ("residual device", dict(residual=x_like(device=META)), "residual: expected device"),
        ("x overlaps residual", "x_overlaps_residual", "x: expected memory apart from residual"),
        ("gate without residual", dict(residual=None), "residual: expected a"),
        ("gate M", dict(gate=torch.zeros(2, 4, 7), residual=x_like()),
         r"gate: expected shape \[2, M, 7\] with M dividing S = 6"),
        ("shift B", dict(shift=torch.zeros(1, 1, 7)), r"shift: expected shape \[2, M, 7\]"),
        ("shift M = 0", dict(shift=torch.zeros(2, 0, 7)), "shift: expected shape"),
        ("scale N", dict(scale=torch.zeros(2, 1, 6)), "scale: expected shape"),
        ("scale 2-D", dict(scale=torch.zeros(2, 7)), "scale: expected 3 dimensions"),
        ("scale strided N", dict(scale=torch.zeros(2, 1, 14)[:, :, ::2]),
         "scale: expected a contig"),
        ("scale fp16", dict(scale=torch.zeros(2, 1, 7, dtype=torch.float16)), "scale must have"),
        ("shift device", dict(shift=torch.zeros(2, 1, 7, device=META)),
         "shift: expected device cpu"),
        ("weight N", dict(weight=torch.ones(8)), r"weight: expected shape \[7\]"),
        ("weight 2-D", dict(weight=torch.ones(1, 7)), "weight: expected 1 dimensions"),
        ("bias fp16", dict(bias=torch.ones(7, dtype=torch.float16)), "bias must have"),
        ("bias device", dict(bias=torch.ones(7, device=META)), "bias: expected device cpu"),
        ("eps negative", dict(eps=-1e-6), "eps: expected a finite number"),
        ("eps nan", dict(eps=float("nan")), "eps: expected a finite number"),
        ("eps bool", dict(eps=True), "eps: expected a finite number"),
    ]


BAD = _bad_cases()


@pytest.mark.parametrize("change,match", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_arguments_are_refused_and_change_nothing(change, match):
    kw = adaln_case(CPU, residual=True, gate=True, out_dtype=FP32, seed=10)
    if change == "out_is_x":
        kw.update(out=kw["x"], residual=None, gate=None)
    elif change == "out_overlaps_shift":
        kw["out"] = torch.zeros(2 * 6 * 7 + 7)[:84].view(2, 6, 7)
        kw["shift"] = kw["out"][:, :1]
    elif change == "x_overlaps_residual":
        kw["residual"] = kw["x"]
    else:
        kw.update(change)
    before = {k: v.clone() for k, v in kw.items()
              if isinstance(v, torch.Tensor) and v.device != META}
    with pytest.raises(ValueError, match="^" + match):
        adaln_(**kw)
    for k, v in before.items():
        assert same_bits(kw[k], v), k


def test_rows_wider_than_a_cta_holds_are_refused():
    from framekv.ops.adaln import MAX_N

    wide = torch.zeros(1, 2, MAX_N + 4)
    with pytest.raises(ValueError, match=f"^x: expected N <= {MAX_N} .* got N = {MAX_N + 4}"):
        adaln_(wide)
    with pytest.raises(ValueError, match=f"^x: expected N <= {MAX_N}"):
        gated_residual_(wide, wide.clone())
    adaln_(torch.zeros(1, 2, MAX_N))  # the widest row is taken


def test_gated_residual_refuses_bad_arguments():
    x, y = torch.zeros(2, 6, 7, dtype=BF16), torch.ones(2, 6, 7)
    cases = [((x, y[:, :5]), "y: expected shape"),
             ((x, y, torch.ones(2, 4, 7)), "gate: expected shape"),
             ((x, y, torch.ones(2, 2, 7, device=META)), "gate: expected device cpu"),
             ((torch.zeros(2, 1, 7).expand(2, 6, 7), y), "x: expected no zero strides"),
             ((x, y.half()), "y must have dtype"), ((x, x), "x: expected memory apart from y")]
    for args, match in cases:
        with pytest.raises(ValueError, match="^" + match):
            gated_residual_(*args)
        assert x.eq(0).all()


def test_vector_aligned_says_when_four_consecutive_values_move_as_one():
    from framekv.ops._float import vector_aligned

    x = torch.zeros(2, 3, 16, dtype=torch.bfloat16)
    assert vector_aligned(x) and vector_aligned(x[:, 1:]) and vector_aligned(x[..., 4:12])
    assert not vector_aligned(x[..., 1:13])             # the address is one value off
    assert not vector_aligned(x[..., :6])               # a row of 6: no groups of 4
    assert not vector_aligned(x[..., ::2])              # the values are not consecutive
    assert not vector_aligned(torch.zeros(3, 6)[:, :4])  # rows 6 values apart
    assert vector_aligned(torch.zeros(8).expand(3, 8))  # stride 0: every row the same
