"""``copy_rows_``'s kernel on a CUDA GPU, bit for bit against a plain loop over the rows
and the torch reference: every layout of `test_copy_rows.rows_case` in every launch
mode, the Wan VAE's folded conv entry ([1, 2, 480, 832, 96] bf16 into channels of a
288-wide buffer, and back) in 16-byte words, a contiguous entry as one merged row, and
CUDA graphs of a load and a store replayed with new row lists and new data; once
`prepare_copy_rows` ran, no launch compiles, so a first launch inside a capture works."""
from __future__ import annotations

import pytest
import torch

from framekv.ops import compile_stats, copy_rows_, copy_rows_reference, prepare_copy_rows
from test_copy_rows import LAYOUTS, call, check_against_loop, rows_case, stamped
from test_copy_rows_sim import WORDS, _word
from test_ops_cases import assert_bits_equal
from test_ops_gpu import _side_stream_warmup

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,C", [(torch.bfloat16, 96), (torch.bfloat16, 3),
                                     (torch.float32, 6)])
def test_kernel_is_the_loop(layout, dtype, C, launch_mode):
    check_against_loop(copy_rows_, CUDA, dtype, layout, S=6, B=3, H=9, W=13, C=C, seed=C)


@pytest.mark.parametrize("dtype,C,layout,pad,word", WORDS)
def test_every_word_size(dtype, C, layout, pad, word):
    kw = dict(S=5, H=7, W=11, C=C, pad=pad)
    assert _word(rows_case(CUDA, dtype, layout, **kw)) == word
    check_against_loop(copy_rows_, CUDA, dtype, layout, **kw)


def _vae_entry(seed=0):
    """The folded conv's entry: an arena of 2 rows [2, 2, 480, 832, 96] and a buffer
    [1, 2, 480, 832, 288] whose channels 96..191 are tap 1."""
    arena = stamped((2, 2, 480, 832, 96), torch.bfloat16, seed, CUDA)
    buf = stamped((1, 2, 480, 832, 288), torch.bfloat16, 12_345 + seed, CUDA)
    return arena, buf


def test_the_vae_entry_in_16_byte_words_both_ways():
    arena, buf = _vae_entry()
    rows = torch.tensor([1], device=CUDA)
    view = buf[..., 96:192]
    assert _word({"dst": view, "src": arena}) == 16
    want = buf.clone()
    copy_rows_reference(want[..., 96:192], arena, src_rows=rows)
    copy_rows_(view, arena, src_rows=rows)
    torch.cuda.synchronize()
    assert_bits_equal(buf, want, "load")
    buf[..., 96:192].add_(1)                      # new values to store
    want_arena = arena.clone()
    want_arena[1] = buf[0, ..., 96:192]
    copy_rows_(arena, view, dst_rows=rows)
    torch.cuda.synchronize()
    assert_bits_equal(arena, want_arena, "store")


def test_a_contiguous_entry_is_one_merged_row():
    arena, _ = _vae_entry(seed=3)
    buf = stamped((1, 4, 480, 832, 96), torch.bfloat16, 777, CUDA)
    rows = torch.tensor([0], device=CUDA)
    want = buf.clone()
    want[:, :2] = arena[0]
    copy_rows_(buf[:, :2], arena, src_rows=rows)
    torch.cuda.synchronize()
    assert_bits_equal(buf, want, "contiguous load")


def test_a_captured_load_and_store_replay_new_rows_and_data():
    S, B, C = 7, 3, 96
    arena = stamped((S, 2, 30, 52, C), torch.bfloat16, 1, CUDA)     # [S, 2, H, W, C]
    buf = stamped((B, 4, 30, 52, 3 * C), torch.bfloat16, 2, CUDA)   # a folded conv's input
    rows = torch.tensor([4, 0, 6], device=CUDA)
    load = lambda: copy_rows_(buf[:, :2, ..., :C], arena, src_rows=rows)            # noqa: E731
    step1 = lambda: copy_rows_(buf[:, :1, ..., C:2 * C], arena[:, 1:], src_rows=rows)  # noqa: E731
    store = lambda: copy_rows_(arena, buf[:, -2:, ..., 2 * C:], dst_rows=rows)      # noqa: E731
    _side_stream_warmup(load, step1, store)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        load()
        step1()
        store()
    g = torch.Generator().manual_seed(0)
    for trial in range(3):
        rows.copy_(torch.randperm(S, generator=g)[:B])
        arena.copy_(stamped(arena.shape, torch.bfloat16, 100 + trial, CUDA))
        buf.copy_(stamped(buf.shape, torch.bfloat16, 200 + trial, CUDA))
        wb, wa = buf.clone(), arena.clone()
        for case in (dict(dst=wb[:, :2, ..., :C], src=wa, src_rows=rows),
                     dict(dst=wb[:, :1, ..., C:2 * C], src=wa[:, 1:], src_rows=rows),
                     dict(dst=wa, src=wb[:, -2:, ..., 2 * C:], dst_rows=rows)):
            call(copy_rows_reference, case)
        graph.replay()
        torch.cuda.synchronize()
        assert_bits_equal(buf, wb, f"buffer, replay {trial}")
        assert_bits_equal(arena, wa, f"arena, replay {trial}")


def test_after_prepare_no_launch_compiles_and_a_capture_may_launch_first():
    prepare_copy_rows(CUDA)
    before = compile_stats()
    arena = torch.zeros(4, 2, 5, 7, 3, dtype=torch.bfloat16, device=CUDA)   # 6-byte rows
    buf = torch.randn(2, 4, 5, 7, 8, dtype=torch.bfloat16, device=CUDA)
    rows = torch.tensor([3, 1], device=CUDA)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):      # the first launch of these forms: inside the capture
        copy_rows_(arena, buf[:, -2:, ..., 1:4], dst_rows=rows)
        copy_rows_(buf[:, :2, ..., 4:7], arena, src_rows=rows)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(arena[[3, 1]], buf[:, -2:, ..., 1:4])
    assert torch.equal(buf[:, :2, ..., 4:7], arena[[3, 1]])
    for dtype, C in ((torch.uint8, 3), (torch.float32, 3), (torch.float64, 3),
                     (torch.bfloat16, 96), (torch.bfloat16, 12)):
        a = torch.zeros(3, 2, C, dtype=dtype, device=CUDA)
        copy_rows_(a, torch.ones(1, 2, C, dtype=dtype, device=CUDA), dst_rows=rows[1:] - 1)
    assert compile_stats() == before
