"""Where work runs: a torch device from what a caller passed, checked once.

Every entry point that takes a ``device`` (the cache, the graph cache, the rollout,
the command line) resolves it here, so that a name torch does not know, a device type
framekv does not run on, or CUDA on a machine without it is one clear ValueError
rather than whatever torch raises later.
"""
from __future__ import annotations

import torch

__all__ = ["resolve_device"]


def resolve_device(device=None, *, name: str = "device") -> torch.device:
    """``device`` as a torch device: "cpu", "cuda" or "cuda:N" (a `torch.device` too);
    None is cuda when a GPU is visible, else cpu. A CUDA device gets its index.

    Raises ValueError naming ``name``, what is accepted and what was given: an unknown
    name, a device type other than cpu and cuda, CUDA on a machine without it, an index
    past the visible GPUs.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name} must be cpu or cuda[:N], got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be cpu or cuda[:N], got {device!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{name} {str(device)!r}: CUDA is not available on this machine")
        count = torch.cuda.device_count()
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= count:
            raise ValueError(f"{name} {str(device)!r}: this machine has {count} CUDA "
                             f"device(s), cuda:0 to cuda:{count - 1}")
        dev = torch.device("cuda", index)
    return dev
