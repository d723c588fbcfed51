"""Backends by name: the one place a name becomes an `AttentionBackend` instance, and
the one place that says what a backend needs to run here."""
from __future__ import annotations

import functools
import importlib.util

import torch

from .backend import AttentionBackend, ReferenceBackend, TorchSDPABackend

#: Names `get_backend` takes.
BACKENDS = ("reference", "cudnn", "sdpa")
#: What to install where cudnn-frontend is missing.
CUDNN_INSTALL = "pip install 'framekv[gpu]' (nvidia-cudnn-frontend)"


@functools.lru_cache(maxsize=None)
def cudnn_frontend_available() -> bool:
    """Whether ``import cudnn`` (nvidia-cudnn-frontend) can work here."""
    return importlib.util.find_spec("cudnn") is not None


def cudnn_head_dim_ok(head_dim: int) -> bool:
    """Whether cuDNN's SDPA takes heads of ``head_dim`` (a multiple of 8, at most 256)."""
    return head_dim % 8 == 0 and 0 < head_dim <= 256


def default_backend(device, head_dim: int | None = None) -> str:
    """The attention backend a device uses unless told otherwise: cudnn on CUDA when
    cudnn-frontend is installed and takes heads of ``head_dim`` (where given), else the
    reference (the GPU extra is optional; small test models have heads cuDNN refuses)."""
    cuda = torch.device(device).type == "cuda"
    fits = head_dim is None or cudnn_head_dim_ok(head_dim)
    return "cudnn" if cuda and fits and cudnn_frontend_available() else "reference"


def get_backend(backend, *, plan_dir=None, device=None) -> AttentionBackend:
    """A backend instance from a name ("reference", "cudnn", "sdpa") or an instance.

    ``plan_dir``: with "cudnn", keep built cuDNN plans in this folder across processes
    (see `CudnnBackend`); ignored for the others and for an instance. ``device``: where
    it will run, checked when given: "cudnn" needs CUDA and cudnn-frontend (the
    ValueError says what to install).
    """
    if isinstance(backend, AttentionBackend):
        return backend
    if backend == "reference":
        return ReferenceBackend()
    if backend == "sdpa":
        return TorchSDPABackend()
    if backend == "cudnn":
        if device is not None and torch.device(device).type != "cuda":
            raise ValueError(f"backend 'cudnn' needs a CUDA device, got {device}: use "
                             "backend='reference' on the CPU")
        if not cudnn_frontend_available():
            raise ValueError(f"backend 'cudnn' needs nvidia-cudnn-frontend, which is not "
                             f"installed: {CUDNN_INSTALL}")
        from .cudnn import CudnnBackend

        return CudnnBackend(plan_dir=plan_dir)
    raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))} or an "
                     f"AttentionBackend, got {backend!r}")
