"""CPU tests of ``qk_norm_rope_stage_``: the torch reference against independent
compositions of the unfused paths (the reference model's `RMSNorm` / `apply_rope` /
`Rope3D`, Wan's all-heads RMSNorm with the same rope, a rotate-half formula), the
staging into pool slots, strided packed tensors, the custom op and every validation
error (a refused call writes nothing). Also the case builder shared by
the simulator and GPU tests.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from framekv.engine.model.blocks import RMSNorm, Rope3D, apply_rope
from framekv.ops.qk_norm_rope import RopeGrid, qk_norm_rope_stage_, qk_norm_rope_stage_reference

CPU = torch.device("cpu")
EPS = 1e-6


# --- case builder (shared) ---------------------------------------------------------------

def rope3d_grid(D, grid, frame0, offset=0, style="interleaved"):
    """A RopeGrid with the reference model's frequencies (`Rope3D`'s)."""
    r3 = Rope3D(D, grid, frame0.device)
    return RopeGrid(torch.cat(r3.inv_freq), tuple(d // 2 for d in r3.dims), tuple(grid),
                    frame0, style, offset)


def qk_case(device, dtype, *, B, S, H, Hkv, D, norm="head", style="interleaved", rope=True,
            grid=(3, 5), offset=0, frame_hi=40, staging=False, dst2=False, src_rows=False,
            tokens=None, strided=False, seed=0):
    """Arguments of ``qk_norm_rope_stage_`` (a dict) and the tensor qkv is a view of.

    Deterministic in ``seed``: build twice for the op and for its reference. strided:
    qkv is a slice of a bigger tensor (token, head strides padded, start offset).
    staging: pools of random values, slot lists with -1 entries (and, with src_rows,
    rows outside [0, B*tokens) and more entries than rows)."""
    g = torch.Generator().manual_seed(seed)
    heads = H + 2 * Hkv
    big = torch.randn(B, S + 3, heads + 2, D + 6, generator=g) * 2 + 0.3
    big = big.to(device, dtype)
    qkv = big[:, 2:S + 2, 1:heads + 1, 3:D + 3] if strided else big[:, :S, :heads, :D].clone()
    base = big if strided else qkv
    nq, nk = (D, D) if norm == "head" else (H * D, Hkv * D)
    wdt = dtype if dtype != torch.float16 else torch.float32
    args = dict(qkv=qkv, q_weight=(torch.randn(nq, generator=g) * 0.5 + 1).to(device, wdt),
                k_weight=(torch.randn(nk, generator=g) * 0.5 + 1).to(device, wdt),
                num_heads=H, num_kv_heads=Hkv, norm=norm, eps=EPS)
    if rope:
        frame0 = torch.randint(0, frame_hi, (B,), generator=g).to(device)
        args["rope"] = rope3d_grid(D, grid, frame0, offset, style)
    if staging:
        T = S if tokens is None else tokens
        E = B * T + 3 if src_rows else B * T
        slots = 2 * E + 5
        args["k_pool"] = (torch.randn(slots, Hkv, D, generator=g) * 3).to(device, dtype)
        args["v_pool"] = (torch.randn(slots, Hkv, D, generator=g) * 3).to(device, dtype)
        perm = torch.randperm(slots, generator=g)
        args["dst"] = torch.where(torch.arange(E) % 4 == 1, -1, perm[:E]).to(device)
        if dst2:
            args["dst2"] = torch.where(torch.arange(E) % 3 == 0, -1, perm[E:2 * E]).to(device)
        if src_rows:
            rows = torch.randint(0, B * T, (E,), generator=g)
            rows[2::4], rows[3::5] = -1, B * T  # rows outside [0, B*T) skip the entry
            args["src_rows"] = rows.to(device)
        args["tokens"] = tokens
    return args, base


def entry_writes(args):
    """[(entry, row, slot)] the staging writes, from the lists as documented."""
    B, S = args["qkv"].shape[:2]
    T = args.get("tokens") or S
    dst = args["dst"].tolist()
    rows = args["src_rows"].tolist() if args.get("src_rows") is not None else range(len(dst))
    lists = [dst] + ([args["dst2"].tolist()] if args.get("dst2") is not None else [])
    return [(e, r, lst[e]) for e, r in enumerate(rows) if 0 <= r < B * T
            for lst in lists if lst[e] >= 0]


def assert_matches(got, want, dtype, what):
    """fp32: within 1e-5; bf16: within one bf16 rounding of the reference's value."""
    g, w = got.float(), want.float()
    if dtype == torch.float32:
        tol = torch.full_like(w, 1e-5)
    else:
        tol = w.abs() * 2.0 ** -7 + 1e-5
    bad = (g - w).abs() > tol
    assert not bad.any(), f"{what}: {int(bad.sum())} values off, worst " \
                          f"{(g - w).abs().max().item()}"
    assert torch.isfinite(g).all()


