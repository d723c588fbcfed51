"""``merge_split_kv_``'s kernel under numba's CUDA simulator, against the torch reference.

Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``. Shapes stay
tiny (one Python thread per CUDA thread); CTAs are capped at 8 threads and grids at 3
CTAs, so the row loop turns several times, and at D = 128 (16 words a row) each thread
merges two words of its row.
"""
from __future__ import annotations

import math

import pytest
import torch

from framekv.ops import _launch, merge_split_kv_, merge_split_kv_reference
from test_merge_split_kv import (assert_merged_close, merge_case, split_attention_case)

pytestmark = pytest.mark.sim

CPU = torch.device("cpu")


def test_kernel_runs_in_the_simulator():
    assert _launch.SIMULATOR and _launch.use_kernel(torch.zeros(1))


def _compare(dtype, **kw):
    args, base = merge_case(CPU, dtype, **kw)
    want, want_base = merge_case(CPU, dtype, **kw)
    merge_split_kv_(**args)
    merge_split_kv_reference(**want)
    assert torch.isfinite(args["out"].float()).all()
    assert_merged_close(base, want_base)  # the whole buffer: the window and what is around it
    return args


SIM_CASES = [  # (S, nb, b, H, D, seq_len, layout)
    (1, 1, 3, 3, 64, None, "contiguous"),
    (2, 1, 4, 3, 128, 3, "packed"),
    (2, 3, 2, 3, 64, 5, "heads_major"),
    (3, 2, 3, 1, 64, None, "packed"),
    (3, 4, 1, 3, 128, 3, "contiguous"),
    (4, 2, 2, 3, 64, 3, "contiguous"),
    (5, 3, 2, 3, 64, 4, "packed"),  # more splits than one round of four loads
]


@pytest.mark.parametrize("S,nb,b,H,D,seq_len,layout", SIM_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_reference(S, nb, b, H, D, seq_len, layout, dtype):
    args = _compare(dtype, S=S, nb=nb, b=b, H=H, D=D, seq_len=seq_len, layout=layout,
                    seed=S * 7 + nb)
    T = nb * b
    seq_len = T if seq_len is None else seq_len
    assert args["out"][seq_len:].eq(0).all()
    if nb > 1:  # block 1 has no keys in any sub-row
        assert args["out"][b:2 * b].eq(0).all()


@pytest.mark.parametrize("S,nb,b,H,layout", [(2, 1, 4, 3, "contiguous"), (5, 3, 2, 2, "packed")])
def test_blocked_partials_match_reference(S, nb, b, H, layout):
    """The kernel reads [S, nb, H, b, D] partials (packed GQA rows) like [S, T, H, D]."""
    kw = dict(S=S, nb=nb, b=b, H=H, D=64, seq_len=nb * b - 1, layout=layout, seed=3)
    args, base = merge_case(CPU, torch.bfloat16, blocked=True, **kw)
    want, want_base = merge_case(CPU, torch.bfloat16, **kw)
    merge_split_kv_(**args)
    merge_split_kv_reference(**want)
    assert_merged_close(base, want_base)


def test_nan_in_empty_sub_rows_does_not_leak():
    args = _compare(torch.bfloat16, S=3, nb=3, b=2, H=3, D=64, empty_every=2, seed=3)
    kv = args["kv_lens"].view(3, 3)  # [S, nb]
    assert (kv[:, 0] == 0).any() and (kv[:, 0] > 0).any()  # block 0 mixes empty and full
    assert args["partial"].float().isnan().any()


def test_kernel_is_exact_split_attention():
    partial, lse, kv_lens, want = split_attention_case(S=4, nb=3, b=2, H=3, D=64, seed=2,
                                                       empty_block=1)
    out = torch.empty(6, 3, 64, dtype=torch.float16)
    merge_split_kv_(out, partial.half(), lse.float(), kv_lens, block_size=2, seq_len=6)
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)


def test_cudnn_shaped_stats_and_lengths():
    args = _compare(torch.bfloat16, S=2, nb=2, b=2, H=3, D=64, stats_4d=True, seed=6)
    four = dict(args, out=torch.empty_like(args["out"]),
                kv_lens=args["kv_lens"].view(-1, 1, 1, 1))
    merge_split_kv_(**four)
    assert torch.equal(four["out"], args["out"])


def test_merge_reads_new_contents_of_the_same_tensors():
    args, _ = merge_case(CPU, torch.bfloat16, S=3, nb=2, b=2, H=3, D=64, seq_len=3,
                         layout="packed", seed=8)
    g = torch.Generator().manual_seed(1)
    for trial in range(3):
        args["partial"].copy_(torch.randn(args["partial"].shape, generator=g))
        args["lse"].copy_(torch.randn(args["lse"].shape, generator=g) * 3)
        args["kv_lens"].copy_(torch.randint(0, 3, args["kv_lens"].shape, generator=g))
        want = args["out"].clone()
        merge_split_kv_reference(want, args["partial"], args["lse"], args["kv_lens"],
                                 block_size=2, seq_len=3)
        merge_split_kv_(**args)
        assert_merged_close(args["out"], want)


def test_one_thread_per_row_and_wide_ctas(monkeypatch):
    # 8 threads a CTA at D = 64 is one row per CTA; 32 threads hold four rows.
    monkeypatch.setattr(_launch, "MAX_THREADS", 32)
    _compare(torch.float16, S=2, nb=2, b=3, H=3, D=64, seq_len=5, seed=10)
    monkeypatch.setattr(_launch, "MAX_BLOCKS", 1)
    _compare(torch.bfloat16, S=3, nb=1, b=5, H=3, D=128, seed=11)


def test_large_statistics_do_not_overflow():
    args, _ = merge_case(CPU, torch.bfloat16, S=2, nb=1, b=2, H=3, D=64, empty_every=0,
                         seed=12)
    args["lse"].copy_(torch.tensor([80.0, 90.0])[:, None, None].expand(2, 3, 2))
    merge_split_kv_(**args)
    w1 = 1 / (1 + math.exp(-10.0))
    want = ((1 - w1) * args["partial"][0].float() + w1 * args["partial"][1].float())
    torch.testing.assert_close(args["out"].float(), want, rtol=2 ** -7, atol=1e-5)


@pytest.mark.parametrize("order", ["rising", "falling"])
def test_later_rounds_rescale_earlier_sums(order):
    # S = 9 is three rounds of four; with rising statistics every round raises the
    # running maximum (earlier sums rescaled), with falling ones no round does, and in
    # block 0 the first round's sub-rows are all empty (nothing to rescale yet).
    args, _ = merge_case(CPU, torch.float16, S=9, nb=2, b=2, H=2, D=64, empty_every=0,
                         garbage=False, seed=21)
    steps = torch.arange(9, dtype=torch.float32) * 3
    stats = steps if order == "rising" else steps.flip(0)
    args["lse"].copy_(stats.repeat_interleave(2)[:, None, None].expand(18, 2, 2))
    lens = args["kv_lens"].view(9, 2)  # [S, nb]
    lens[:, 1] = 500
    lens[:4, 0] = 0  # block 0: the first round empty, its words NaN
    args["partial"][:4, :2] = float("nan")
    want = dict(args, out=args["out"].clone())
    merge_split_kv_reference(**want)
    merge_split_kv_(**args)
    assert_merged_close(args["out"], want["out"])
