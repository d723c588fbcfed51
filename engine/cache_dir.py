"""On-disk caches of what a process builds before it can replay: compiled numba kernels
and built cuDNN plans, under one folder::

    cache_dir/numba/    numba's on-disk cache (every framekv kernel, keyed by source,
                        signature and device)
    cache_dir/cudnn/    cuDNN plan files (`framekv.engine.attention.cudnn_graph.PlanFiles`)
                        and the convolutions' choices (`framekv.engine.fused_conv`)

A process that warms up with a cache dir fills it; a later process given the same
folder loads kernels and plans instead of building them, so its captures build nothing
(`build_counts` tells).
"""
from __future__ import annotations

import os

import torch

from framekv import ops
from framekv.ops import _launch

from .fused_conv import use_choice_dir


def use_cache_dir(cache_dir: str | os.PathLike | None, device) -> str | None:
    """Turn on the kernel cache under ``cache_dir/numba`` and the conv choices under
    ``cache_dir/cudnn`` for this process and return the cuDNN plan folder
    ``cache_dir/cudnn`` for the backend, or None when there is no cache dir or nothing
    is compiled on ``device`` (CPU: nothing is touched).

    The kernel cache reaches kernels not compiled yet in this process.
    """
    if cache_dir is None or torch.device(device).type != "cuda":
        return None
    root = os.fspath(cache_dir)
    if not root.strip():
        raise ValueError(f"cache_dir must be a folder path, got {cache_dir!r}")
    _launch.enable_disk_cache(os.path.join(root, "numba"))
    use_choice_dir(os.path.join(root, "cudnn"))
    return os.path.join(root, "cudnn")


def build_counts(backend=None) -> dict[str, int]:
    """What this process built and loaded so far: numba kernels compiled / loaded from
    disk (every kernel of the process) and cuDNN plans built / loaded (``backend``'s,
    when it keeps counts)."""
    stats = ops.compile_stats()
    out = {"numba_compiled": stats.compiled, "numba_loaded": stats.loaded}
    if hasattr(backend, "plans_built"):
        out["cudnn_plans_built"] = backend.plans_built
        out["cudnn_plans_loaded"] = backend.plans_loaded
    return out
