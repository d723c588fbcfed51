"""CPU tests of ``merge_split_kv_``: the torch reference against attention computed from
scratch (each block's keys cut into S sub-rows, some empty, merged by the reference,
compared with softmax attention over all keys), the public op on CPU (the reference
path), padding rows, strided outputs, argument validation and torch.compile. Also the
case builders shared by the simulator and GPU tests.
"""
from __future__ import annotations

import math

import pytest
import torch

from framekv.ops import merge_split_kv_, merge_split_kv_reference

CPU = torch.device("cpu")
NAN = float("nan")

# --- exact split attention ----------------------------------------------------------


def random_cuts(L: int, S: int, g: torch.Generator, empty: int | None = None) -> list[int]:
    """S part lengths summing to L (random cut points, so parts may be empty); part
    ``empty`` is forced empty."""
    points = sorted(torch.randint(0, L + 1, (S - 1,), generator=g).tolist())
    lens = [b - a for a, b in zip([0] + points, points + [L])]
    if empty is not None and S > 1:
        donor = (empty + 1) % S
        lens[donor] += lens[empty]
        lens[empty] = 0
    return lens


def part_attention(q, k, v, scale):
    """Softmax attention of q [b, H, D] over k, v [L, H, D] (float64): O [b, H, D] and
    the natural-log logsumexp of the scaled scores [H, b]. L = 0 gives NaN garbage."""
    b, H, D = q.shape
    if k.shape[0] == 0:
        return torch.full((b, H, D), NAN, dtype=q.dtype), torch.full((H, b), NAN, dtype=q.dtype)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale         # [H, b, L]
    lse = torch.logsumexp(scores, -1)                            # [H, b]
    out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out, lse


def split_attention_case(*, S, nb, b, H, D, seed, max_keys=40, empty_block=None):
    """Random Q/K/V per block, keys cut into S parts (some empty; block ``empty_block``
    has no keys at all). Returns (partial [S, T, H, D] f64, lse [S * nb, H, b] f64,
    kv_lens int32 [S * nb], want [T, H, D] f64: attention over all of each block's keys)."""
    g = torch.Generator().manual_seed(seed)
    T, scale = nb * b, D ** -0.5
    partial = torch.empty(S, T, H, D, dtype=torch.float64)
    lse = torch.empty(S * nb, H, b, dtype=torch.float64)
    kv_lens = torch.empty(S * nb, dtype=torch.int32)
    want = torch.zeros(T, H, D, dtype=torch.float64)
    for i in range(nb):
        L = 0 if i == empty_block else int(torch.randint(1, max_keys + 1, (1,), generator=g))
        q = torch.randn(b, H, D, generator=g, dtype=torch.float64) * 2
        k = torch.randn(L, H, D, generator=g, dtype=torch.float64)
        v = torch.randn(L, H, D, generator=g, dtype=torch.float64)
        rows = slice(i * b, (i + 1) * b)
        if L:
            want[rows] = part_attention(q, k, v, scale)[0]
        start = 0
        for s, n in enumerate(random_cuts(L, S, g, empty=i % S)):
            o, l = part_attention(q, k[start:start + n], v[start:start + n], scale)
            partial[s, rows], lse[s * nb + i], kv_lens[s * nb + i] = o, l, n
            start += n
    return partial, lse, kv_lens, want


EXACT_GEOMETRIES = [  # (S, nb, b, H, D, seq_len or None for T)
    (1, 1, 5, 3, 64, None),
    (2, 1, 7, 3, 128, 4),
    (2, 3, 4, 3, 64, None),
    (3, 2, 5, 1, 64, 7),
    (3, 4, 3, 3, 128, 10),
    (4, 4, 2, 3, 64, None),
    (4, 3, 6, 5, 128, 13),
    (6, 2, 3, 3, 64, 5),
]


