"""``copy_rows_``'s kernel under numba's CUDA simulator, bit for bit against a plain loop
over the rows: every layout of `test_copy_rows.rows_case` (channel slices of a wider
buffer read and written, three inner dimensions that cannot merge, row lists out of
order or absent), rows whose bytes pick every word size (16 down to 1: 3 and 6
channels among them), bf16, fp32 and one-byte values, the parents compared whole so a
write beside dst's rows fails; a row id out of range on the device writes nothing.
Run in its own process: ``NUMBA_ENABLE_CUDASIM=1 python -m pytest -m sim``."""
from __future__ import annotations

import pytest
import torch

from framekv.ops import _launch, copy_rows_
from framekv.ops.copy_rows import _canonical, _run
from test_copy_rows import LAYOUTS, check_against_loop, rows_case
from test_ops_cases import assert_bits_equal

pytestmark = pytest.mark.sim

# (dtype, channels, layout, the folded buffer's padding, the word size it moves)
WORDS = [
    (torch.float32, 8, "contiguous", 2, 16),      # one merged row
    (torch.bfloat16, 8, "load_folded", 0, 16),    # rows of 16 bytes, 48 apart
    (torch.bfloat16, 8, "store_folded", 0, 16),
    (torch.float32, 4, "load_folded", 2, 8),
    (torch.bfloat16, 6, "step1", 2, 4),
    (torch.float32, 3, "store_folded", 2, 4),
    (torch.bfloat16, 3, "store_folded", 2, 2),
    (torch.int8, 4, "step1", 2, 2),
    (torch.int8, 3, "load_folded", 2, 1),
]


def _word(case) -> int:
    d, s = _canonical(case["dst"], case["src"])
    return _launch.pick_word_size(d.shape[-1] * d.element_size(), (d, s))


def test_kernel_runs_in_the_simulator():
    assert _launch.SIMULATOR and _launch.use_kernel(torch.zeros(1))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype,C", [(torch.bfloat16, 3), (torch.float32, 6)])
def test_kernel_is_the_loop(layout, dtype, C):
    check_against_loop(copy_rows_, "cpu", dtype, layout, S=4, H=2, W=3, C=C, seed=C)


@pytest.mark.parametrize("dtype,C,layout,pad,word", WORDS)
def test_every_word_size(dtype, C, layout, pad, word):
    assert _word(rows_case("cpu", dtype, layout, S=4, H=2, W=2, C=C, pad=pad)) == word
    check_against_loop(copy_rows_, "cpu", dtype, layout, S=4, H=2, W=2, C=C, pad=pad)


def test_a_row_id_out_of_range_on_the_device_writes_nothing_for_its_row():
    # The public op refuses it on CPU tensors; the kernel's own guard, reached directly.
    got, want = (rows_case("cpu", torch.bfloat16, "both", S=4, H=2, W=2, C=8) for _ in range(2))
    for c in (got, want):
        c["dst_rows"][1] = c["dst"].shape[0]
        c["src_rows"][2] = -1
    _run(got["dst"], got["src"], got["dst_rows"], got["src_rows"])
    d, s = want["dst"], want["src"]
    d[want["dst_rows"][0]] = s[want["src_rows"][0]]          # b = 0 alone is in range
    assert_bits_equal(got["parents"][0], want["parents"][0], "out of range")
