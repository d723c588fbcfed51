"""``advance_commit_``: advance a geometry's device-resident rollout counters by one commit.

The counters live in device memory so that a commit needs no host-computed argument:
this kernel turns "commit n tokens" into the new committed count, the new ring base
and the ring rotation that ``rotate_rows_`` then applies to the page table (it reads
the shift from ``counters[2:3]`` when it runs). ``n`` is a constant of the launch, so a
commit of n tokens captured once in a CUDA graph replays for every later chunk; or a
one-element device tensor read when the kernel runs, so one captured commit over a
pool of sequences advances whichever of them the tensor names at replay (0: none).

Counters (int64 [4])::

    [0] C          positions committed so far
    [1] ring_base  lowest logical page held by the ring: max(F, max(P, C - W) // tpp)
    [2] shift      ring_base after - ring_base before, written by every commit
    [3] unused     (keeps the tensor 32 bytes)

Kernel: one thread; the whole update is a handful of integer operations.
"""
from __future__ import annotations

import operator
from typing import Optional

import torch
from numba import cuda

from ._launch import Kernel, array_arg, int_arg, use_kernel
from framekv.specs.checks import check_no_overlap, check_tensor

__all__ = ["advance_commit_", "advance_commit_reference", "NUM_COUNTERS"]

#: Length of the counters tensor.
NUM_COUNTERS = 4