@pytest.mark.parametrize("S,nb,b,H,D,seq_len", EXACT_GEOMETRIES)
def test_reference_equals_attention_over_all_keys(S, nb, b, H, D, seq_len):
    empty_block = 1 if nb > 2 else None
    partial, lse, kv_lens, want = split_attention_case(S=S, nb=nb, b=b, H=H, D=D, seed=S * 10 + nb,
                                                       empty_block=empty_block)
    T = nb * b
    seq_len = T if seq_len is None else seq_len
    want[seq_len:] = 0
    out = torch.full((T, H, D), 5.0)
    merge_split_kv_reference(out, partial.float(), lse.float(), kv_lens, block_size=b,
                             seq_len=seq_len)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    if empty_block is not None:
        assert out[empty_block * b:(empty_block + 1) * b].eq(0).all()
    assert (kv_lens == 0).any() or S == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_on_half_partials_is_attention_within_rounding(dtype):
    partial, lse, kv_lens, want = split_attention_case(S=3, nb=4, b=4, H=3, D=64, seed=5,
                                                       empty_block=2)
    out = torch.empty(16, 3, 64, dtype=dtype)
    merge_split_kv_(out, partial.to(dtype), lse.float(), kv_lens, block_size=4, seq_len=16)
    # Partials rounded to 2-byte floats, then the merge rounded once more.
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)


def test_garbage_in_empty_sub_rows_is_ignored():
    partial, lse, kv_lens, want = split_attention_case(S=4, nb=2, b=3, H=3, D=64, seed=9)
    empty = (kv_lens == 0).nonzero().flatten()
    assert empty.numel() > 0
    for n in empty.tolist():
        s, i = divmod(n, 2)
        partial[s, i * 3:(i + 1) * 3] = math.inf
        lse[n] = torch.tensor([NAN, math.inf, -math.inf])[:, None]  # per head, every token
    out = torch.empty(6, 3, 64)
    merge_split_kv_reference(out, partial.float(), lse.float(), kv_lens, block_size=3, seq_len=6)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


# --- random cases (shared with the simulator and GPU tests) ---------------------------

def make_out(T, H, D, dtype, layout, device, g):
    """An output buffer filled with garbage and the tensor that holds it.

    layout: contiguous | packed (a window of a wider [T, H + 2, D + 16] tensor, rows
    still 16-byte aligned) | heads_major ([H, T, D] transposed)."""
    if layout == "contiguous":
        base = torch.randn(T, H, D, generator=g)
        view = lambda t: t  # noqa: E731
    elif layout == "packed":
        base = torch.randn(T, H + 2, D + 16, generator=g)
        view = lambda t: t[:, 1:1 + H, 8:8 + D]  # noqa: E731
    elif layout == "heads_major":
        base = torch.randn(H, T, D, generator=g)
        view = lambda t: t.transpose(0, 1)  # noqa: E731
    else:
        raise ValueError(layout)
    base = base.to(device, dtype)
    return view(base), base


def merge_case(device, dtype, *, S, nb, b, H, D, seq_len=None, layout="contiguous",
               empty_every=3, garbage=True, stats_4d=False, blocked=False, seed=0):
    """Random arguments for ``merge_split_kv_``: partial ~ N(0, 1), lse ~ 3 N(0, 1),
    sub-rows n = k * empty_every - 1 empty (block 1, if any, has no keys at all), with
    NaN/inf garbage in the empty sub-rows when ``garbage``. Deterministic in seed;
    ``out`` starts as garbage. ``blocked``: the same partials stored block by block,
    [S, nb, H, b, D] (the packed-GQA layout), instead of [S, T, H, D]."""
    g = torch.Generator().manual_seed(seed)
    T = nb * b
    partial = torch.randn(S, T, H, D, generator=g)
    lse = torch.randn(S * nb, H, b, generator=g) * 3
    kv_lens = torch.randint(1, 1000, (S * nb,), generator=g, dtype=torch.int32)
    if empty_every:
        kv_lens[empty_every - 1::empty_every] = 0
    if nb > 1:
        kv_lens[1::nb] = 0
    if garbage:
        for n in (kv_lens == 0).nonzero().flatten().tolist():
            s, i = divmod(n, nb)
            partial[s, i * b:(i + 1) * b] = NAN
            lse[n] = (NAN, math.inf, -math.inf)[n % 3]
    out, base = make_out(T, H, D, dtype, layout, device, g)
    if stats_4d:
        lse = lse[..., None]
    if blocked:
        partial = partial.unflatten(1, (nb, b)).transpose(2, 3).contiguous()  # [S, nb, H, b, D]
    return {"out": out, "partial": partial.to(device, dtype), "lse": lse.to(device),
            "kv_lens": kv_lens.to(device), "block_size": b,
            "seq_len": T if seq_len is None else seq_len}, base


