"""Argument checks shared by the op wrappers.

Every failure is a ``ValueError`` whose message starts with the argument's name and
gives what was expected and what came, e.g. ``dst: expected dtype torch.int64, got
torch.int32``. The checks read only metadata (shape, stride, dtype, device), so they
also run while torch.compile traces a caller.
"""
from __future__ import annotations

import torch

__all__ = ["check_tensor", "check_same_device", "check_kv_dtype", "check_last_dim_contiguous",
           "check_no_overlap", "check_index_list", "check_shift_tensor"]


def check_tensor(name: str, value, *, ndims: tuple[int, ...], layout: str = "") -> torch.Tensor:
    """Raise unless ``value`` is a tensor with one of ``ndims`` dimensions."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if value.dim() not in ndims:
        want = " or ".join(str(n) for n in ndims)
        shape = f" {layout}" if layout else ""
        raise ValueError(f"{name}: expected {want} dimensions{shape}, "
                         f"got {value.dim()} (shape {tuple(value.shape)})")
    return value


def check_same_device(name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise unless ``value`` lives on ``ref``'s device."""
    if value.device != ref.device:
        raise ValueError(f"{name}: expected device {ref.device} (the device of {ref_name}), "
                         f"got {value.device}")


def check_kv_dtype(name: str, value: torch.Tensor) -> None:
    """Raise unless ``value``'s dtype can be moved as raw words (1, 2, 4 or 8 bytes)."""
    dt = value.dtype
    if dt == torch.bool or dt.is_complex or dt.itemsize not in (1, 2, 4, 8):
        raise ValueError(f"{name}: expected a real dtype of 1, 2, 4 or 8 bytes "
                         f"(e.g. torch.bfloat16), got {dt}")


def check_last_dim_contiguous(name: str, value: torch.Tensor) -> None:
    """Raise unless the last dimension (the head dimension) has stride 1."""
    if value.shape[-1] > 1 and value.stride(-1) != 1:
        raise ValueError(f"{name}: expected a contiguous last dimension (stride 1), "
                         f"got strides {tuple(value.stride())}")


def check_no_overlap(name: str, value: torch.Tensor) -> None:
    """Raise if a written tensor repeats memory (a zero stride over a dimension > 1)."""
    for size, stride in zip(value.shape, value.stride()):
        if size > 1 and stride == 0:
            raise ValueError(f"{name}: expected no zero strides on dimensions of size > 1 "
                             f"(it is written), got shape {tuple(value.shape)} "
                             f"strides {tuple(value.stride())}")


def check_index_list(name: str, value, ref_name: str, ref: torch.Tensor,
                     length: int | None = None, length_name: str = "") -> torch.Tensor:
    """Raise unless ``value`` is a 1-D int64 tensor on ``ref``'s device, of ``length``."""
    check_tensor(name, value, ndims=(1,), layout="[E]")
    if value.dtype != torch.int64:
        raise ValueError(f"{name}: expected dtype torch.int64, got {value.dtype}")
    check_same_device(name, value, ref_name, ref)
    if length is not None and value.shape[0] != length:
        raise ValueError(f"{name}: expected length {length} ({length_name}), "
                         f"got {value.shape[0]}")
    return value


def check_shift_tensor(name: str, value: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise unless ``value`` is a one-element int32/int64 tensor on ``ref``'s device."""
    if value.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected dtype torch.int32 or torch.int64, got {value.dtype}")
    if value.numel() != 1:
        raise ValueError(f"{name}: expected one element, got {value.numel()} "
                         f"(shape {tuple(value.shape)})")
    check_same_device(name, value, ref_name, ref)


def check_pool_pair(k_pool, v_pool, *, ndims: int, layout: str) -> None:
    """Raise unless k_pool / v_pool are matching writable K/V pools of ``layout``."""
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        check_tensor(name, pool, ndims=(ndims,), layout=layout)
        check_kv_dtype(name, pool)
        check_last_dim_contiguous(name, pool)
        check_no_overlap(name, pool)
    if v_pool.dtype != k_pool.dtype:
        raise ValueError(f"v_pool: expected dtype {k_pool.dtype} (the dtype of k_pool), "
                         f"got {v_pool.dtype}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool: expected shape {tuple(k_pool.shape)} (the shape of "
                         f"k_pool), got {tuple(v_pool.shape)}")
    check_same_device("v_pool", v_pool, "k_pool", k_pool)
