"""``copy_kv_slots_``: pool-to-pool slot copies for every layer, K and V, in one launch.

The commit copies committed tokens into blocks' private pages, and every forward
copies earlier blocks' tokens of the same forward; both lists have a fixed length,
padded with -1, so a captured graph replays whatever they hold.

Kernel: one block per (layer, entry) pair (grid-stride over pairs); the block's
threads stride over H x words of the slot. Raw words of the widest size alignment
allows, as in ``scatter_kv_slots_``.
"""
from __future__ import annotations

import torch
from numba import cuda

from ._launch import Kernel, array_arg, blocks_for, pick_word_size, threads_for, use_kernel
from framekv.specs.checks import check_index_list, check_pool_pair
from ._words import load_word, store_word

__all__ = ["copy_kv_slots_", "copy_kv_slots_reference"]


@cuda.jit
def _copy_kv_slots_kernel(k_pool, v_pool, src, dst):
    # k_pool, v_pool: [L, slots, H, W] words; src, dst: [E] int64 slot ids (< 0 = skip).
    E = src.shape[0]
    H = k_pool.shape[2]
    W = k_pool.shape[3]
    for p in range(cuda.blockIdx.x, k_pool.shape[0] * E, cuda.gridDim.x):
        layer = p // E
        e = p - layer * E
        s = src[e]
        d = dst[e]
        if s < 0 or d < 0:
            continue
        for j in range(cuda.threadIdx.x, H * W, cuda.blockDim.x):
            h = j // W
            w = j - h * W
            kw = load_word(k_pool, (layer, s, h, w))
            vw = load_word(v_pool, (layer, s, h, w))
            store_word(k_pool, (layer, d, h, w), kw)
            store_word(v_pool, (layer, d, h, w), vw)


_KERNEL = Kernel(_copy_kv_slots_kernel)


def copy_kv_slots_reference(k_pool, v_pool, src, dst) -> None:
    """Torch reference of :func:`copy_kv_slots_` (same arguments, in place): all reads
    happen before the writes. Used on CPU and by tests; synchronises on CUDA."""
    keep = (src >= 0) & (dst >= 0)  # [E]
    s, d = src[keep], dst[keep]
    k_pool[:, d] = k_pool[:, s]
    v_pool[:, d] = v_pool[:, s]


def _check(k_pool, v_pool, src, dst) -> None:
    check_pool_pair(k_pool, v_pool, ndims=4, layout="[L, slots, H, D]")
    check_index_list("src", src, "k_pool", k_pool)
    check_index_list("dst", dst, "k_pool", k_pool, src.shape[0], "the length of src")


def _kernel_args(k_pool, v_pool, src, dst):
    w = pick_word_size(k_pool.shape[3] * k_pool.element_size(), (k_pool, v_pool))
    args = [array_arg(k_pool, w), array_arg(v_pool, w), array_arg(src), array_arg(dst)]
    words = k_pool.shape[2] * (k_pool.shape[3] * k_pool.element_size() // w)
    return args, blocks_for(k_pool.shape[0] * src.shape[0]), threads_for(words)


def _is_noop(k_pool, src) -> bool:
    return src.shape[0] == 0 or k_pool.numel() == 0


def _run(k_pool, v_pool, src, dst) -> None:
    if _is_noop(k_pool, src):
        return
    if not use_kernel(k_pool):
        copy_kv_slots_reference(k_pool, v_pool, src, dst)
        return
    args, grid, block = _kernel_args(k_pool, v_pool, src, dst)
    _KERNEL.launch(grid, block, args, k_pool.device)


@torch.library.custom_op("framekv::copy_kv_slots_", mutates_args=("k_pool", "v_pool"))
def _copy_kv_slots_op(k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor,
                      dst: torch.Tensor) -> None:
    _run(k_pool, v_pool, src, dst)


@_copy_kv_slots_op.register_fake
def _(k_pool, v_pool, src, dst) -> None:
    return None


def copy_kv_slots_(k_pool: torch.Tensor, v_pool: torch.Tensor, src: torch.Tensor,
                   dst: torch.Tensor) -> None:
    """Copy slots within the pool for every layer, K and V:
    ``k_pool[:, dst[e]] = k_pool[:, src[e]]`` (and V) for each entry whose src and dst
    are both >= 0.

    Args:
        k_pool, v_pool: [L, slots, H, D] the whole pool, same dtype (any of 1, 2, 4 or
            8 bytes) and shape; D contiguous, other strides (the layer stride too) free.
        src, dst: int64 [E] slot ids; an entry with a negative id is skipped.

    Device-side slot ids are the caller's responsibility: they are not range-checked
    on the device, two entries with one destination race, and an entry reading a slot
    another entry writes races too (src == dst in one entry is fine). Raises ValueError
    naming the bad argument. One kernel on torch's current stream for CUDA tensors;
    the torch reference on CPU.
    """
    _check(k_pool, v_pool, src, dst)
    if _is_noop(k_pool, src):
        return
    _copy_kv_slots_op(k_pool, v_pool, src, dst)