def _bits(t):
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def compare_with_reference(device, dtype, **kw):
    """Build the case twice (``qk_case`` arguments), run the op on one and the reference
    on the other, compare everything; returns the op's arguments."""
    got, got_base = qk_case(device, dtype, **kw)
    want, want_base = qk_case(device, dtype, **kw)
    qk_norm_rope_stage_(**got)
    qk_norm_rope_stage_reference(**want)
    H, Hkv = kw["H"], kw["Hkv"]
    assert_matches(got["qkv"][:, :, :H], want["qkv"][:, :, :H], dtype, "q")
    want["qkv"][:, :, :H] = got["qkv"][:, :, :H]
    if kw.get("staging"):
        written = torch.zeros(got["k_pool"].shape[0], dtype=torch.bool, device=device)
        written[[s for _, _, s in entry_writes(got)]] = True
        assert_matches(got["k_pool"][written], want["k_pool"][written], dtype, "k_pool")
        assert torch.equal(_bits(got["k_pool"][~written]), _bits(want["k_pool"][~written]))
        assert torch.equal(_bits(got["v_pool"]), _bits(want["v_pool"]))
    else:
        assert_matches(got["qkv"][:, :, H:H + Hkv], want["qkv"][:, :, H:H + Hkv], dtype, "k")
        want["qkv"][:, :, H:H + Hkv] = got["qkv"][:, :, H:H + Hkv]
    # The rest bit for bit: V, K too when staging, and all around a strided qkv.
    assert torch.equal(_bits(got_base), _bits(want_base))
    return got


# --- independent compositions ------------------------------------------------------------

