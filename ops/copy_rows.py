"""``copy_rows_``: ``dst[dst_rows[b]] = src[src_rows[b]]`` for every b, any strides.

A gather into a strided view and a scatter out of one in a single pass: a streaming
coder's cache entry goes from its arena row straight into the steps before a conv's
input in a wider buffer, and back from the buffer's last steps, with no copy between.

dst [S_d, *inner] and src [S_s, *inner] share the inner shape and dtype; every
dimension may have any stride but the last, which is contiguous. The host merges the
inner dimensions the two tensors both lay out back to back (a contiguous entry becomes
one row of all its values; a channel slice of a wider buffer, rows of its channels at
the buffer's stride), leaving at most `MAX_OUTER` of them besides the last.

Kernel: one flat grid-stride loop over every word of the B rows (B x outer x words),
so a few long rows and many short ones both fill the device; each thread splits its
index into (b, outer indices, word) with fp64 reciprocal multiplications
(`_float.quotient`), reads the row ids and moves one word. Values are raw words of the
widest size the alignment of both tensors allows (16 bytes for a bf16 row of 96
channels), so any dtype of 1, 2, 4 or 8 bytes is copied bit for bit. A row id outside
[0, S) writes nothing for that b on the device (the ids are not checked there).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from numba import cuda

from ._float import quotient, reciprocal_bits
from ._launch import (SIMULATOR, Kernel, array_arg, blocks_for, int_arg, pick_word_size,
                      pointer_arg, threads_for, use_kernel)
from framekv.specs.checks import (check_index_list, check_kv_dtype, check_last_dim_contiguous,
                                  check_no_overlap, check_same_device)
from ._words import load_word, store_word

__all__ = ["copy_rows_", "copy_rows_reference", "prepare_copy_rows", "MAX_OUTER"]

#: Inner dimensions besides the last that may remain once the mergeable ones are merged.
MAX_OUTER = 3


@cuda.jit(device=True)
def _split(a, n, inv_bits):
    """(a // n, a % n) for 0 <= a < 2^50; n == 1 (a merged-away dimension) costs nothing."""
    if n == 1:
        return a, a - a
    q = quotient(a, inv_bits)
    return q, a - q * n


@cuda.jit
def _copy_rows_kernel(dst, src, dst_rows, src_rows, has_dst_rows, has_src_rows, total,
                      inv_w, inv_o3, inv_o2, inv_o1):
    # dst: [S_d, O1, O2, O3, W] words; src: [S_s, O1, O2, O3, W] words; dst_rows,
    # src_rows: [B] int64 (stand-ins unless has_*); total = B * O1 * O2 * O3 * W;
    # inv_*: fp64 bits of 1 / W, 1 / O3, 1 / O2, 1 / O1.
    for j in range(cuda.grid(1), total, cuda.gridsize(1)):
        r, w = _split(j, dst.shape[4], inv_w)
        r, i3 = _split(r, dst.shape[3], inv_o3)
        r, i2 = _split(r, dst.shape[2], inv_o2)
        b, i1 = _split(r, dst.shape[1], inv_o1)
        d = dst_rows[b] if has_dst_rows else b
        s = src_rows[b] if has_src_rows else b
        if 0 <= d and d < dst.shape[0] and 0 <= s and s < src.shape[0]:
            store_word(dst, (d, i1, i2, i3, w), load_word(src, (s, i1, i2, i3, w)))


_KERNEL = Kernel(_copy_rows_kernel)
# The simulator's row-list stand-in (it has no bare pointers).
_SIM_STAND_IN = array_arg(torch.zeros(1, dtype=torch.int64)) if SIMULATOR else None


def copy_rows_reference(dst: torch.Tensor, src: torch.Tensor, *,
                        dst_rows: Optional[torch.Tensor] = None,
                        src_rows: Optional[torch.Tensor] = None) -> None:
    """Torch reference of :func:`copy_rows_` (same arguments, in place; any strides, the
    last dimension's too; shapes and rows unchecked). Used on CPU and by tests; with
    both lists it gathers src's rows into a new tensor first."""
    if dst_rows is None:
        if src_rows is None:
            dst.copy_(src)
        else:
            torch.index_select(src, 0, src_rows, out=dst)
        return
    dst.index_copy_(0, dst_rows, src if src_rows is None else src.index_select(0, src_rows))


# --------------------------------------------------------------------------- layout

def merged_dims(dst: torch.Tensor, src: torch.Tensor) -> list[list[int]]:
    """The inner dimensions of dst and src merged where both lay them out back to back:
    [size, dst stride, src stride] per dimension, innermost first (the last dimension,
    stride 1 in both, first); dimensions of size 1 are left out."""
    dims = [[dst.shape[-1], 1, 1]]        # a last dimension of size 1: its stride is moot
    for n, a, b in zip(reversed(dst.shape[1:-1]), reversed(dst.stride()[1:-1]),
                       reversed(src.stride()[1:-1])):
        if n == 1:
            continue
        top = dims[-1]
        if a == top[0] * top[1] and b == top[0] * top[2]:
            top[0] *= n
        else:
            dims.append([n, a, b])
    return dims


def _canonical(dst, src) -> tuple[torch.Tensor, torch.Tensor]:
    """dst and src as [S, O1, O2, O3, L] views of their memory (merged, padded with
    size-1 dimensions)."""
    dims = merged_dims(dst, src)
    dims += [[1, 0, 0]] * (MAX_OUTER + 1 - len(dims))
    shape = [d[0] for d in reversed(dims)]
    views = []
    for t, k in ((dst, 1), (src, 2)):
        strides = [t.stride(0), *(d[k] for d in reversed(dims))]
        views.append(t.as_strided([t.shape[0], *shape], strides, t.storage_offset()))
    return views[0], views[1]


# --------------------------------------------------------------------------- checks

def _check_pair(dst, src) -> None:
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name}: expected at least 2 dimensions [S, *inner], "
                             f"got {t.dim()} (shape {tuple(t.shape)})")
    check_kv_dtype("dst", dst)
    if src.dtype != dst.dtype:
        raise ValueError(f"src: expected dtype {dst.dtype} (the dtype of dst), got {src.dtype}")
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"src: expected shape [S_s, {', '.join(map(str, dst.shape[1:]))}] "
                         f"(dst's inner shape), got {list(src.shape)}")
    check_same_device("src", src, "dst", dst)
    check_last_dim_contiguous("dst", dst)
    check_last_dim_contiguous("src", src)
    check_no_overlap("dst", dst)
    outer = len(merged_dims(dst, src)) - 1
    if outer > MAX_OUTER:
        raise ValueError(f"dst: expected at most {MAX_OUTER} inner dimensions besides the last "
                         f"once those laid out back to back in dst and src are merged, got "
                         f"{outer} (dst strides {tuple(dst.stride())}, src strides "
                         f"{tuple(src.stride())})")


