"""``fill_pattern_``: write one 1-, 2- or 4-byte value over every element of a 2-D region.

The region is what a CUDA memset writes: ``height`` rows of ``width`` elements of
``element_size`` bytes, the rows ``pitch`` bytes apart. `fill_node_params` gives a
graph kernel node that writes exactly those bytes, so `framekv.graphs.rewrite` can put
kernel nodes where a captured graph holds memset nodes; `fill_pattern_` runs the same
kernel over a tensor (its reference on CPU), which is how the kernel is tested.

``value`` is the memset's value: its low ``8 * element_size`` bits are written (so
0xBEEF and -16657 write the same 2-byte word).

Kernel: one grid-stride loop over the height * width elements, row-major.
"""
from __future__ import annotations

import operator

import torch
from numba import cuda

from ._launch import (SIMULATOR, Kernel, array_arg, blocks_for, int_arg, pointer_arg,
                      threads_for, use_kernel)
from framekv.specs.checks import check_no_overlap, check_tensor

__all__ = ["fill_pattern_", "fill_pattern_reference", "fill_node_params", "ELEMENT_SIZES"]

#: Element sizes a memset writes (cuMemsetD8/D16/D32 and their 2-D forms).
ELEMENT_SIZES = (1, 2, 4)
#: Threads per block and most blocks of a fill node: a memset in a captured graph is
#: small (cuDNN's is one 4-byte word), and a bigger one still finishes in one pass
#: of a grid this size.
NODE_BLOCK = 256
NODE_MAX_BLOCKS = 1024

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32}


@cuda.jit
def _fill_pattern_kernel(dst, value):
    # dst: [height, width] of 1/2/4-byte integers, any row pitch; value: int64 whose
    # low bits the store keeps (the cast to dst's type truncates).
    width = dst.shape[1]
    n = dst.shape[0] * width
    for k in range(cuda.grid(1), n, cuda.gridsize(1)):
        dst[k // width, k % width] = value


_KERNEL = Kernel(_fill_pattern_kernel)


def _signed(value: int, element_size: int) -> int:
    """The low ``8 * element_size`` bits of ``value`` as a signed integer."""
    bits = 8 * element_size
    v = value & ((1 << bits) - 1)
    return v - (1 << bits) if v >> (bits - 1) else v


def fill_pattern_reference(dst: torch.Tensor, value: int) -> None:
    """Torch reference: every element of ``dst`` holds the low bits of ``value``."""
    dst.view(_SIGNED[dst.element_size()]).fill_(_signed(value, dst.element_size()))


def _check(dst, value) -> int:
    check_tensor("dst", dst, ndims=(2,), layout="[height, width]")
    if dst.element_size() not in ELEMENT_SIZES:
        raise ValueError(f"dst: expected elements of {ELEMENT_SIZES} bytes, got {dst.dtype} "
                         f"({dst.element_size()} bytes)")
    check_no_overlap("dst", dst)
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"value: expected an int, got {type(value).__name__}")
    return operator.index(value)


def fill_pattern_(dst: torch.Tensor, value: int) -> None:
    """Write the low ``8 * element_size`` bits of ``value`` into every element of ``dst``.

    Args:
        dst: [height, width] tensor of 1-, 2- or 4-byte elements, any strides (no
            repeated memory); any dtype of those sizes (the bits are written).
        value: an int (its low bits are written).

    On CUDA the kernel runs on torch's current stream; on CPU the torch reference (the
    kernel under numba's simulator). Raises ValueError naming the bad argument.
    """
    value = _check(dst, value)
    if dst.numel() == 0:
        return
    if not use_kernel(dst):
        fill_pattern_reference(dst, value)
        return
    args = [array_arg(dst.view(_SIGNED[dst.element_size()])),
            int_arg(_signed(value, dst.element_size()))]
    n = dst.numel()
    _KERNEL.launch(blocks_for(n), threads_for(n), args, dst.device)


def fill_node_params(ptr: int, height: int, width: int, pitch: int, element_size: int,
                     value: int, device_index: int):
    """``CUDA_KERNEL_NODE_PARAMS`` of a kernel node writing what a memset node with
    these parameters writes: ``height`` rows of ``width`` elements of ``element_size``
    bytes from device address ``ptr``, rows ``pitch`` bytes apart (ignored for one
    row), each the low bits of ``value``. The kernel is compiled (or loaded from the
    disk cache) for device ``device_index`` on first use. CUDA only."""
    if SIMULATOR:
        raise RuntimeError("fill_node_params builds a CUDA graph node: not under the simulator")
    if element_size not in ELEMENT_SIZES:
        raise ValueError(f"element_size: expected one of {ELEMENT_SIZES}, got {element_size!r}")
    if height < 1 or width < 1:
        raise ValueError(f"height, width: expected at least 1 each, got {height} x {width}")
    if height == 1:
        pitch = width * element_size  # a 1-D memset may report any pitch
    args = [pointer_arg(ptr, (height, width), (pitch, element_size), element_size),
            int_arg(_signed(value, element_size))]
    grid = max(1, min(NODE_MAX_BLOCKS, -(-height * width // NODE_BLOCK)))
    return _KERNEL.node_params(grid, NODE_BLOCK, args, device_index)