def _angles(rope, B, S):
    """fp64 [B, S, D/2] angles through `Rope3D.angles` (whole frames, then a slice)."""
    gh, gw = rope.grid
    frames = -(-(rope.token_offset + S) // (gh * gw))
    D = 2 * rope.inv_freq.shape[0]
    ang = Rope3D(D, rope.grid, rope.frame0.device).angles(rope.frame0, frames)
    return ang[:, rope.token_offset:rope.token_offset + S]


def model_path(qkv, q_w, k_w, H, Hkv, rope):
    """The reference model's unfused path (`DiTBlock.qkv_packed`): per-head RMSNorm,
    interleaved rope. Returns fp32 (q, k)."""
    x = qkv.float()
    out = []
    for part, w in ((x[:, :, :H], q_w), (x[:, :, H:H + Hkv], k_w)):
        norm = RMSNorm(x.shape[-1], EPS)
        norm.weight.data.copy_(w.float())
        y = norm(part)
        if rope is not None:
            y = apply_rope(y, *Rope3D.cos_sin(_angles(rope, *x.shape[:2])))
        out.append(y)
    return out


def _wan_tables(rope, b, S):
    """Wan's cos / sin [1, S, 1, D/2] of sequence b through `Rope3D`'s torch-glue tables
    (the rope a Wan rollout runs: the stock table's angles, tested against diffusers'
    in test_wan.py): whole frames of the grid, then a slice."""
    D = 2 * rope.inv_freq.shape[0]
    gh, gw = rope.grid
    frames = -(-(rope.token_offset + S) // (gh * gw))
    r3 = Rope3D(D, (gh, gw), rope.frame0.device)
    cos, sin = Rope3D.cos_sin(r3.angles(rope.frame0[b:b + 1], frames))
    sl = slice(rope.token_offset, rope.token_offset + S)
    return cos[:, sl], sin[:, sl]


def wan_grid(D, grid, frame0, offset=0):
    """A RopeGrid with Wan's frequencies and axis split (`Rope3D.grid`)."""
    return Rope3D(D, tuple(grid), frame0.device).grid(frame0, offset)


def wan_path(qkv, q_w, k_w, H, Hkv, rope):
    """Wan's attention math: RMSNorm over all heads (torch.nn.RMSNorm, as diffusers'),
    then the torch glue's rope per sequence. Returns fp32 (q, k)."""
    B, S, _, D = qkv.shape
    x = qkv.float()
    out = []
    for part, w, n in ((x[:, :, :H], q_w, H), (x[:, :, H:H + Hkv], k_w, Hkv)):
        norm = torch.nn.RMSNorm(n * D, eps=EPS)
        norm.weight.data.copy_(w.float())
        y = norm(part.flatten(2)).unflatten(2, (n, D))
        if rope is not None:
            y = torch.cat([apply_rope(y[b:b + 1], *_wan_tables(rope, b, S)) for b in range(B)])
        out.append(y)
    return out


def half_path(qkv, q_w, k_w, H, Hkv, rope, norm):
    """Manual RMSNorm (per head or all heads) and rotate-half rope. fp32 (q, k)."""
    x = qkv.float()
    B, S, _, D = x.shape
    out = []
    for part, w, n in ((x[:, :, :H], q_w, H), (x[:, :, H:H + Hkv], k_w, Hkv)):
        if norm == "head":
            y = part / torch.sqrt((part * part).sum(-1, keepdim=True) / D + EPS) * w.float()
        else:
            ms = (part * part).sum((-1, -2), keepdim=True) / (n * D)
            y = part / torch.sqrt(ms + EPS) * w.float().view(n, D)
        ang = _angles(rope, B, S)[:, :, None]                                 # [B, S, 1, P]
        cos, sin = torch.cat([ang.cos()] * 2, -1).float(), torch.cat([ang.sin()] * 2, -1).float()
        y1, y2 = y.chunk(2, -1)
        out.append(y * cos + torch.cat([-y2, y1], -1) * sin)
    return out


def assert_close(got, want, what, tol=1e-5):
    d = (got.float() - want.float()).abs().max().item()
    assert d <= tol, f"{what}: max |diff| {d} > {tol}"


def _run_reference(args):
    qk_norm_rope_stage_reference(**args)
    return args


# --- the reference against the unfused paths -----------------------------------------

GEOMS = [  # (B, S, H, Hkv, D, grid, offset)
    (1, 7, 2, 2, 8, (3, 5), 0),
    (2, 11, 4, 2, 12, (3, 5), 4),
    (3, 5, 3, 1, 8, (2, 2), 9),
    (2, 37, 6, 6, 128, (3, 5), 13),
    (1, 16, 5, 1, 12, (1, 1), 0),
    (3, 23, 8, 2, 128, (4, 3), 31),
]


@pytest.mark.parametrize("B,S,H,Hkv,D,grid,offset", GEOMS)
def test_reference_is_the_model_path(B, S, H, Hkv, D, grid, offset):
    args, _ = qk_case(CPU, torch.float32, B=B, S=S, H=H, Hkv=Hkv, D=D, grid=grid,
                      offset=offset, frame_hi=20000, seed=B * 100 + S)
    q, k = model_path(args["qkv"], args["q_weight"], args["k_weight"], H, Hkv, args["rope"])
    v = args["qkv"][:, :, H + Hkv:].clone()
    qk_norm_rope_stage_(**args)
    assert_close(args["qkv"][:, :, :H], q, "q")
    assert_close(args["qkv"][:, :, H:H + Hkv], k, "k")
    assert torch.equal(args["qkv"][:, :, H + Hkv:], v)


@pytest.mark.parametrize("B,S,H,Hkv,D,grid,offset", GEOMS)
def test_reference_is_the_wan_path(B, S, H, Hkv, D, grid, offset):
    args, _ = qk_case(CPU, torch.float32, B=B, S=S, H=H, Hkv=Hkv, D=D, norm="all",
                      seed=B * 10 + S)
    args["rope"] = wan_grid(D, grid, torch.tensor([3, 17, 2000][:B]), offset)
    q, k = wan_path(args["qkv"], args["q_weight"], args["k_weight"], H, Hkv, args["rope"])
    qk_norm_rope_stage_(**args)
    assert_close(args["qkv"][:, :, :H], q, "q")
    assert_close(args["qkv"][:, :, H:H + Hkv], k, "k")


@pytest.mark.parametrize("norm", ["head", "all"])
@pytest.mark.parametrize("B,S,H,Hkv,D,grid,offset", GEOMS[:4])
def test_reference_is_rotate_half(B, S, H, Hkv, D, grid, offset, norm):
    args, _ = qk_case(CPU, torch.float32, B=B, S=S, H=H, Hkv=Hkv, D=D, norm=norm,
                      style="half", grid=grid, offset=offset, seed=S)
    q, k = half_path(args["qkv"], args["q_weight"], args["k_weight"], H, Hkv, args["rope"],
                     norm)
    qk_norm_rope_stage_(**args)
    assert_close(args["qkv"][:, :, :H], q, "q")
    assert_close(args["qkv"][:, :, H:H + Hkv], k, "k")


def test_rope_none_is_norm_only():
    args, _ = qk_case(CPU, torch.float32, B=2, S=9, H=4, Hkv=2, D=12, rope=False, seed=1)
    q, k = model_path(args["qkv"], args["q_weight"], args["k_weight"], 4, 2, None)
    want = args["qkv"].clone()
    identity = RopeGrid(torch.zeros(6, dtype=torch.float64), (2, 2, 2), (3, 5),
                        torch.zeros(2, dtype=torch.int64))  # every angle 0: cos 1, sin 0
    qk_norm_rope_stage_(want, args["q_weight"], args["k_weight"], num_heads=4,
                        num_kv_heads=2, rope=identity)
    qk_norm_rope_stage_(**args)
    assert torch.equal(args["qkv"], want)
    assert_close(args["qkv"][:, :, :4], q, "q")
    assert_close(args["qkv"][:, :, 4:6], k, "k")


def test_angles_are_fp64_at_far_frames():
    """At frame 5e7 (past 2**24), fp32 positions or angles are off by radians: the result
    matches the fp64 model path, and differs from a table built from fp32 angles."""
    args, _ = qk_case(CPU, torch.float32, B=1, S=15, H=2, Hkv=1, D=12, seed=4)
    args["rope"] = rope3d_grid(12, (3, 5), torch.tensor([50_000_001]))
    x = args["qkv"].clone()
    q, _ = model_path(x, args["q_weight"], args["k_weight"], 2, 1, args["rope"])
    qk_norm_rope_stage_(**args)
    assert_close(args["qkv"][:, :, :2], q, "q")
    # The same rope from angles rounded to fp32 (the best fp32 math could do) is off
    # by far more than the tolerance: the check above would catch fp32 angles.
    ang32 = _angles(args["rope"], 1, 15).float().double()
    q32, _ = model_path(x, args["q_weight"], args["k_weight"], 2, 1, None)
    q32 = apply_rope(q32, *Rope3D.cos_sin(ang32))
    assert (q32 - q).abs().max() > 1e-3


# --- staging ---------------------------------------------------------------------------

STAGE = [  # (B, S, H, Hkv, D, tokens, dst2, src_rows)
    (1, 7, 2, 2, 8, None, False, False),
    (2, 9, 4, 2, 12, 6, True, False),
    (3, 5, 3, 1, 8, 4, True, True),
    (2, 13, 6, 3, 128, None, False, True),
]


@pytest.mark.parametrize("norm", ["head", "all"])
@pytest.mark.parametrize("B,S,H,Hkv,D,tokens,dst2,src_rows", STAGE)
def test_staging_writes_slots_and_leaves_k(B, S, H, Hkv, D, tokens, dst2, src_rows, norm):
    args, _ = qk_case(CPU, torch.float32, B=B, S=S, H=H, Hkv=Hkv, D=D, norm=norm,
                      staging=True, tokens=tokens, dst2=dst2, src_rows=src_rows,
                      seed=S + D)
    weights = args["qkv"], args["q_weight"], args["k_weight"], H, Hkv
    if norm == "head":
        q, k = model_path(*weights, args["rope"])
    else:  # checked through the rotate-half path: the same rope in half style
        args["rope"] = dataclasses.replace(args["rope"], style="half")
        q, k = half_path(*weights, args["rope"], norm)
    before = args["qkv"].clone()
    pools = args["k_pool"].clone(), args["v_pool"].clone()
    writes = entry_writes(args)
    assert writes and len(writes) < args["dst"].shape[0] * (2 if dst2 else 1)
    qk_norm_rope_stage_(**args)
    assert_close(args["qkv"][:, :, :H], q, "q")
    assert torch.equal(args["qkv"][:, :, H:], before[:, :, H:])  # K and V raw
    T = tokens or S
    k_rows = k[:, :T].reshape(B * T, Hkv, D)
    v_rows = before[:, :T, H + Hkv:].reshape(B * T, Hkv, D)
    want_k, want_v = pools[0].clone(), pools[1].clone()
    for _, r, slot in writes:
        want_k[slot], want_v[slot] = k_rows[r], v_rows[r]
    written = torch.zeros(want_k.shape[0], dtype=torch.bool)
    written[[s for _, _, s in writes]] = True
    assert_close(args["k_pool"][written], want_k[written], "k_pool")
    assert torch.equal(args["v_pool"], want_v)
    assert torch.equal(args["k_pool"][~written], pools[0][~written])


def test_staging_with_every_slot_negative_writes_nothing():
    args, _ = qk_case(CPU, torch.float32, B=2, S=5, H=2, Hkv=1, D=8, staging=True, dst2=True,
                      seed=3)
    args["dst"].fill_(-1)
    args["dst2"].fill_(-1)
    pools = args["k_pool"].clone(), args["v_pool"].clone()
    qk_norm_rope_stage_(**args)
    assert torch.equal(args["k_pool"], pools[0]) and torch.equal(args["v_pool"], pools[1])


# --- layouts, custom op ------------------------------------------------------------------

@pytest.mark.parametrize("staging", [False, True])
def test_strided_qkv_equals_contiguous_and_keeps_its_surroundings(staging):
    kw = dict(B=2, S=7, H=4, Hkv=2, D=12, staging=staging, dst2=staging, seed=8)
    args, base = qk_case(CPU, torch.float32, strided=True, **kw)
    assert not args["qkv"].is_contiguous()
    mask = torch.ones_like(base, dtype=torch.bool)
    mask[:, 2:9, 1:9, 3:15] = False
    around = base[mask].clone()
    flat = dict(args, qkv=args["qkv"].contiguous())
    if staging:
        flat.update(k_pool=args["k_pool"].clone(), v_pool=args["v_pool"].clone())
    qk_norm_rope_stage_(**args)
    qk_norm_rope_stage_reference(**flat)
    assert torch.equal(base[mask], around)
    assert torch.equal(args["qkv"], flat["qkv"])
    if staging:
        assert torch.equal(args["k_pool"], flat["k_pool"])


def test_custom_op_is_registered_and_traces():
    assert hasattr(torch.ops.framekv, "qk_norm_rope_stage_")
    args, _ = qk_case(CPU, torch.float32, B=1, S=5, H=2, Hkv=1, D=8, staging=True, seed=2)
    want, _ = qk_case(CPU, torch.float32, B=1, S=5, H=2, Hkv=1, D=8, staging=True, seed=2)

    def step(qkv, k_pool, v_pool):
        qk_norm_rope_stage_(**dict(args, qkv=qkv, k_pool=k_pool, v_pool=v_pool))
        return qkv.sum()

    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="aot_eager")(
        args["qkv"], args["k_pool"], args["v_pool"])
    qk_norm_rope_stage_(**want)
    for name in ("qkv", "k_pool", "v_pool"):
        assert torch.equal(args[name], want[name]), name


# --- validation --------------------------------------------------------------------------

def _rope(args, **kw):
    return dataclasses.replace(args["rope"], **kw)


BAD = [  # (name, change to the arguments, message start)
    ("qkv rank", lambda a: dict(qkv=a["qkv"][0]), "qkv: expected 4 dimensions"),
    ("qkv dtype", lambda a: dict(qkv=a["qkv"].half()), "qkv: expected dtype"),
    ("qkv heads", lambda a: dict(num_kv_heads=2), "qkv: expected 6 heads"),
    ("qkv odd D", lambda a: dict(qkv=a["qkv"][..., :7]), "qkv: expected an even head dim"),
    ("qkv strides", lambda a: dict(qkv=a["qkv"].transpose(2, 3).contiguous().transpose(2, 3)),
     "qkv: expected a contiguous last dimension"),
    ("qkv overlap", lambda a: dict(qkv=a["qkv"][:1].expand(2, -1, -1, -1)),
     "qkv: expected no zero strides"),
    ("num_heads", lambda a: dict(num_heads=0), "num_heads: expected an integer >= 1"),
    ("num_kv_heads", lambda a: dict(num_kv_heads=True), "num_kv_heads: expected an integer"),
    ("norm", lambda a: dict(norm="layer"), "norm: expected one of"),
    ("eps", lambda a: dict(eps=float("nan")), "eps: expected a finite number"),
    ("eps type", lambda a: dict(eps="1e-6"), "eps: expected a finite number"),
    ("q_weight length", lambda a: dict(q_weight=a["q_weight"][:4]), "q_weight: expected length 8"),
    ("k_weight dtype", lambda a: dict(k_weight=a["k_weight"].half()), "k_weight: expected dtype"),
    ("k_weight rank", lambda a: dict(k_weight=a["k_weight"][None]), "k_weight: expected 1 dim"),
    ("all-heads length", lambda a: dict(norm="all"), "q_weight: expected length 16"),
    ("rope type", lambda a: dict(rope=(1, 2)), "rope: expected a RopeGrid"),
    ("inv_freq dtype", lambda a: dict(rope=_rope(a, inv_freq=a["rope"].inv_freq.float())),
     "rope.inv_freq: expected torch.float64 [4]"),
    ("inv_freq length", lambda a: dict(rope=_rope(a, inv_freq=a["rope"].inv_freq[:3])),
     "rope.inv_freq: expected torch.float64 [4]"),
    ("axes sum", lambda a: dict(rope=_rope(a, axes=(2, 1, 2))), "rope.axes: expected pairs"),
    ("axes count", lambda a: dict(rope=_rope(a, axes=(3, 1))), "rope.axes: expected 3"),
    ("axes negative", lambda a: dict(rope=_rope(a, axes=(5, -1, 0))),
     "rope.axes: expected an integer >= 0"),
    ("grid", lambda a: dict(rope=_rope(a, grid=(0, 3))), "rope.grid: expected an integer >= 1"),
    ("frame0 dtype", lambda a: dict(rope=_rope(a, frame0=a["rope"].frame0.int())),
     "rope.frame0: expected dtype torch.int64"),
    ("frame0 length", lambda a: dict(rope=_rope(a, frame0=a["rope"].frame0[:1])),
     "rope.frame0: expected length 2"),
    ("style", lambda a: dict(rope=_rope(a, style="neox")), "rope.style: expected one of"),
    ("offset", lambda a: dict(rope=_rope(a, token_offset=-1)),
     "rope.token_offset: expected an integer >= 0"),
    ("offset past 32 bits", lambda a: dict(rope=_rope(a, token_offset=2**31 - 5)),
     "rope.token_offset: expected at most 2147483642 (token indices stay below 2^31 with S = 5)"),
    ("pool without dst", lambda a: dict(dst=None), "dst: expected a tensor"),
    ("dst without pools", lambda a: dict(k_pool=None, v_pool=None), "k_pool: expected a tensor"),
    ("dst2 alone", lambda a: dict(k_pool=None, v_pool=None, dst=None),
     "dst2: expected None"),
    ("pool dtype", lambda a: dict(k_pool=a["k_pool"].bfloat16(), v_pool=a["v_pool"].bfloat16()),
     "k_pool: expected dtype torch.float32"),
    ("pool shape", lambda a: dict(k_pool=a["k_pool"][:, :, :4], v_pool=a["v_pool"][:, :, :4]),
     "k_pool: expected shape [slots, 1, 8]"),
    ("v_pool shape", lambda a: dict(v_pool=a["v_pool"][1:]), "v_pool: expected shape"),
    ("dst dtype", lambda a: dict(dst=a["dst"].int()), "dst: expected dtype torch.int64"),
    ("dst2 length", lambda a: dict(dst2=a["dst2"][1:]), "dst2: expected length"),
    ("src_rows length", lambda a: dict(src_rows=a["src_rows"][1:]), "src_rows: expected length"),
    ("dst rows", lambda a: dict(src_rows=None), "dst: expected length 8"),
    ("tokens high", lambda a: dict(tokens=6, src_rows=None), "tokens: expected an integer in"),
    ("tokens zero", lambda a: dict(tokens=0), "tokens: expected an integer >= 1"),
]


def _bad_case():
    return qk_case(CPU, torch.float32, B=2, S=5, H=2, Hkv=1, D=8, staging=True, dst2=True,
                   src_rows=True, tokens=4, seed=11)[0]


@pytest.mark.parametrize("name,change,message", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_are_refused_and_change_nothing(name, change, message):
    args = _bad_case()
    args.update(change(args))
    snapshot = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(ValueError) as info:
        qk_norm_rope_stage_(**args)
    assert str(info.value).startswith(message), str(info.value)
    assert "got" in str(info.value)
    for k, v in snapshot.items():
        assert torch.equal(args[k], v), k


def test_sections_wider_than_a_cta_holds_are_refused():
    from framekv.ops.qk_norm_rope import MAX_HEAD_VALUES

    H, D = MAX_HEAD_VALUES // 128 + 1, 128   # one head of 128 too many for the q section
    qkv = torch.zeros(1, 2, H + 2, D)
    w = torch.ones(D)
    with pytest.raises(ValueError, match=r"^qkv: expected max\(num_heads, num_kv_heads\) \* D "
                                         f"<= {MAX_HEAD_VALUES} .* got {H} \\* {D}"):
        qk_norm_rope_stage_(qkv, w, w, num_heads=H, num_kv_heads=1)
    assert not qkv.any()
    qk_norm_rope_stage_(qkv[:, :, 1:], w, w, num_heads=H - 1, num_kv_heads=1)  # the widest


def test_empty_batch_is_a_no_op():
    args, _ = qk_case(CPU, torch.float32, B=1, S=3, H=2, Hkv=1, D=8, rope=False, seed=1)
    args["qkv"] = args["qkv"][:0]
    qk_norm_rope_stage_(**args)
    assert math.prod(args["qkv"].shape) == 0
