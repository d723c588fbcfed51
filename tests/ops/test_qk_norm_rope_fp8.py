"""CPU tests of ``qk_norm_rope_stage_`` with fp8 e4m3 pools and the fp8 Q output: the
torch reference against an independent quantizer (numpy: the nearest of the 254
finite e4m3 values, ties to the even code, on fp32 values from the unfused model
path), the statistics (amax per head over exactly the staged entries, saturation counts
with large values and inf, NaN neither counted nor in amax), and every validation error
of the new arguments (a refused call writes nothing). Also the fp8 case builder and
the comparisons shared by the simulator and GPU tests.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from framekv.ops import _float
from framekv.ops.qk_norm_rope import qk_norm_rope_stage_, qk_norm_rope_stage_reference
from numba import cuda
from test_qk_norm_rope import _bits, entry_writes, model_path, qk_case

CPU = torch.device("cpu")
FP8 = torch.float8_e4m3fn
MAX = 448.0


@cuda.jit
def store_kernel(x, out1, out4, back):
    """x's fp32 values stored one at a time into out1 and four at a time into out4
    (e4m3 bits: the hardware's or the simulator's conversion), out1 read back into back."""
    for j in range(cuda.grid(1) * 4, x.shape[0], cuda.gridsize(1) * 4):
        v = _float.load_f32x4(x, (j,))
        _float.store_f32x4(out4, (j,), v)
        for k in range(4):
            _float.store_f32(out1, (j + k,), v[k])
            _float.store_f32(back, (j + k,), _float.load_f32(out1, (j + k,)))


# --- case builder and comparisons (shared) ------------------------------------------------

def fp8_case(device, dtype, *, fp8_pools=True, q_out=False, q_strided=False, seed=0, **kw):
    """``qk_case`` arguments (a dict; staging with fp8_pools) plus the fp8 ones: pools of
    random e4m3 bytes, scales per head in [0.25, 4], amax rows already holding a value
    (head 0 a large one, which the call must keep), counters already counting. q_out:
    a q_out (q_strided: a view into a wider tensor). Deterministic in ``seed``."""
    staging = kw.pop("staging", False) or fp8_pools
    args, _ = qk_case(device, dtype, staging=staging, seed=seed, **kw)
    g = torch.Generator().manual_seed(seed + 1000)
    B, S, _, D = args["qkv"].shape
    H, Hkv = args["num_heads"], args["num_kv_heads"]
    if fp8_pools:
        for name in ("k_pool", "v_pool"):
            args[name] = (torch.randn(args[name].shape, generator=g) * 4).to(FP8).to(device)
        args["kv_scale"] = (2.0 ** (torch.rand(2, Hkv, generator=g) * 4 - 2)).to(device)
        amax = torch.rand(2, Hkv, generator=g) * 0.01
        amax[:, 0] = 1e6
        args["kv_amax"] = amax.to(device)
        args["saturated"] = torch.tensor([3, 5], device=device)
    if q_out:  # the T real tokens only
        T = args.get("tokens") or S
        wide = torch.zeros(B, T + 1, H + 2, D + 8, dtype=torch.uint8, device=device)
        view = wide[:, 1:, 1:H + 1, 4:D + 4] if q_strided else wide[:, :T, :H, :D].clone()
        args["q_out"] = view.view(FP8)
        args["q_scale"] = (2.0 ** (torch.rand(H, generator=g) * 4 - 2)).to(device)
        args["q_saturated"] = torch.tensor([7], device=device)
    return args


def clone_case(args):
    """A deep copy of the tensors of a case (views stay views of their own copies only
    where the case has one base: q_out is cloned as a view of the same layout)."""
    out = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    if args.get("q_out") is not None:
        q = args["q_out"]
        base = torch.empty_strided(q.shape, q.stride(), dtype=FP8, device=q.device)
        base.view(torch.uint8).copy_(q.view(torch.uint8))
        out["q_out"] = base
    return out


def u8(t):
    return t.view(torch.uint8)


def e4m3_table():
    """fp32 values of the 256 e4m3 bytes (0x7F and 0xFF are NaN)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()