def assert_merged_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal within two units in the last place of the output dtype (fp32 sums in a
    different order may round the other way)."""
    ulp = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * ulp, atol=1e-5)


# --- public op and bound launcher on CPU -------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "packed", "heads_major"])
def test_op_on_cpu_is_the_reference(layout):
    args, base = merge_case(CPU, torch.bfloat16, S=3, nb=2, b=3, H=3, D=64, seq_len=5,
                            layout=layout, seed=1)
    want_args, want_base = merge_case(CPU, torch.bfloat16, S=3, nb=2, b=3, H=3, D=64,
                                      seq_len=5, layout=layout, seed=1)
    merge_split_kv_(**args)
    merge_split_kv_reference(**want_args)
    assert torch.equal(base.view(torch.int16), want_base.view(torch.int16))
    assert args["out"][5:].eq(0).all() and args["out"][3:6].eq(0).all()  # padding; block 1 empty
    assert torch.isfinite(args["out"].float()).all()


@pytest.mark.parametrize("S,nb,b,H", [(1, 1, 4, 2), (3, 2, 3, 3), (2, 4, 2, 4)])
def test_blocked_partials_merge_as_token_major(S, nb, b, H):
    """[S, nb, H, b, D] (packed GQA rows) merges to the same output as [S, T, H, D]."""
    kw = dict(S=S, nb=nb, b=b, H=H, D=64, seq_len=nb * b - 1, seed=S + nb)
    args, _ = merge_case(CPU, torch.bfloat16, blocked=True, **kw)
    want, _ = merge_case(CPU, torch.bfloat16, **kw)
    assert args["partial"].shape == (S, nb, H, b, 64)
    merge_split_kv_(**args)
    merge_split_kv_(**want)
    assert torch.equal(args["out"].view(torch.int16), want["out"].view(torch.int16))
    with pytest.raises(ValueError, match=rf"partial: expected shape \[S >= 1, {nb}, {H}, {b}, 64\]"):
        merge_split_kv_(**{**args, "partial": args["partial"][:, :, :, 1:]})


def test_packed_output_leaves_the_rest_alone():
    args, base = merge_case(CPU, torch.float16, S=2, nb=2, b=2, H=3, D=64, layout="packed")
    before = base.clone()
    merge_split_kv_(**args)
    mask = torch.ones_like(base, dtype=torch.bool)
    mask[:, 1:4, 8:72] = False
    assert torch.equal(base[mask], before[mask])


def test_merge_on_cpu_reads_the_current_contents():
    args, _ = merge_case(CPU, torch.bfloat16, S=2, nb=1, b=4, H=3, D=64, empty_every=0)
    merge_split_kv_(**args)
    want = args["out"].clone()
    merge_split_kv_reference(want, *(args[k] for k in ("partial", "lse", "kv_lens")),
                             block_size=4, seq_len=4)
    assert torch.equal(args["out"], want)
    args["kv_lens"][1] = 0
    args["partial"].mul_(2)
    merge_split_kv_(**args)
    merge_split_kv_reference(want, *(args[k] for k in ("partial", "lse", "kv_lens")),
                             block_size=4, seq_len=4)
    assert torch.equal(args["out"], want)
    torch.testing.assert_close(want.float(), args["partial"][0].float())  # one split left


def test_cudnn_shaped_stats_and_lengths():
    args, _ = merge_case(CPU, torch.bfloat16, S=2, nb=3, b=2, H=3, D=64, seed=4)
    four = dict(args, out=args["out"].clone(), lse=args["lse"][..., None],
                kv_lens=args["kv_lens"].view(-1, 1, 1, 1))
    merge_split_kv_(**args)
    merge_split_kv_(**four)
    assert torch.equal(args["out"], four["out"])


def test_seq_len_zero_and_empty_tensors():
    args, _ = merge_case(CPU, torch.bfloat16, S=2, nb=2, b=2, H=3, D=64, seq_len=0)
    merge_split_kv_(**args)
    assert args["out"].eq(0).all()
    out = torch.empty(0, 3, 64, dtype=torch.bfloat16)
    merge_split_kv_(out, torch.empty(2, 0, 3, 64, dtype=torch.bfloat16),
                    torch.empty(0, 3, 4), torch.empty(0, dtype=torch.int32),
                    block_size=4, seq_len=0)


# --- validation ---------------------------------------------------------------------


def _args():
    args, _ = merge_case(CPU, torch.bfloat16, S=2, nb=2, b=2, H=3, D=16, seq_len=3)
    return args


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


BF = torch.bfloat16
MERGE_BAD = {
    "out not a tensor": ("out", lambda a: [1.0]),
    "out 2-D": ("out", lambda a: a["out"][:, 0]),
    "out float32": ("out", lambda a: a["out"].float()),
    "out D not a multiple of 8": ("out", lambda a: torch.zeros(4, 3, 12, dtype=BF)),
    "out strided D": ("out", lambda a: torch.zeros(4, 3, 32, dtype=BF)[..., ::2]),
    "out zero stride": ("out", lambda a: torch.zeros(1, 3, 16, dtype=BF).expand(4, 3, 16)),
    "out misaligned rows": ("out", lambda a: torch.zeros(4, 3, 20, dtype=BF)[..., :16]),
    "out misaligned start": ("out", lambda a: torch.zeros(4 * 3 * 16 + 4, dtype=BF)[4:]
                             .view(4, 3, 16)),
    "partial 3-D": ("partial", lambda a: a["partial"][0]),
    "partial dtype": ("partial", lambda a: a["partial"].half()),
    "partial shape": ("partial", lambda a: a["partial"][:, :2]),
    "partial heads": ("partial", lambda a: torch.zeros(2, 4, 2, 16, dtype=BF)),
    "partial no splits": ("partial", lambda a: a["partial"][:0]),
    "partial device": ("partial", lambda a: _meta(a["partial"])),
    "partial strided D": ("partial", lambda a: torch.zeros(2, 4, 3, 32, dtype=BF)[..., ::2]),
    "partial misaligned": ("partial", lambda a: torch.zeros(2, 4, 3, 20, dtype=BF)[..., 2:18]),
    "lse 2-D": ("lse", lambda a: a["lse"][0]),
    "lse dtype": ("lse", lambda a: a["lse"].half()),
    "lse shape": ("lse", lambda a: a["lse"][:3]),
    "lse block": ("lse", lambda a: torch.zeros(4, 3, 4)),
    "lse trailing dim": ("lse", lambda a: torch.zeros(4, 3, 2, 2)),
    "lse device": ("lse", lambda a: _meta(a["lse"])),
    "kv_lens int64": ("kv_lens", lambda a: a["kv_lens"].long()),
    "kv_lens length": ("kv_lens", lambda a: a["kv_lens"][:3]),
    "kv_lens 2-D": ("kv_lens", lambda a: a["kv_lens"].view(2, 2)),
    "kv_lens 4-D shape": ("kv_lens", lambda a: a["kv_lens"].view(1, 4, 1, 1)),
    "kv_lens device": ("kv_lens", lambda a: _meta(a["kv_lens"])),
    "block_size not a divisor": ("block_size", lambda a: 3),
    "block_size zero": ("block_size", lambda a: 0),
    "block_size float": ("block_size", lambda a: 2.0),
    "seq_len past T": ("seq_len", lambda a: 5),
    "seq_len negative": ("seq_len", lambda a: -1),
    "seq_len bool": ("seq_len", lambda a: True),
}


@pytest.mark.parametrize("case", sorted(MERGE_BAD))
def test_merge_rejects(case):
    name, make = MERGE_BAD[case]
    args = _args()
    args[name] = make(args)
    with pytest.raises(ValueError, match=f"^{name}: "):
        merge_split_kv_(**args)


def test_merge_messages_say_expected_and_actual():
    args = _args()
    args["kv_lens"] = args["kv_lens"].long()
    with pytest.raises(ValueError, match="expected dtype torch.int32, got torch.int64"):
        merge_split_kv_(**args)
    args = _args()
    args["lse"] = torch.zeros(4, 3, 4)
    with pytest.raises(ValueError, match=r"expected shape \[4, 3, 2\] or \[4, 3, 2, 1\] .*"
                                         r"got \(4, 3, 4\)"):
        merge_split_kv_(**args)


def test_merge_traces_under_torch_compile():
    torch._dynamo.reset()

    def step(out, partial, lse, kv_lens):
        merge_split_kv_(out, partial, lse, kv_lens, block_size=2, seq_len=3)
        return out.float().sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, want = _args(), _args()
    compiled(got["out"], got["partial"], got["lse"], got["kv_lens"])
    step(want["out"], want["partial"], want["lse"], want["kv_lens"])
    assert torch.equal(got["out"], want["out"])