@cuda.jit
def _advance_commit_kernel(counters, n_tensor, n_from_tensor, n, pin, window, tpp, fixed):
    # counters: [4] int64 (C, ring_base, shift, unused); n_tensor: [1] int64, read when
    # n_from_tensor (else a stand-in); the rest int64 scalars.
    if cuda.grid(1) != 0:
        return
    if n_from_tensor:
        n = n_tensor[0]
    c = counters[0] + n
    low = max(pin, c - window)          # first position a future block may see past P
    base = max(fixed, low // tpp)       # low >= 0, so // is a plain floor
    counters[2] = base - counters[1]
    counters[1] = base
    counters[0] = c


_KERNEL = Kernel(_advance_commit_kernel)


def advance_commit_reference(counters: torch.Tensor, n: int, *, pin_tokens: int,
                             window_tokens: int, tokens_per_page: int,
                             fixed_pages: int) -> None:
    """Torch reference of :func:`advance_commit_` (same arguments, in place). Tensor
    arithmetic only, so it does not synchronise on CUDA either."""
    c = counters[0] + (n.reshape(()) if isinstance(n, torch.Tensor) else n)
    low = torch.clamp(c - window_tokens, min=pin_tokens)
    base = torch.clamp(torch.div(low, tokens_per_page, rounding_mode="floor"),
                       min=fixed_pages)
    counters.copy_(torch.stack([c, base, base - counters[1], counters[3]]))  # [4]


# --------------------------------------------------------------------------- checks

def check_int(name: str, value, lo: int = 0) -> int:
    """Raise unless ``value`` is a Python/numpy integer (not a bool) >= ``lo``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name}: expected an integer >= {lo}, got {type(value).__name__}")
    value = operator.index(value)
    if value < lo:
        raise ValueError(f"{name}: expected an integer >= {lo}, got {value}")
    return value


def check_page_args(pin_tokens, tokens_per_page, fixed_pages) -> None:
    """Raise unless tokens_per_page is a power of two and fixed_pages is
    ceil(pin_tokens / tokens_per_page) (the pages holding [0, P))."""
    tpp = check_int("tokens_per_page", tokens_per_page, 1)
    if tpp & (tpp - 1):
        raise ValueError(f"tokens_per_page: expected a power of two, got {tpp}")
    want = -(-check_int("pin_tokens", pin_tokens) // tpp)
    if check_int("fixed_pages", fixed_pages) != want:
        raise ValueError(f"fixed_pages: expected ceil(pin_tokens / tokens_per_page) = "
                         f"{want}, got {fixed_pages}")


def check_counters(counters) -> None:
    """Raise unless ``counters`` is a contiguous int64 tensor of shape [4]."""
    check_tensor("counters", counters, ndims=(1,), layout=f"[{NUM_COUNTERS}]")
    if counters.dtype != torch.int64:
        raise ValueError(f"counters: expected dtype torch.int64, got {counters.dtype}")
    if counters.shape[0] != NUM_COUNTERS:
        raise ValueError(f"counters: expected shape [{NUM_COUNTERS}], "
                         f"got {list(counters.shape)}")
    check_no_overlap("counters", counters)
    if not counters.is_contiguous():
        raise ValueError(f"counters: expected a contiguous tensor, "
                         f"got strides {tuple(counters.stride())}")


# --------------------------------------------------------------------------- op

def _run(counters, n_tensor, n, pin, window, tpp, fixed) -> None:
    if not use_kernel(counters):
        advance_commit_reference(counters, n_tensor if n_tensor is not None else n,
                                 pin_tokens=pin, window_tokens=window, tokens_per_page=tpp,
                                 fixed_pages=fixed)
        return
    # Without a tensor the kernel never reads it: the counters stand in.
    args = [array_arg(counters), array_arg(n_tensor if n_tensor is not None else counters),
            int_arg(n_tensor is not None), int_arg(n), int_arg(pin), int_arg(window),
            int_arg(tpp), int_arg(fixed)]
    _KERNEL.launch(1, 1, args, counters.device)


@torch.library.custom_op("framekv::advance_commit_", mutates_args=("counters",))
def _advance_commit_op(counters: torch.Tensor, n_tensor: Optional[torch.Tensor], n: int,
                       pin_tokens: int, window_tokens: int, tokens_per_page: int,
                       fixed_pages: int) -> None:
    _run(counters, n_tensor, n, pin_tokens, window_tokens, tokens_per_page, fixed_pages)


@_advance_commit_op.register_fake
def _(counters, n_tensor, n, pin_tokens, window_tokens, tokens_per_page, fixed_pages) -> None:
    return None


def advance_commit_(counters: torch.Tensor, n: int, *, pin_tokens: int, window_tokens: int,
                    tokens_per_page: int, fixed_pages: int) -> None:
    """Commit ``n`` tokens on the device: C' = C + n, ring_base' = max(F, max(P, C' - W)
    // tpp), counters[2] = ring_base' - ring_base (the ring rotation), in place.

    Args:
        counters: int64 [4] contiguous (C, ring_base, shift, unused), on any device.
        n: tokens committed, an integer >= 0 (a constant of the launch; a captured
            graph commits the same n on every replay), or a one-element int64 tensor
            on counters' device read when the kernel runs (its value, >= 0, is the
            caller's: it is not read on the host).
        pin_tokens: P >= 0. window_tokens: W >= 0.
        tokens_per_page: tpp, a power of two.
        fixed_pages: F = ceil(P / tpp).

    The counters' values are the caller's responsibility (they are not read on the
    host). Raises ValueError naming the bad argument. On CUDA one single-thread kernel
    on torch's current stream (no sync, capturable); on CPU the torch reference.
    """
    check_counters(counters)
    n_tensor = None
    if isinstance(n, torch.Tensor):
        n_tensor, n = _check_n_tensor(n, counters), 0
    else:
        n = check_int("n", n)
    check_page_args(pin_tokens, tokens_per_page, fixed_pages)
    window = check_int("window_tokens", window_tokens)
    _advance_commit_op(counters, n_tensor, n, operator.index(pin_tokens), window,
                       operator.index(tokens_per_page), operator.index(fixed_pages))


def _check_n_tensor(n: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    if n.dtype != torch.int64 or n.numel() != 1:
        raise ValueError(f"n: expected an integer or a one-element int64 tensor, got a "
                         f"{n.dtype} tensor of shape {list(n.shape)}")
    if n.device != counters.device:
        raise ValueError(f"n: expected a tensor on {counters.device} (counters' device), "
                         f"got {n.device}")
    return n.reshape(1)