def nearest_e4m3(y: np.ndarray) -> np.ndarray:
    """Independent quantizer: the byte of the nearest finite e4m3 value to each
    clamped fp32 ``y`` (ties to the even code), NaN -> 0x7F. numpy, no torch cast."""
    table = e4m3_table().numpy().astype(np.float64)
    codes = np.array([c for c in range(256) if np.isfinite(table[c])])
    vals = table[codes]
    with np.errstate(invalid="ignore"):  # a signalling NaN's widening
        y = np.asarray(y, dtype=np.float64).reshape(-1)
    out = np.full(y.shape, 0x7F, dtype=np.uint8)
    for i, v in enumerate(y):
        if np.isnan(v):
            continue
        v = min(max(v, -MAX), MAX)
        d = np.abs(vals - v)
        best = codes[d == d.min()]
        if len(best) > 1:  # a tie (or +-0): the even mantissa, the sign of v
            best = [c for c in best if c % 2 == 0 and (c >= 128) == (np.signbit(v))] or best
        out[i] = best[0]
    return out


def near_tie(y: torch.Tensor, rel=1e-5, atol=None) -> torch.Tensor:
    """Where fp32 ``y`` lies within ``rel * |y|`` (plus ``atol``, a tensor like y, where
    given) of the midpoint between two e4m3 values (where fp32 values that differ in
    their last bits may round to different bytes)."""
    t = e4m3_table()
    pos = torch.sort(t[torch.isfinite(t) & (t >= 0)]).values.double()
    mids = ((pos[1:] + pos[:-1]) / 2).to(y.device)
    a = y.double().abs().clamp(max=MAX).reshape(-1)
    i = torch.searchsorted(mids, a)
    lo, hi = mids[(i - 1).clamp(min=0)], mids[i.clamp(max=mids.numel() - 1)]
    d = torch.minimum((a - lo).abs(), (a - hi).abs())
    extra = 0.0 if atol is None else atol.double().reshape(-1)
    return (d <= rel * a + extra + 1e-12).reshape(y.shape)


def assert_bytes_close(got, want, y, what, atol=None):
    """fp8 bytes equal, except where the fp32 value ``y = x / s`` behind them is at a
    tie (`near_tie`; NaN in y: no value behind, the bytes must be equal)."""
    bad = u8(got) != u8(want)
    assert not (bad & ~near_tie(y, atol=atol)).any(), f"{what}: {int(bad.sum())} bytes differ"


def rope_pair_tolerance(y: torch.Tensor, rope, style: str) -> torch.Tensor | None:
    """How far two fp32 computations of rotated ``y`` [..., D] may lie apart beyond
    their rounding of ``y`` itself: a rope angle of magnitude a is known to within an
    fp32 ulp of a (the kernel forms it in fp32, the reference in fp64), which moves
    each value by up to that angle error times the norm of its pair. None without rope."""
    if rope is None:
        return None
    gh, gw = rope.grid
    position = float(rope.frame0.max()) + (y.shape[-3] + rope.token_offset) // (gh * gw)
    angle = (position + 2 + max(gh, gw)) * float(rope.inv_freq.max())
    x0, x1 = (y[..., 0::2], y[..., 1::2]) if style == "interleaved" else y.chunk(2, dim=-1)
    pair = torch.sqrt(x0.double() ** 2 + x1.double() ** 2)
    pair = torch.stack([pair, pair], -1).flatten(-2) if style == "interleaved" else \
        torch.cat([pair, pair], -1)
    return pair * (4 * torch.finfo(torch.float32).eps * angle)


def staged_entries(args):
    """[(entry, row)] of the staged entries (a row in range, a slot >= 0), once each."""
    seen = {}
    for e, r, _ in entry_writes(args):
        seen[e] = r
    return sorted(seen.items())