def _rows_count(dst, dst_rows, src_rows) -> int:
    """B: the length of the row lists, else of dst."""
    return (dst_rows if dst_rows is not None else src_rows if src_rows is not None
            else dst).shape[0]


def _check_rows(dst, src, dst_rows, src_rows) -> int:
    """Check the row lists; return B."""
    if dst_rows is not None:
        check_index_list("dst_rows", dst_rows, "dst", dst)
    if src_rows is not None:
        n = None if dst_rows is None else dst_rows.shape[0]
        check_index_list("src_rows", src_rows, "dst", dst, n, "the length of dst_rows")
    B = _rows_count(dst, dst_rows, src_rows)
    for name, rows, t in (("dst", dst_rows, dst), ("src", src_rows, src)):
        if rows is None and t.shape[0] != B:
            raise ValueError(f"{name}: expected {B} rows (B, {name}_rows being absent), got "
                             f"shape {list(t.shape)}")
    return B


def _check_values(dst, src, dst_rows, src_rows) -> None:
    """Row ids on the host (CPU tensors only: reading device ones would sync)."""
    for name, rows, S in (("dst_rows", dst_rows, dst.shape[0]), ("src_rows", src_rows,
                                                                  src.shape[0])):
        if rows is None or rows.numel() == 0 or rows.device.type != "cpu":
            continue
        lo, hi = int(rows.min()), int(rows.max())
        if lo < 0 or hi >= S:
            raise ValueError(f"{name}: expected row ids in [0, {S}) (the rows of "
                             f"{name[:3]}), got values in [{lo}, {hi}]")
    if (dst_rows is not None and dst_rows.device.type == "cpu"
            and torch.unique(dst_rows).numel() != dst_rows.numel()):
        raise ValueError(f"dst_rows: expected distinct row ids, got {dst_rows.tolist()}")


# --------------------------------------------------------------------------- op

def _is_noop(dst, B: int) -> bool:
    return B == 0 or math.prod(dst.shape[1:]) == 0


def _rows_args(dst, dst_rows, src_rows) -> list:
    """The two row lists as kernel arrays; an absent one is a stand-in the kernel never
    reads (the other list, or with neither one int64 over dst's memory)."""
    args = [None if r is None else array_arg(r) for r in (dst_rows, src_rows)]
    stand_in = next((a for a in args if a is not None), None)
    if stand_in is None:
        stand_in = _SIM_STAND_IN if SIMULATOR else pointer_arg(dst.data_ptr(), (1,), (8,), 8)
    return [stand_in if a is None else a for a in args]


