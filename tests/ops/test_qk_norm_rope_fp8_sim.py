"""``qk_norm_rope_stage_``'s fp8 paths under numba's CUDA simulator: the e4m3 stores and
loads of `_float` against torch over every rounding boundary, and the kernel against
the torch reference (`compare_fp8_with_reference`: K, V and q_out bytes, amax and the
saturation counts bit for bit with the reference's quantization of the kernel's own
fp32 values; against the reference's own run, V and the counts bit for bit, K and Q
but at e4m3 ties).

Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``. Shapes stay
tiny (one Python thread per CUDA thread): odd head dims (D = 12, 4, 24), GQA, strided
qkv and q_out, dst2 and src_rows with skipped entries, statistics published by a head's
lanes, by each lane, and by whole warps of a head (D = 512).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from framekv.ops import _float, _launch
from framekv.ops.qk_norm_rope import qk_norm_rope_stage_
from test_qk_norm_rope_fp8 import (
    store_kernel,
    FP8,
    MAX,
    compare_fp8_with_reference,
    e4m3_probe_values,
    e4m3_table,
    fp8_case,
    staged_entries,
    torch_e4m3_bytes,
    u8,
)

pytestmark = pytest.mark.sim

CPU = torch.device("cpu")


def test_kernel_runs_in_the_simulator():
    assert _launch.SIMULATOR and _launch.use_kernel(torch.zeros(1))


# --- e4m3 accessors ---------------------------------------------------------------------------

def test_e4m3_bits_is_torch_on_every_boundary():
    x = e4m3_probe_values()
    got = torch.tensor([_float.e4m3_bits(v) for v in x.numpy()], dtype=torch.int32)
    want = torch_e4m3_bytes(x).to(torch.int32)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(x[i].item(), got[i].item(), want[i].item()) for i in bad[:5]]


def test_stores_to_int8_bits_are_e4m3():
    """store_f32 / store_f32x4 on an fp8 tensor's bits write torch's bytes; load_f32
    reads them back exactly."""
    x = e4m3_probe_values()
    x = torch.cat([x, torch.zeros(-x.numel() % 4)])
    out1 = torch.zeros(x.numel(), dtype=FP8)
    out4 = torch.zeros(x.numel(), dtype=FP8)
    back = torch.zeros(x.numel(), dtype=torch.float32)
    store_kernel[3, 8](_launch.array_arg(x), _launch.array_arg(out1), _launch.array_arg(out4),
                        _launch.array_arg(back))
    want = torch_e4m3_bytes(x)
    assert torch.equal(u8(out1), want) and torch.equal(u8(out4), want)
    assert torch.equal(back.nan_to_num(), out1.float().nan_to_num())
    assert torch.equal(back.isnan(), out1.float().isnan())


def test_load_and_round_of_every_e4m3_byte():
    table = e4m3_table().numpy()
    bits = np.arange(256, dtype=np.uint8).view(np.int8)
    for b in range(256):
        v = _float.load_f32(bits, (b,))
        assert v == table[b] or (np.isnan(v) and np.isnan(table[b])), b
        if np.isfinite(table[b]):
            assert _float.round_f32(bits, table[b]) == table[b]
    assert _float.round_f32(bits, np.float32(1000.0)) == MAX


# --- the kernel against the reference ---------------------------------------------------------

SIM_CASES = [  # (B, S, H, Hkv, D, tokens, dst2, src_rows, strided, norm, style, dtype, q_out)
    (1, 3, 2, 2, 8, None, False, False, False, "head", "interleaved", torch.float32, True),
    (2, 5, 3, 1, 12, 3, True, True, True, "all", "half", torch.bfloat16, True),
    (3, 2, 9, 3, 4, 1, True, False, False, "head", "half", torch.bfloat16, False),
    (1, 2, 2, 1, 128, None, False, True, False, "all", "interleaved", torch.bfloat16, True),
    (2, 3, 2, 2, 24, 2, True, True, True, "head", "interleaved", torch.float32, True),
    (1, 2, 4, 2, 8, None, True, False, False, "all", None, torch.float32, True),
]


def _kw(case, **extra):
    B, S, H, Hkv, D, tokens, dst2, src_rows, strided, norm, style, dtype, q_out = case
    kw = dict(B=B, S=S, H=H, Hkv=Hkv, D=D, tokens=tokens, dst2=dst2, src_rows=src_rows,
              strided=strided, norm=norm, style=style or "interleaved", rope=style is not None,
              q_out=q_out, q_strided=strided, frame_hi=30000, seed=B * 31 + S * 7 + D)
    kw.update(extra)
    return dtype, kw


@pytest.mark.parametrize("case", SIM_CASES, ids=lambda c: "x".join(map(str, c[:5])))
def test_kernel_matches_reference(case):
    dtype, kw = _kw(case)
    got = compare_fp8_with_reference(CPU, dtype, **kw)
    assert staged_entries(got)  # something was staged


def _saturate(args):
    """Large V in the first staged row, inf and NaN in it, K and Q scales that saturate
    head 0 (the norm keeps K and Q near 1)."""
    H, Hkv = args["num_heads"], args["num_kv_heads"]
    T = args.get("tokens") or args["qkv"].shape[1]
    b, t = divmod(staged_entries(args)[0][1], T)
    v = args["qkv"][b, t, H + Hkv:]
    v[0, :4] = torch.tensor([3000.0, -1e30, float("inf"), float("nan")])
    v[-1, -1] = -float("inf")
    args["kv_scale"][0, 0] = 2.0 ** -9
    if args.get("q_scale") is not None:
        args["q_scale"][0] = 2.0 ** -9


@pytest.mark.parametrize("case", [SIM_CASES[1], SIM_CASES[3], SIM_CASES[4]],
                         ids=lambda c: "x".join(map(str, c[:5])))
def test_saturation_and_nan_match_reference(case):
    dtype, kw = _kw(case)
    before = fp8_case(CPU, dtype, **kw)
    got = compare_fp8_with_reference(CPU, dtype, prepare=_saturate, **kw)
    assert (got["saturated"] - before["saturated"] >= 4).all()  # K of head 0; V's 4
    if got.get("q_out") is not None:
        assert got["q_saturated"].item() > before["q_saturated"].item()
    assert (u8(got["v_pool"]) == 0x7F).any()
    assert got["kv_amax"][1, 0] == float("inf")


def test_widest_head_publishes_per_warp():
    """D = 512: 64 lanes a head, statistics of each warp of it (two atomics a head)."""
    compare_fp8_with_reference(CPU, torch.float32, B=1, S=1, H=1, Hkv=1, D=512, q_out=True,
                               seed=3, prepare=_saturate)


def test_q_out_without_pools_matches_reference():
    compare_fp8_with_reference(CPU, torch.bfloat16, fp8_pools=False, q_out=True, q_strided=True,
                               B=2, S=3, H=3, Hkv=1, D=8, seed=8)


def test_every_entry_skipped_writes_and_counts_nothing():
    args = fp8_case(CPU, torch.float32, B=2, S=2, H=2, Hkv=1, D=8, dst2=True, src_rows=True,
                    seed=6)
    args["src_rows"].copy_(torch.tensor([-1, 4, 99, -5, 2, 3, 1])[:args["src_rows"].shape[0]])
    args["dst"][4:] = -1
    args["dst2"][4:] = -1
    args["qkv"].mul_(1e4)
    keep = {k: (u8(v) if v.dtype == FP8 else v).clone() for k, v in args.items()
            if k in ("k_pool", "v_pool", "kv_amax", "saturated")}
    qk_norm_rope_stage_(**args)
    for k, v in keep.items():
        assert torch.equal(u8(args[k]) if args[k].dtype == FP8 else args[k], v), k


def test_statistics_accumulate_over_calls():
    """Two calls: counts add up, amax keeps the larger; each call's bytes the reference's."""
    def prepare(args):
        _saturate(args)
        args["kv_amax"].zero_()

    kw = dict(B=2, S=3, H=2, Hkv=2, D=8, dst2=True, q_out=True, seed=1)
    first = compare_fp8_with_reference(CPU, torch.float32, prepare=prepare, **kw)
    counts, amax = first["saturated"].clone(), first["kv_amax"].clone()

    def again(args):
        prepare(args)
        args["saturated"].copy_(counts)
        args["kv_amax"].copy_(amax)

    second = compare_fp8_with_reference(CPU, torch.float32, prepare=again, **kw)
    start = fp8_case(CPU, torch.float32, **kw)["saturated"]
    assert (counts > start).all()
    assert torch.equal(second["saturated"] - counts, counts - start)
    assert torch.equal(second["kv_amax"], amax)