def e4m3_probe_values() -> torch.Tensor:
    """fp32 values where an e4m3 rounding can go wrong: every finite e4m3 value, the
    midpoints between neighbours (ties) and the fp32 values next to them, subnormals and
    their ties, fp32 denormals, +-0, values past 448 (up to inf), NaNs of both signs,
    and random values over many scales; both signs of each."""
    t = e4m3_table()
    pos = torch.sort(t[torch.isfinite(t) & (t >= 0)].unique()).values
    mids = (pos[1:] + pos[:-1]) / 2  # at most 5 significant bits: exact in fp32
    inf = torch.tensor(float("inf"))
    near = torch.cat([torch.nextafter(mids, inf), torch.nextafter(mids, -inf)])
    extra = torch.tensor([0.0, 2.0 ** -10, 2.0 ** -11, 3 * 2.0 ** -11, 2.0 ** -126, 1e-45,
                          1e-40, 448.0, 448.00003, 449.0, 464.0, 464.00003, 479.9, 480.0,
                          500.0, 1e4, 3e38, float("inf")])
    g = torch.Generator().manual_seed(0)
    rand = torch.randn(2000, generator=g) * 2.0 ** torch.randint(-14, 12, (2000,), generator=g)
    x = torch.cat([pos, mids, near, extra, rand])
    nans = torch.tensor([float("nan")]).repeat(3)
    nans[1:2] = -nans[1:2]
    nans[2:].view(torch.int32).copy_(torch.tensor([0x7F800001]))  # a signalling payload
    return torch.cat([x, -x, nans])


def torch_e4m3_bytes(x: torch.Tensor) -> torch.Tensor:
    """torch's e4m3 bytes of fp32 ``x`` clamped to +-448, every NaN as 0x7F."""
    y = torch.where(torch.isnan(x), float("nan"), x.clamp(-MAX, MAX))
    return u8(y.to(FP8))


def test_independent_quantizer_is_torch_on_the_probe_values():
    x = e4m3_probe_values()
    assert torch.equal(torch.from_numpy(nearest_e4m3(x.numpy())), torch_e4m3_bytes(x))


# --- the reference against the independent quantizer -----------------------------------

def _expected(args, k32, q32, before):
    """Independent fp8 pools, q_out bytes, amax and counts from fp32 K and Q [B, S, h, D]
    (the unfused path's) and the raw qkv ``before``."""
    H, Hkv = args["num_heads"], args["num_kv_heads"]
    B, S, _, D = before.shape
    T = args.get("tokens") or S
    k_rows = k32[:, :T].reshape(B * T, Hkv, D)
    v_rows = before[:, :T, H + Hkv:].float().reshape(B * T, Hkv, D)
    inv = torch.reciprocal(args["kv_scale"])
    want = {"k_pool": u8(args["k_pool"]).clone(), "v_pool": u8(args["v_pool"]).clone(),
            "kv_amax": args["kv_amax"].clone(), "saturated": args["saturated"].clone(),
            "k_y": torch.full(args["k_pool"].shape, float("nan"))}
    for kv, (rows, pool) in enumerate(((k_rows, "k_pool"), (v_rows, "v_pool"))):
        y = rows * inv[kv][:, None]
        for e, r in staged_entries(args):
            mag = rows[r].abs().nan_to_num(nan=0.0, posinf=float("inf"))
            want["kv_amax"][kv] = torch.maximum(want["kv_amax"][kv], mag.amax(-1))
            want["saturated"][kv] += int((y[r].abs() > MAX).sum())
        for _, r, slot in entry_writes(args):
            want[pool][slot] = torch.from_numpy(nearest_e4m3(y[r].numpy())).view(Hkv, D)
            if kv == 0:
                want["k_y"][slot] = y[r]
    if args.get("q_out") is not None:
        yq = q32[:, :T] * torch.reciprocal(args["q_scale"])[:, None]  # padding rows: not
        want["q_out"] = torch.from_numpy(nearest_e4m3(yq.numpy())).view(B, T, H, D)
        want["q_y"] = yq
        want["q_saturated"] = args["q_saturated"] + int((yq.abs() > MAX).sum())
    return want


CASES = [  # (B, S, H, Hkv, D, tokens, dst2, src_rows, dtype)
    (1, 7, 2, 2, 8, None, False, False, torch.float32),
    (2, 9, 4, 2, 12, 6, True, False, torch.bfloat16),
    (3, 5, 3, 1, 8, 4, True, True, torch.float32),
    (2, 6, 6, 3, 128, None, False, True, torch.bfloat16),
]


