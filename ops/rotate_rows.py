"""``rotate_rows_``: rotate every row of a 1-D or 2-D int tensor in place.

Each row becomes ``torch.roll(row, -shift)`` (row[i] takes the old row[(i + shift) % n]).
The shift is a Python int or a one-element device tensor that the kernel reads when it
runs, so a captured CUDA graph rotates by whatever that tensor holds at replay.

Kernel: one block per row (grid-stride over rows on the x dimension, so any number of
rows works), rotation in place by three reversals: reverse [0, k), reverse [k, n),
then reverse the whole row. No scratch memory, any row length, any strides.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from numba import cuda

from ._launch import Kernel, array_arg, blocks_for, int_arg, threads_for, use_kernel
from framekv.specs.checks import check_no_overlap, check_shift_tensor, check_tensor

__all__ = ["rotate_rows_", "rotate_rows_reference"]


@cuda.jit(device=True)
def _reverse(x, row, lo, hi):
    """Reverse x[row, lo:hi) with the threads of this block."""
    half = (hi - lo) // 2
    for i in range(cuda.threadIdx.x, half, cuda.blockDim.x):
        a = lo + i
        b = hi - 1 - i
        t = x[row, a]
        x[row, a] = x[row, b]
        x[row, b] = t


@cuda.jit
def _rotate_rows_kernel(x, shift, shift_from_tensor, k_host):
    # x: [R, n] int32/int64, any strides; shift: [1] int32/int64, read when
    # shift_from_tensor, else k_host (already in [0, n)) is the left rotation.
    n = x.shape[1]
    k = k_host
    if shift_from_tensor:
        # Works for any sign and size of shift, whichever sign convention % has.
        k = ((shift[0] % n) + n) % n
    if k == 0:
        return
    for row in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        # The two partial reversals touch disjoint ranges; the full one needs both.
        _reverse(x, row, 0, k)
        _reverse(x, row, k, n)
        cuda.syncthreads()
        _reverse(x, row, 0, n)
        # The next row is other memory, so it needs no barrier before its first step.


_KERNEL = Kernel(_rotate_rows_kernel)


def rotate_rows_reference(x: torch.Tensor, shift) -> None:
    """Torch reference: ``x[..., :] = roll(x, -shift, -1)`` in place (no host sync for a
    tensor shift). Used on CPU and by tests."""
    n = x.shape[-1]
    if x.numel() == 0:
        return
    if isinstance(shift, torch.Tensor):
        k = torch.remainder(shift.reshape(()).to(torch.int64), n)
    else:
        k = operator.index(shift) % n
    idx = torch.remainder(torch.arange(n, device=x.device) + k, n)  # [n]
    x.copy_(x.index_select(-1, idx))


def _check(x, shift) -> int:
    """Validate; return the host rotation in [0, n) for an int shift (0 for a tensor)."""
    check_tensor("x", x, ndims=(1, 2), layout="[n] or [rows, n]")
    if x.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"x: expected dtype torch.int32 or torch.int64, got {x.dtype}")
    check_no_overlap("x", x)
    if isinstance(shift, torch.Tensor):
        check_shift_tensor("shift", shift, "x", x)
        return 0
    if isinstance(shift, bool) or not hasattr(shift, "__index__"):
        raise ValueError("shift: expected an int or a one-element int32/int64 tensor, "
                         f"got {type(shift).__name__}")
    n = x.shape[-1]
    return operator.index(shift) % n if n else 0


def _is_noop(x: torch.Tensor, shift_tensor: Optional[torch.Tensor], k: int) -> bool:
    return x.numel() == 0 or (shift_tensor is None and k == 0)


def _kernel_args(x: torch.Tensor, shift_tensor: Optional[torch.Tensor], k: int):
    x2 = x if x.dim() == 2 else x.unsqueeze(0)  # [R, n], same memory
    # Without a shift tensor the kernel never reads `shift`: pass row 0 as a stand-in.
    shift = shift_tensor.reshape(1) if shift_tensor is not None else x2[0]
    args = [array_arg(x2), array_arg(shift), int_arg(shift_tensor is not None), int_arg(k)]
    return args, blocks_for(x2.shape[0]), threads_for(x2.shape[1] // 2)


def _run(x: torch.Tensor, shift_tensor: Optional[torch.Tensor], k: int) -> None:
    if _is_noop(x, shift_tensor, k):
        return
    if not use_kernel(x):
        rotate_rows_reference(x, shift_tensor if shift_tensor is not None else k)
        return
    args, grid, block = _kernel_args(x, shift_tensor, k)
    _KERNEL.launch(grid, block, args, x.device)


@torch.library.custom_op("framekv::rotate_rows_", mutates_args=("x",))
def _rotate_rows_op(x: torch.Tensor, shift_tensor: Optional[torch.Tensor],
                    shift_int: int) -> None:
    _run(x, shift_tensor, shift_int)


@_rotate_rows_op.register_fake
def _(x, shift_tensor, shift_int) -> None:
    return None


def rotate_rows_(x: torch.Tensor, shift) -> None:
    """Rotate each row of ``x`` in place: row becomes ``torch.roll(row, -shift)``.

    Args:
        x: [n] or [rows, n] int32/int64 tensor, any strides (no repeated memory).
        shift: a Python int (any sign and size), or a one-element int32/int64 tensor on
            ``x``'s device, read by the kernel when it runs (so a captured graph applies
            the value the tensor holds at replay; its value is not checked).

    Empty rows and an int shift that is a multiple of n launch nothing. Raises
    ValueError naming the bad argument. On CUDA the kernel runs on torch's current
    stream; on CPU the torch reference runs.
    """
    k = _check(x, shift)
    shift_tensor = shift if isinstance(shift, torch.Tensor) else None
    if _is_noop(x, shift_tensor, k):
        return
    _rotate_rows_op(x, shift_tensor, k)
