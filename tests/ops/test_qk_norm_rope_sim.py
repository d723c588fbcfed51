"""``qk_norm_rope_stage_``'s kernel under numba's CUDA simulator, against the torch
reference run on the same inputs.

Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``. Shapes stay
tiny (one Python thread per CUDA thread); blocks are capped at 8 threads and grids at 3
blocks, so the item loop turns several times, groups get one to eight lanes, and with
more heads than threads the groups take several rounds. fp32 results match the
reference within 1e-5, bf16 ones within one bf16 rounding.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from framekv.ops import _launch
from framekv.ops.qk_norm_rope import qk_norm_rope_stage_, qk_norm_rope_stage_reference
from test_qk_norm_rope import assert_matches, compare_with_reference, entry_writes, qk_case

pytestmark = pytest.mark.sim

CPU = torch.device("cpu")


def test_kernel_runs_in_the_simulator():
    assert _launch.SIMULATOR and _launch.use_kernel(torch.zeros(1))


SIM_CASES = [  # (B, S, H, Hkv, D, grid, offset, strided)
    (1, 3, 2, 2, 8, (3, 5), 0, False),
    (2, 5, 3, 1, 12, (2, 3), 4, True),
    (3, 2, 9, 3, 4, (1, 2), 1, False),    # D = 4: a head in one thread's 8 slots, half masked
    (1, 2, 2, 1, 128, (3, 5), 7, False),  # 16 threads a head, 4 pairs each
    (1, 2, 4, 2, 128, (2, 3), 3, False),  # q over all heads: 64 lanes, two warps' sums
]
VARIANTS = [  # (norm, style or None for no rope, dtype)
    ("head", "interleaved", torch.float32),
    ("all", "half", torch.float32),
    ("head", "half", torch.bfloat16),
    ("all", "interleaved", torch.bfloat16),
    ("all", None, torch.float32),
    ("head", None, torch.bfloat16),
]


def _kw(case, variant, **extra):
    B, S, H, Hkv, D, grid, offset, strided = case
    norm, style, dtype = variant
    kw = dict(B=B, S=S, H=H, Hkv=Hkv, D=D, grid=grid, offset=offset, strided=strided,
              norm=norm, style=style or "interleaved", rope=style is not None,
              frame_hi=30000, seed=B * 31 + S * 7 + D)
    kw.update(extra)
    return dtype, kw


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-{v[1]}-{v[2]}")
@pytest.mark.parametrize("case", SIM_CASES, ids=lambda c: "x".join(map(str, c[:5])))
def test_kernel_matches_reference_in_place(case, variant):
    dtype, kw = _kw(case, variant)
    compare_with_reference(CPU, dtype, **kw)


STAGE_CASES = [  # (case, variant, tokens, dst2, src_rows)
    (SIM_CASES[0], VARIANTS[0], None, False, False),
    (SIM_CASES[1], VARIANTS[1], 3, True, True),
    (SIM_CASES[2], VARIANTS[2], 1, True, False),
    (SIM_CASES[3], VARIANTS[3], None, False, True),
    (SIM_CASES[1], VARIANTS[4], 4, True, True),
]


@pytest.mark.parametrize("case,variant,tokens,dst2,src_rows", STAGE_CASES)
def test_kernel_matches_reference_staging(case, variant, tokens, dst2, src_rows):
    dtype, kw = _kw(case, variant, staging=True, tokens=tokens, dst2=dst2, src_rows=src_rows)
    got = compare_with_reference(CPU, dtype, **kw)
    assert entry_writes(got)  # something was staged


@pytest.mark.parametrize("staging", [False, True])
def test_op_matches_reference_across_calls(staging):
    """Three calls on the same tensors with new qkv, frame0 and lists in place (what a
    graph replay sees)."""
    dtype = torch.bfloat16
    kw = dict(B=2, S=3, H=3, Hkv=1, D=8, norm="all", staging=staging, dst2=staging,
              src_rows=staging, tokens=2 if staging else None)
    got, _ = qk_case(CPU, dtype, seed=0, **kw)
    qkv = got["qkv"]
    for trial in range(3):
        fresh, _ = qk_case(CPU, dtype, seed=trial + 1, **kw)
        qkv.copy_(fresh["qkv"])
        got["rope"].frame0.copy_(fresh["rope"].frame0)
        for name in ("dst", "dst2", "src_rows"):
            if staging:
                got[name].copy_(fresh[name])
        want = dict(got, qkv=qkv.clone(), k_pool=got.get("k_pool"), v_pool=got.get("v_pool"))
        if staging:
            want.update(k_pool=got["k_pool"].clone(), v_pool=got["v_pool"].clone())
        qk_norm_rope_stage_reference(**want)
        qk_norm_rope_stage_(**got)
        assert_matches(qkv[:, :, :3], want["qkv"][:, :, :3], dtype, f"q {trial}")
        if staging:
            assert torch.equal(qkv[:, :, 3:], want["qkv"][:, :, 3:])
            assert_matches(got["k_pool"], want["k_pool"], dtype, f"k_pool {trial}")
            assert torch.equal(got["v_pool"], want["v_pool"])
        else:
            assert_matches(qkv[:, :, 3:4], want["qkv"][:, :, 3:4], dtype, f"k {trial}")


def test_fp32_weights_serve_both_float_dtypes_without_pools():
    for dtype in (torch.float32, torch.bfloat16):
        got, _ = qk_case(CPU, dtype, B=1, S=3, H=2, Hkv=2, D=8, seed=4)
        want, _ = qk_case(CPU, dtype, B=1, S=3, H=2, Hkv=2, D=8, seed=4)
        qk_norm_rope_stage_(**dict(got, q_weight=got["q_weight"].float(),
                                   k_weight=got["k_weight"].float()))
        qk_norm_rope_stage_reference(**dict(want, q_weight=want["q_weight"].float(),
                                            k_weight=want["k_weight"].float()))
        assert_matches(got["qkv"], want["qkv"], dtype, str(dtype))


def test_mixed_weight_dtypes():
    got, _ = qk_case(CPU, torch.bfloat16, B=1, S=2, H=2, Hkv=1, D=8, seed=9)
    got["k_weight"] = got["k_weight"].float() * 1.5
    want = dict(got, qkv=got["qkv"].clone())
    qk_norm_rope_stage_(**got)
    qk_norm_rope_stage_reference(**want)
    assert_matches(got["qkv"], want["qkv"], torch.bfloat16, "qkv")


def test_every_entry_skipped_writes_no_slot():
    got, _ = qk_case(CPU, torch.float32, B=2, S=2, H=2, Hkv=1, D=8, staging=True, dst2=True,
                     src_rows=True, seed=6)
    got["src_rows"].copy_(torch.tensor([-1, 4, 99, -5, 2, 3, 1])[:got["src_rows"].shape[0]])
    got["dst"][4:] = -1
    got["dst2"][4:] = -1
    pools = got["k_pool"].clone(), got["v_pool"].clone()
    qk_norm_rope_stage_(**got)
    assert torch.equal(got["k_pool"], pools[0]) and torch.equal(got["v_pool"], pools[1])


def test_frame0_is_read_per_sequence():
    """Two sequences with the same tokens and different frame0 get different rotations,
    each the reference's."""
    got, _ = qk_case(CPU, torch.float32, B=2, S=2, H=1, Hkv=1, D=8, seed=2)
    got["qkv"][1] = got["qkv"][0]
    got["rope"] = dataclasses.replace(got["rope"], frame0=torch.tensor([0, 5]))
    want = dict(got, qkv=got["qkv"].clone())
    qk_norm_rope_stage_(**got)
    qk_norm_rope_stage_reference(**want)
    assert_matches(got["qkv"], want["qkv"], torch.float32, "qkv")
    assert not torch.allclose(got["qkv"][0, :, :2], got["qkv"][1, :, :2])


def test_eps_counts_for_small_rows():
    """Rows whose mean square is near eps: eps is added where the reference adds it."""
    got, _ = qk_case(CPU, torch.float32, B=1, S=2, H=2, Hkv=1, D=8, norm="all", seed=7)
    got["qkv"].mul_(1e-3)
    got["eps"] = 1e-5
    want = dict(got, qkv=got["qkv"].clone())
    no_eps = dict(got, qkv=got["qkv"].clone(), eps=0.0)
    qk_norm_rope_stage_(**got)
    qk_norm_rope_stage_(**no_eps)
    qk_norm_rope_stage_reference(**want)
    assert_matches(got["qkv"], want["qkv"], torch.float32, "qkv")
    assert (got["qkv"] - no_eps["qkv"]).abs().max() > 0.1