@pytest.mark.parametrize("B,S,H,Hkv,D,tokens,dst2,src_rows,dtype", CASES)
def test_reference_is_the_independent_quantizer(B, S, H, Hkv, D, tokens, dst2, src_rows,
                                                dtype):
    args = fp8_case(CPU, dtype, B=B, S=S, H=H, Hkv=Hkv, D=D, tokens=tokens, dst2=dst2,
                    src_rows=src_rows, q_out=True, q_strided=B == 2, seed=S + D)
    b, t = divmod(staged_entries(args)[0][1], tokens or S)
    args["qkv"][b, t, H + Hkv:] *= 2000  # V of a staged row beyond 448 * s
    before = args["qkv"].clone()
    with torch.no_grad():
        q32, k32 = model_path(before, args["q_weight"], args["k_weight"], H, Hkv,
                              args["rope"])
    want = _expected(args, k32, q32, before)
    qk_norm_rope_stage_(**args)
    assert torch.equal(u8(args["v_pool"]), want["v_pool"])
    # K and Q: fp32 values of two computations, equal bytes but at e4m3 ties
    assert_bytes_close(args["k_pool"], want["k_pool"], want["k_y"], "k_pool")
    assert torch.allclose(args["kv_amax"], want["kv_amax"], rtol=1e-5)
    assert args["kv_amax"][:, 0].eq(1e6).all()  # a larger running max stays
    assert torch.equal(args["saturated"], want["saturated"])
    assert args["saturated"][1] > 5  # the large V values were counted
    assert_bytes_close(args["q_out"], want["q_out"], want["q_y"], "q_out")
    assert torch.equal(args["q_saturated"], want["q_saturated"])
    assert torch.equal(args["qkv"][:, :, H:], before[:, :, H:])  # K and V raw in qkv


def test_q_in_place_is_unchanged_by_q_out():
    kw = dict(B=2, S=5, H=3, Hkv=1, D=8, seed=4)
    a = fp8_case(CPU, torch.bfloat16, q_out=True, **kw)
    b = fp8_case(CPU, torch.bfloat16, **kw)
    qk_norm_rope_stage_(**a)
    qk_norm_rope_stage_(**b)
    assert torch.equal(a["qkv"], b["qkv"])
    for name in ("k_pool", "v_pool"):
        assert torch.equal(u8(a[name]), u8(b[name]))


def test_q_out_without_pools():
    args = fp8_case(CPU, torch.float32, fp8_pools=False, q_out=True, B=1, S=4, H=2, Hkv=1,
                    D=8, seed=2)
    before = args["qkv"].clone()
    qk_norm_rope_stage_(**args)
    q32 = args["qkv"][:, :, :2]  # fp32 qkv: the in-place Q is the fp32 value
    want = nearest_e4m3((q32 * torch.reciprocal(args["q_scale"])[:, None]).numpy())
    assert torch.equal(u8(args["q_out"]).reshape(-1), torch.from_numpy(want))
    assert not torch.equal(args["qkv"][:, :, 2:3], before[:, :, 2:3])  # K normed in place


# --- statistics -----------------------------------------------------------------------------

def _stats_case(dtype=torch.float32, **kw):
    base = dict(B=2, S=4, H=2, Hkv=2, D=8, dst2=True, src_rows=True, tokens=3, seed=5)
    base.update(kw)
    return fp8_case(CPU, dtype, **base)


def test_saturation_counts_large_values_and_inf_not_nan():
    args = _stats_case()
    args["kv_scale"].fill_(1.0)
    args["saturated"].zero_()
    args["dst"].fill_(-1)
    args["dst2"].fill_(-1)
    args["src_rows"].copy_(torch.arange(args["src_rows"].shape[0]) % 6)
    args["dst"][0], args["src_rows"][0] = 0, 0  # entry 0: row 0 (b 0, token 0), to slot 0
    args["dst2"][1], args["src_rows"][1] = 1, 4  # entry 1: row 4 (b 1, token 1), slot 1
    H, Hkv = 2, 2
    v = args["qkv"][:, :, H + Hkv:]
    v.clamp_(-1, 1)
    v[0, 0, 0, :4] = torch.tensor([449.0, -1e9, float("inf"), float("nan")])
    v[0, 0, 1, 0] = -float("inf")
    v[1, 1, 0, 0] = 448.0  # not above 448: not counted
    v[1, 1, 0, 1] = -448.01
    v[1, 2, 0, 0] = 1e9  # row 5: no staged entry
    qk_norm_rope_stage_(**args)
    assert args["saturated"].tolist() == [0, 5]
    assert args["kv_amax"][1, 0] == float("inf")
    vb = u8(args["v_pool"])
    assert vb[0, 0, :4].tolist() == [0x7E, 0xFE, 0x7E, 0x7F]  # +-448 saturated, NaN
    assert vb[0, 1, 0] == 0xFE


