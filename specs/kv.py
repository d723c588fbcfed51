"""The shape of a causal K/V cache: what its pool holds per token."""
from __future__ import annotations

from typing import Any

import msgspec

from ._validate import check_choice, check_int, check_power_of_two

#: K/V element types the cache supports, with their size in bytes. The GPU path
#: runs bf16/fp16; float32 exists for the CPU reference path and tests.
DTYPE_SIZES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPES: tuple[str, ...] = tuple(DTYPE_SIZES)

#: Largest page; a page must fit a kernel's shared-memory tile comfortably.
MAX_TOKENS_PER_PAGE = 1024


def check_dtype(owner: str, value: Any) -> None:
    """Raise ValueError unless ``value`` names a supported dtype."""
    check_choice(owner, "dtype", value, DTYPES)


def check_head_dim(owner: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a head size the attention kernels accept."""
    check_int(owner, "head_dim", value, minimum=1)
    # cuDNN and the 16-byte vectorised copies need rows of whole 8-element groups.
    if value % 8:
        raise ValueError(f"{owner}.head_dim must be a multiple of 8, got {value}")


def check_tokens_per_page(owner: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a power of two in [1, MAX_TOKENS_PER_PAGE]."""
    check_power_of_two(owner, "tokens_per_page", value, maximum=MAX_TOKENS_PER_PAGE)


def torch_dtype_of(name: str):
    """The torch dtype called ``name``; torch is imported only when asked for."""
    import torch

    return getattr(torch, name)


class KVSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The arguments of ``framekv.engine.CausalKVCache`` other than pool size and device.

    Attributes:
        num_layers: transformer layers, each with its own K and V.
        num_kv_heads: K/V heads per layer.
        head_dim: elements per head, a multiple of 8.
        dtype: "bfloat16", "float16" or "float32".
        tokens_per_page: tokens in one pool page, a power of two in [1, 1024].
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_page: int

    def __post_init__(self) -> None:
        check_int("KVSpec", "num_layers", self.num_layers, minimum=1)
        check_int("KVSpec", "num_kv_heads", self.num_kv_heads, minimum=1)
        check_head_dim("KVSpec", self.head_dim)
        check_dtype("KVSpec", self.dtype)
        check_tokens_per_page("KVSpec", self.tokens_per_page)

    @property
    def torch_dtype(self):
        """The torch dtype of the pool (imports torch)."""
        return torch_dtype_of(self.dtype)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Pool bytes one token takes across all layers, K and V."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_page(self) -> int:
        """Pool bytes one page takes across all layers, K and V."""
        return self.bytes_per_token * self.tokens_per_page