def _kernel_args(dst, src, dst_rows, src_rows, B: int):
    d, s = _canonical(dst, src)                           # [S, O1, O2, O3, L] each
    w = pick_word_size(d.shape[4] * d.element_size(), (d, s))
    W = d.shape[4] * d.element_size() // w                # words a row
    total = B * d.shape[1] * d.shape[2] * d.shape[3] * W
    args = [array_arg(d, w), array_arg(s, w), *_rows_args(dst, dst_rows, src_rows),
            int_arg(dst_rows is not None), int_arg(src_rows is not None), int_arg(total),
            *(int_arg(reciprocal_bits(n)) for n in (W, d.shape[3], d.shape[2], d.shape[1]))]
    threads = threads_for(total)
    return args, blocks_for(-(-total // threads)), threads


def _run(dst, src, dst_rows, src_rows) -> None:
    B = _rows_count(dst, dst_rows, src_rows)
    if _is_noop(dst, B):
        return
    if not use_kernel(dst):
        copy_rows_reference(dst, src, dst_rows=dst_rows, src_rows=src_rows)
        return
    args, grid, block = _kernel_args(dst, src, dst_rows, src_rows, B)
    _KERNEL.launch(grid, block, args, dst.device)


@torch.library.custom_op("framekv::copy_rows_", mutates_args=("dst",))
def _copy_rows_op(dst: torch.Tensor, src: torch.Tensor, dst_rows: Optional[torch.Tensor],
                  src_rows: Optional[torch.Tensor]) -> None:
    _run(dst, src, dst_rows, src_rows)


@_copy_rows_op.register_fake
def _(dst, src, dst_rows, src_rows) -> None:
    return None


def copy_rows_(dst: torch.Tensor, src: torch.Tensor, *, dst_rows: Optional[torch.Tensor] = None,
               src_rows: Optional[torch.Tensor] = None) -> None:
    """Copy rows: ``dst[dst_rows[b]] = src[src_rows[b]]`` for b in range(B), in place.

    Args:
        dst: [S_d, *inner] written; any dtype of 1, 2, 4 or 8 bytes (bf16, fp32, fp8,
            ints); any strides (no zero stride over a dimension of size > 1) but the
            last dimension's, which is contiguous. A slice of a wider buffer works.
        src: [S_s, *inner] read: dst's inner shape and dtype, on dst's device, any
            strides but a contiguous last dimension.
        dst_rows: int64 [B] on dst's device, distinct ids in [0, S_d); absent, the
            identity b -> b, B being S_d.
        src_rows: int64 [B] on dst's device, ids in [0, S_s); absent, the identity,
            B being S_s.

    At most `MAX_OUTER` inner dimensions besides the last may remain once those laid out
    back to back in both tensors are merged (module doc). dst's written rows and src's
    read rows must not share memory. Row ids on the device are the caller's: they are
    not read on the host (an id outside [0, S) writes nothing for its b, two equal
    dst ids race); on CPU tensors they are checked. Raises ValueError naming the bad
    argument. On CUDA one kernel on torch's current stream: no host sync and no
    allocation, so it may be captured in a CUDA graph; on CPU the torch reference.
    """
    _check_pair(dst, src)
    B = _check_rows(dst, src, dst_rows, src_rows)
    if dst.device.type == "cpu" and not torch.compiler.is_compiling():
        _check_values(dst, src, dst_rows, src_rows)
    if _is_noop(dst, B):
        return
    _copy_rows_op(dst, src, dst_rows, src_rows)


def prepare_copy_rows(device) -> None:
    """Compile and load the kernel for every word size and row-list form on ``device``
    (a CUDA device; nothing elsewhere), so that no launch compiles: a kernel's first
    launch inside a CUDA graph capture would load a module there, which invalidates
    the capture. Call it outside a capture (a coder does as it builds its arena)."""
    device = torch.device(device)
    if device.type != "cuda" or SIMULATOR:
        return
    rows = torch.zeros(1, dtype=torch.int64, device=device)
    for w in (1, 2, 4, 8, 16):               # a row of w bytes: words of w bytes
        dst = torch.zeros(1, 16, dtype=torch.uint8, device=device)[:, :w]
        src = torch.zeros(1, 16, dtype=torch.uint8, device=device)[:, :w]
        for lists in ({}, {"dst_rows": rows}, {"src_rows": rows},
                      {"dst_rows": rows, "src_rows": rows}):
            copy_rows_(dst, src, **lists)