def test_amax_is_over_the_staged_entries_only():
    args = _stats_case()
    H, Hkv = 2, 2
    args["kv_amax"].zero_()
    rows = args["src_rows"]
    rows.copy_(torch.tensor([0, 1, -1, 6, 2, 5, 4, 3, 0])[:rows.shape[0]])
    args["dst"][3:] = -1
    args["dst2"][3:] = -1  # entries 3 .. : skipped, whatever their rows
    v = args["qkv"][:, :, H + Hkv:]
    v.clamp_(-1, 1)
    v[1, 0] = 300.0      # row 3 (b 1, token 0): only skipped entries
    v[1, 2] = 500.0      # row 5: skipped entries only
    v[0, 3] = 900.0      # token 3 >= tokens: never a row
    v[0, 1, 1, 2] = -7.5  # row 1, head 1: staged
    before = args["qkv"].clone()
    staged_rows = sorted({r for _, r in staged_entries(args)})
    assert 3 not in staged_rows and 5 not in staged_rows and 1 in staged_rows
    qk_norm_rope_stage_(**args)
    vrows = before[:, :3, H + Hkv:].reshape(6, Hkv, 8)[staged_rows]
    assert torch.equal(args["kv_amax"][1], vrows.abs().amax(dim=(0, 2)))
    assert args["kv_amax"][1, 1] == 7.5
    with torch.no_grad():
        _, k32 = model_path(before, args["q_weight"], args["k_weight"], H, Hkv, args["rope"])
    krows = k32[:, :3].reshape(6, Hkv, 8)[staged_rows]
    assert torch.allclose(args["kv_amax"][0], krows.abs().amax(dim=(0, 2)), rtol=1e-6)


def test_nan_is_stored_as_0x7f_and_counted_nowhere():
    args = _stats_case(B=1, S=3, tokens=None, src_rows=False, dst2=False, q_out=True)
    H, Hkv = 2, 2
    args["dst"].copy_(torch.arange(3))
    args["kv_amax"].zero_()
    args["saturated"].zero_()
    args["qkv"][0, 0, H + Hkv:] = -float("nan")  # V of row 0, both heads: a negative NaN
    args["qkv"][0, 1, H] = float("nan")           # K of row 1, head 0: NaN after the norm
    args["qkv"][0, 2, 0] = float("nan")           # Q of token 2, head 0
    qk_norm_rope_stage_(**args)
    assert (u8(args["v_pool"])[0] == 0x7F).all()
    assert (u8(args["k_pool"])[1, 0] == 0x7F).all()
    assert (u8(args["q_out"])[0, 2, 0] == 0x7F).all()
    assert args["saturated"].tolist() == [0, 0] and args["q_saturated"].item() == 7
    assert torch.isfinite(args["kv_amax"]).all() and (args["kv_amax"] > 0).all()


def test_an_entry_counts_once_for_two_slots_and_each_entry_counts():
    """Two slots of one entry: counted once; two entries of one row: counted twice."""
    args = _stats_case(B=1, S=2, tokens=None)
    H, Hkv = 2, 2
    args["kv_scale"].fill_(1.0)
    args["saturated"].zero_()
    E = args["dst"].shape[0]
    args["src_rows"].copy_(torch.tensor([0, 1, 1, -1, 9])[:E])
    args["dst"].copy_(torch.tensor([0, 1, 2, 3, 4])[:E])
    args["dst2"].copy_(torch.tensor([5, -1, -1, 6, 7])[:E])
    args["qkv"][0, :, H + Hkv:].clamp_(-1, 1)
    args["qkv"][0, 0, H + Hkv, 0] = 1000.0  # row 0: one entry, two slots
    args["qkv"][0, 1, H + Hkv, 0] = 1000.0  # row 1: two entries
    qk_norm_rope_stage_(**args)
    assert args["saturated"][1].item() == 3


