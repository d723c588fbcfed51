"""``scatter_kv_slots_``: write the K/V of T tokens into one or two slots of a pool layer.

One kernel reads K and V of each token once, from a source with any token and head
stride (K or V as a slice of a fused QKV tensor needs no copy), and writes them to the
token's destination slot and, optionally, to a second one (a block's own tokens go to
their shared slot and to the block's private slots). The slot lists have a fixed
length, padded with -1, so one list serves forwards of fewer tokens and a captured
graph replays whatever the lists hold.

Kernel: one block per entry (grid-stride over entries); the block's threads stride
over the token's H x words. Values are moved as raw words of the widest size that
alignment allows (16 bytes at the seed geometry), so any dtype of 1, 2, 4 or 8 bytes
works bit for bit.
"""
from __future__ import annotations

from typing import Optional

import torch
from numba import cuda

from ._launch import (Kernel, array_arg, blocks_for, int_arg, pick_word_size, threads_for,
                      use_kernel)
from framekv.specs.checks import (check_index_list, check_last_dim_contiguous, check_pool_pair,
                        check_same_device, check_tensor)
from ._words import load_word, store_word

__all__ = ["scatter_kv_slots_", "scatter_kv_slots_reference", "bind_scatter_kv_slots",
           "ScatterKVSlots"]


@cuda.jit
def _scatter_kv_slots_kernel(k_pool, v_pool, k, v, dst, dst2, src_rows, has_dst2,
                             has_src_rows):
    # k_pool, v_pool: [slots, H, W] words; k, v: [T, H, W] words;
    # dst, dst2, src_rows: [E] int64 (dst2/src_rows are stand-ins unless has_*).
    T = k.shape[0]
    W = k.shape[2]
    HW = k.shape[1] * W
    for e in range(cuda.blockIdx.x, dst.shape[0], cuda.gridDim.x):
        row = src_rows[e] if has_src_rows else e
        d1 = dst[e]
        d2 = dst2[e] if has_dst2 else -1
        if row < 0 or row >= T or (d1 < 0 and d2 < 0):
            continue
        for j in range(cuda.threadIdx.x, HW, cuda.blockDim.x):
            h = j // W
            w = j - h * W
            kw = load_word(k, (row, h, w))
            vw = load_word(v, (row, h, w))
            if d1 >= 0:
                store_word(k_pool, (d1, h, w), kw)
                store_word(v_pool, (d1, h, w), vw)
            if d2 >= 0:
                store_word(k_pool, (d2, h, w), kw)
                store_word(v_pool, (d2, h, w), vw)


_KERNEL = Kernel(_scatter_kv_slots_kernel)


def scatter_kv_slots_reference(k_pool, v_pool, k, v, dst, dst2=None, src_rows=None) -> None:
    """Torch reference of :func:`scatter_kv_slots_` (same arguments, in place). Used on
    CPU and by tests; it synchronises on CUDA (boolean masks)."""
    T, E = k.shape[0], dst.shape[0]
    rows = src_rows if src_rows is not None else torch.arange(E, device=dst.device)  # [E]
    valid = (rows >= 0) & (rows < T)
    for slots in (dst, dst2):
        if slots is None:
            continue
        keep = valid & (slots >= 0)
        d, r = slots[keep], rows[keep]
        k_pool[d] = k[r]
        v_pool[d] = v[r]


def _check_pools(k_pool, v_pool) -> None:
    check_pool_pair(k_pool, v_pool, ndims=3, layout="[slots, H, D]")


def _check_kv(k_pool, k, v) -> None:
    _, H, D = k_pool.shape
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, ndims=(3,), layout="[T, H, D]")
        if t.dtype != k_pool.dtype:
            raise ValueError(f"{name}: expected dtype {k_pool.dtype} (the pool's), "
                             f"got {t.dtype}")
        if t.shape[1] != H or t.shape[2] != D:
            raise ValueError(f"{name}: expected shape [T, {H}, {D}] (the pool's H and D), "
                             f"got {tuple(t.shape)}")
        check_same_device(name, t, "k_pool", k_pool)
        check_last_dim_contiguous(name, t)
    if v.shape != k.shape:
        raise ValueError(f"v: expected shape {tuple(k.shape)} (the shape of k), "
                         f"got {tuple(v.shape)}")


def _check_slots(k_pool, dst, dst2, src_rows) -> None:
    check_index_list("dst", dst, "k_pool", k_pool)
    E = dst.shape[0]
    if dst2 is not None:
        check_index_list("dst2", dst2, "k_pool", k_pool, E, "the length of dst")
    if src_rows is not None:
        check_index_list("src_rows", src_rows, "k_pool", k_pool, E, "the length of dst")


def _check_rows(dst, src_rows, k) -> None:
    if src_rows is None and dst.shape[0] != k.shape[0]:
        raise ValueError(f"dst: expected length {k.shape[0]} (T, the tokens of k, since "
                         f"src_rows is not given), got {dst.shape[0]}")


def _word(k_pool, tensors, start: int = 16) -> int:
    return pick_word_size(k_pool.shape[2] * k_pool.element_size(), tensors, start)


def _slot_args(dst, dst2, src_rows) -> list:
    # Absent lists become stand-ins (dst) that the kernel never reads.
    return [array_arg(dst), array_arg(dst2 if dst2 is not None else dst),
            array_arg(src_rows if src_rows is not None else dst),
            int_arg(dst2 is not None), int_arg(src_rows is not None)]


