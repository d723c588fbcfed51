"""Backends by name: the one place a name becomes an `AttentionBackend` instance."""
from __future__ import annotations

from .backend import AttentionBackend, ReferenceBackend, TorchSDPABackend

#: Names `get_backend` takes.
BACKENDS = ("reference", "cudnn", "sdpa")


def get_backend(backend, *, plan_dir=None) -> AttentionBackend:
    """A backend instance from a name ("reference", "cudnn", "sdpa") or an instance.

    ``plan_dir``: with "cudnn", keep built cuDNN plans in this folder across processes
    (see `CudnnBackend`); ignored for the others and for an instance.
    """
    if isinstance(backend, AttentionBackend):
        return backend
    if backend == "reference":
        return ReferenceBackend()
    if backend == "sdpa":
        return TorchSDPABackend()
    if backend == "cudnn":
        from .cudnn import CudnnBackend

        return CudnnBackend(plan_dir=plan_dir)
    raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))} or an "
                     f"AttentionBackend, got {backend!r}")