# --- the kernel against the reference (shared by the simulator and GPU tests) ----------------

def _twin(args):
    """Arguments of an fp32 in-place call on a copy of qkv (weights widened, no pools):
    its Q and K are the kernel's fp32 values before any rounding or quantization."""
    keep = ("q_weight", "k_weight", "num_heads", "num_kv_heads", "norm", "eps", "rope")
    twin = {k: args[k] for k in keep if k in args}
    twin.update(qkv=args["qkv"].float().clone(), q_weight=args["q_weight"].float(),
                k_weight=args["k_weight"].float())
    return twin


def _quantize_like_the_reference(want, q32, k32):
    """The reference's quantization (ops' own functions) of fp32 Q and K [B, S, h, D]
    into the case ``want`` (its qkv raw), in place."""
    from framekv.ops.qk_norm_rope import (
        _fp8_reference,
        _stage_fp8_reference,
        _stats_reference,
    )

    H, Hkv = want["num_heads"], want["num_kv_heads"]
    B, S, _, D = want["qkv"].shape
    T = want.get("tokens") or S
    if want.get("q_out") is not None:
        q_real = q32[:, :T]
        _stats_reference(q_real.reshape(B * T, H, D), want["q_scale"], None, want["q_saturated"])
        u8(want["q_out"]).copy_(u8(_fp8_reference(q_real, want["q_scale"])))
    if want.get("kv_scale") is not None:
        v = want["qkv"][:, :T, H + Hkv:].float().reshape(B * T, Hkv, D)
        _stage_fp8_reference(want["k_pool"], want["v_pool"], k32[:, :T].reshape(B * T, Hkv, D),
                             v, want["dst"], want.get("dst2"), want.get("src_rows"),
                             want["kv_scale"], want["kv_amax"], want["saturated"])


def compare_fp8_with_reference(device, dtype, prepare=None, **kw):
    """Build an fp8 case (``fp8_case`` arguments; ``prepare(args)`` edits it first), run
    the op (the kernel) on it and compare: bit for bit with the reference's quantization
    of the kernel's own fp32 Q and K (an fp32 twin call), and with the reference run on
    a copy (V, counts and the untouched bytes equal; K and Q bytes equal but at e4m3
    ties, where fp32 values of two computations may round apart). Returns the case."""
    got = fp8_case(device, dtype, **kw)
    if prepare is not None:
        prepare(got)
    ref, exact = clone_case(got), clone_case(got)
    twin = _twin(got)
    qk_norm_rope_stage_(**twin)
    H, Hkv = got["num_heads"], got["num_kv_heads"]
    _quantize_like_the_reference(exact, twin["qkv"][:, :, :H], twin["qkv"][:, :, H:H + Hkv])
    qk_norm_rope_stage_(**got)
    qk_norm_rope_stage_reference(**ref)
    _assert_equal_case(got, exact, ("k_pool", "v_pool", "q_out", "kv_amax", "saturated",
                                    "q_saturated"), "exact")
    _assert_equal_case(got, ref, ("v_pool", "saturated", "q_saturated"), "reference")
    # The ties are found on the twin's fp32 values (the reference's differ in ulps).
    q32, k32 = twin["qkv"][:, :, :H], twin["qkv"][:, :, H:H + Hkv]
    T = got.get("tokens") or got["qkv"].shape[1]
    rope = got.get("rope")
    style = rope.style if rope is not None else "interleaved"
    if got.get("kv_scale") is not None:
        assert torch.equal(got["kv_amax"][1], ref["kv_amax"][1])
        assert torch.allclose(got["kv_amax"][0], ref["kv_amax"][0], rtol=1e-5)
        rows = k32[:, :T].reshape(-1, Hkv, k32.shape[-1]) * \
            torch.reciprocal(got["kv_scale"][0])[:, None]
        y = torch.full(got["k_pool"].shape, float("nan"), device=device)
        for _, r, slot in entry_writes(got):
            y[slot] = rows[r]
        tol = rope_pair_tolerance(rows, rope, style)
        tol_y = None if tol is None else torch.zeros_like(y, dtype=torch.float64)
        for _, r, slot in entry_writes(got):
            if tol_y is not None:
                tol_y[slot] = tol[r]
        assert_bytes_close(got["k_pool"].cpu(), ref["k_pool"].cpu(), y.cpu(), "k_pool",
                           None if tol_y is None else tol_y.cpu())
    if got.get("q_out") is not None:
        y = q32[:, :T] * torch.reciprocal(got["q_scale"])[:, None]
        tol = rope_pair_tolerance(y, rope, style)
        assert_bytes_close(got["q_out"].cpu(), ref["q_out"].cpu(), y.cpu(), "q_out",
                           None if tol is None else tol.cpu())
    assert torch.equal(_bits(got["qkv"][:, :, H:]), _bits(ref["qkv"][:, :, H:]))  # raw K, V
    return got