def _launch_config(k_pool, E: int, word: int) -> tuple[int, int]:
    words = k_pool.shape[1] * (k_pool.shape[2] * k_pool.element_size() // word)
    return blocks_for(E), threads_for(words)


def _run(k_pool, v_pool, k, v, dst, dst2, src_rows) -> None:
    if dst.shape[0] == 0 or k.shape[0] == 0 or k.shape[1] == 0 or k.shape[2] == 0:
        return
    if not use_kernel(k_pool):
        scatter_kv_slots_reference(k_pool, v_pool, k, v, dst, dst2, src_rows)
        return
    w = _word(k_pool, (k_pool, v_pool, k, v))
    args = [array_arg(k_pool, w), array_arg(v_pool, w), array_arg(k, w), array_arg(v, w),
            *_slot_args(dst, dst2, src_rows)]
    grid, block = _launch_config(k_pool, dst.shape[0], w)
    _KERNEL.launch(grid, block, args, k_pool.device)


@torch.library.custom_op("framekv::scatter_kv_slots_", mutates_args=("k_pool", "v_pool"))
def _scatter_kv_slots_op(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, dst: torch.Tensor, dst2: Optional[torch.Tensor],
                         src_rows: Optional[torch.Tensor]) -> None:
    _run(k_pool, v_pool, k, v, dst, dst2, src_rows)


@_scatter_kv_slots_op.register_fake
def _(k_pool, v_pool, k, v, dst, dst2, src_rows) -> None:
    return None


def scatter_kv_slots_(k_pool: torch.Tensor, v_pool: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, dst: torch.Tensor, dst2: Optional[torch.Tensor] = None,
                      src_rows: Optional[torch.Tensor] = None) -> None:
    """Write K/V of tokens into pool slots: for each entry e with source row
    ``r = src_rows[e]`` (or ``e``) in [0, T), ``k_pool[dst[e]] = k[r]`` and
    ``v_pool[dst[e]] = v[r]``, and the same for ``dst2[e]``; negative slots are skipped.

    Args:
        k_pool, v_pool: [slots, H, D] one layer of the pool, same dtype (any of 1, 2, 4
            or 8 bytes) and shape; D contiguous, other strides free.
        k, v: [T, H, D] the pool's dtype; any token and head strides, D contiguous
            (e.g. slices of a fused QKV tensor).
        dst: int64 [E] destination slots (-1 = skip). Without ``src_rows``, E must be T.
        dst2: optional int64 [E] second destination slots (-1 = skip).
        src_rows: optional int64 [E] source row of entry e; rows outside [0, T) skip it.

    Device-side slot ids are the caller's responsibility: they are not range-checked
    on the device (an id >= slots writes out of bounds), and two entries with one
    destination race. Raises ValueError naming the bad argument. One kernel on torch's
    current stream for CUDA tensors; the torch reference on CPU.
    """
    _check_pools(k_pool, v_pool)
    _check_kv(k_pool, k, v)
    _check_slots(k_pool, dst, dst2, src_rows)
    _check_rows(dst, src_rows, k)
    _scatter_kv_slots_op(k_pool, v_pool, k, v, dst, dst2, src_rows)


class ScatterKVSlots:
    """:func:`scatter_kv_slots_` bound to a pool layer and its slot lists; a call
    ``(k, v)`` checks only k and v and launches with the bound arguments converted once.
    Keep the bound tensors alive and in place (their contents may change freely)."""

    def __init__(self, k_pool, v_pool, dst, dst2=None, src_rows=None):
        _check_pools(k_pool, v_pool)
        _check_slots(k_pool, dst, dst2, src_rows)
        self._tensors = (k_pool, v_pool, dst, dst2, src_rows)
        self._kernel = use_kernel(k_pool)
        self._pool_word = _word(k_pool, (k_pool, v_pool))
        self._pools: dict = {}  # word size -> converted (k_pool, v_pool)
        if self._kernel:
            self._slots = _slot_args(dst, dst2, src_rows)

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Scatter this forward's K/V ([T, H, D], any token/head strides)."""
        k_pool, v_pool, dst, dst2, src_rows = self._tensors
        _check_kv(k_pool, k, v)
        _check_rows(dst, src_rows, k)
        if not self._kernel:
            _run(k_pool, v_pool, k, v, dst, dst2, src_rows)
            return
        if dst.shape[0] == 0 or k.numel() == 0:
            return
        w = _word(k_pool, (k, v), self._pool_word)
        pools = self._pools.get(w)
        if pools is None:
            pools = self._pools[w] = [array_arg(k_pool, w), array_arg(v_pool, w)]
        grid, block = _launch_config(k_pool, dst.shape[0], w)
        _KERNEL.launch(grid, block, [*pools, array_arg(k, w), array_arg(v, w), *self._slots],
                       k_pool.device)


def bind_scatter_kv_slots(k_pool, v_pool, dst, dst2=None, src_rows=None) -> ScatterKVSlots:
    """Bind :func:`scatter_kv_slots_` to a pool layer and slot lists (validated here);
    returns a callable ``(k, v) -> None`` for the hot path."""
    return ScatterKVSlots(k_pool, v_pool, dst, dst2, src_rows)