def _assert_equal_case(got, want, names, what):
    for name in names:
        if got.get(name) is None:
            continue
        g, w = got[name], want[name]
        if g.dtype == FP8:
            g, w = u8(g), u8(w)
        assert torch.equal(g, w), f"{what}: {name} differs ({int((g != w).sum())} values)"


# --- custom op ---------------------------------------------------------------------------------

def test_custom_op_traces_with_fp8():
    a = fp8_case(CPU, torch.float32, B=1, S=5, H=2, Hkv=1, D=8, q_out=True, seed=2)
    b = clone_case(a)

    def step(qkv, k_pool, v_pool, kv_amax, saturated, q_out, q_saturated):
        qk_norm_rope_stage_(**dict(a, qkv=qkv, k_pool=k_pool, v_pool=v_pool, kv_amax=kv_amax,
                                   saturated=saturated, q_out=q_out, q_saturated=q_saturated))
        return qkv.sum()

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="aot_eager")(
        a["qkv"], a["k_pool"], a["v_pool"], a["kv_amax"], a["saturated"], a["q_out"],
        a["q_saturated"])
    qk_norm_rope_stage_(**b)
    for name in ("qkv", "kv_amax", "saturated", "q_saturated"):
        assert torch.equal(a[name], b[name]), name
    for name in ("k_pool", "v_pool", "q_out"):
        assert torch.equal(u8(a[name]), u8(b[name])), name


# --- validation ------------------------------------------------------------------------------

BAD = [  # (name, change to the arguments, message start)
    ("kv_scale missing", lambda a: dict(kv_scale=None),
     "kv_scale: expected a tensor (the pools are torch.float8_e4m3fn), got None"),
    ("kv_amax missing", lambda a: dict(kv_amax=None), "kv_amax: expected a tensor"),
    ("saturated missing", lambda a: dict(saturated=None), "saturated: expected a tensor"),
    ("kv_scale with bf16 pools", lambda a: dict(k_pool=a["k_pool"].float(),
                                                v_pool=a["v_pool"].float()),
     "kv_scale: expected None (the pools are not torch.float8_e4m3fn), got a Tensor"),
    ("kv_amax without pools", lambda a: dict(k_pool=None, v_pool=None, dst=None, dst2=None,
                                             src_rows=None, kv_scale=None),
     "kv_amax: expected None"),
    ("kv_scale dtype", lambda a: dict(kv_scale=a["kv_scale"].double()),
     "kv_scale: expected dtype torch.float32, got torch.float64"),
    ("kv_scale shape", lambda a: dict(kv_scale=a["kv_scale"][:, :1]),
     "kv_scale: expected shape [2, 2] (K and V, num_kv_heads), got [2, 1]"),
    ("kv_scale rank", lambda a: dict(kv_scale=a["kv_scale"][0]),
     "kv_scale: expected 2 dimensions"),
    ("kv_scale type", lambda a: dict(kv_scale=[1.0, 1.0]), "kv_scale: expected a torch.Tensor"),
    ("kv_amax dtype", lambda a: dict(kv_amax=a["kv_amax"].bfloat16()),
     "kv_amax: expected dtype torch.float32, got torch.bfloat16"),
    ("kv_amax shape", lambda a: dict(kv_amax=a["kv_amax"][:, :1]),
     "kv_amax: expected shape [2, 2] (K and V, num_kv_heads), got [2, 1]"),
    ("kv_amax overlap", lambda a: dict(kv_amax=a["kv_amax"][:1].expand(2, 2)),
     "kv_amax: expected no zero strides"),
    ("saturated dtype", lambda a: dict(saturated=a["saturated"].int()),
     "saturated: expected dtype torch.int64, got torch.int32"),
    ("saturated shape", lambda a: dict(saturated=a["saturated"][:1]),
     "saturated: expected shape [2] (K and V), got [1]"),
    ("pool dtype fp16", lambda a: dict(k_pool=a["k_pool"].half(), v_pool=a["v_pool"].half()),
     ("k_pool: expected dtype torch.float32 (the dtype of qkv) or torch.float8_e4m3fn, "
      "got torch.float16")),
    ("v_pool not fp8", lambda a: dict(v_pool=a["v_pool"].float()), "v_pool: expected dtype"),
    ("q_out alone", lambda a: dict(q_scale=None, q_saturated=None),
     "q_scale: expected a tensor (q_out, q_scale, q_saturated go together; given: q_out)"),
    ("q_saturated missing", lambda a: dict(q_saturated=None), "q_saturated: expected a tensor"),
    ("q_scale alone", lambda a: dict(q_out=None, q_saturated=None),
     "q_out: expected a tensor"),
    ("q_out dtype", lambda a: dict(q_out=a["q_out"].float()),
     "q_out: expected dtype torch.float8_e4m3fn, got torch.float32"),
    ("q_out shape", lambda a: dict(q_out=a["q_out"][:, :, :1]),
     "q_out: expected shape [2, 4, 2, 8] (B of qkv, the tokens, num_heads, D), got [2, 4, 1, 8]"),
    ("q_out over the padding", lambda a: dict(q_out=torch.zeros(2, 5, 2, 8).to(FP8)),
     "q_out: expected shape [2, 4, 2, 8]"),
    ("q_out rank", lambda a: dict(q_out=a["q_out"][0]), "q_out: expected 4 dimensions"),
    ("q_out strides", lambda a: dict(q_out=u8(a["q_out"]).transpose(2, 3).contiguous()
                                     .transpose(2, 3).view(FP8)),
     "q_out: expected a contiguous last dimension"),
    ("q_out overlap", lambda a: dict(q_out=a["q_out"][:1].expand(2, -1, -1, -1)),
     "q_out: expected no zero strides"),
    ("q_scale dtype", lambda a: dict(q_scale=a["q_scale"].half()),
     "q_scale: expected dtype torch.float32, got torch.float16"),
    ("q_scale shape", lambda a: dict(q_scale=a["q_scale"][:1]),
     "q_scale: expected shape [2] (num_heads), got [1]"),
    ("q_saturated dtype", lambda a: dict(q_saturated=a["q_saturated"].float()),
     "q_saturated: expected dtype torch.int64"),
    ("q_saturated shape", lambda a: dict(q_saturated=a["q_saturated"].view(1, 1)),
     "q_saturated: expected 1 dimensions"),
]


def _bad_case():
    return fp8_case(CPU, torch.float32, B=2, S=5, H=2, Hkv=2, D=8, dst2=True, src_rows=True,
                    tokens=4, q_out=True, seed=11)


@pytest.mark.parametrize("name,change,message", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_refused_and_change_nothing(name, change, message):
    args = _bad_case()
    args.update(change(args))
    snapshot = {k: u8(v).clone() if v.dtype == FP8 else v.clone()
                for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError) as info:
        qk_norm_rope_stage_(**args)
    assert str(info.value).startswith(message), str(info.value)
    assert "got" in str(info.value)
    for k, v in snapshot.items():
        assert torch.equal(u8(args[k]) if args[k].dtype == FP8 else args[k], v), k


def test_device_mismatch_is_refused():
    args = _bad_case()
    args["kv_scale"] = args["kv_scale"].to("meta")
    with pytest.raises(ValueError, match=r"^kv_scale: expected device cpu \(the device of "
                                         r"qkv\), got meta"):
        qk_norm_rope_stage_(**args)
