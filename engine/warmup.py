"""Warm-up over a real cache: every graph of a `framekv.specs.WarmupPlan`, captured up front.

The plan names (geometry, tokens, block size) triples; this module captures, over
an `AttentionStack` (DESIGN.md, "Graphs"), per (geometry, tokens, block size) every
layer's forward over a static packed QKV input, and per (geometry, tokens) the
``commit(tokens)``:

    result = warm_up(load_preset("tiny"))
    print(format_report(result.report))
    result.cache.open(geometry)            # position 0
    result.graphs.replay(result.stack.forward_key(geometry, tokens, block_size))

State effects (see `framekv.graphs.GraphCache`): warm-up runs the callables, so the
pool and the counters hold warm-up garbage afterwards; `AttentionStack.reset` (run
by `warm_up`) zeroes the pool and puts every geometry back at position 0, and leaves
the cache closed. A rollout opens its geometry and replays.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from framekv import graphs as G
from framekv.ops import _launch
from framekv.specs import Geometry, Preset, WarmupPlan

from .attention_stack import COMMIT_BLOCK, AttentionStack, default_device, kv_dtype_for
from .cache import CausalKVCache

__all__ = ["AttentionStack", "COMMIT_BLOCK", "WarmupResult", "default_device", "kv_dtype_for",
           "plan_geometries", "use_cache_dir", "warm_up", "warmup_items"]

def plan_geometries(plan: WarmupPlan) -> list[Geometry]:
    """The plan's distinct geometries, in plan order."""
    return list(dict.fromkeys(entry.geometry for entry in plan.entries))


def warmup_items(plan: WarmupPlan) -> list[tuple[Geometry, int, int]]:
    """The plan's (geometry, tokens, block size) items, each run of one (geometry,
    tokens) followed by its commit item ``(geometry, tokens, COMMIT_BLOCK)``.

    The commit comes after the forwards so that the report lists it next to them;
    a (geometry, tokens) met again later gets no second commit item.
    """
    items, committed = [], set()
    source = list(plan.items())
    for i, (geometry, tokens, block) in enumerate(source):
        items.append((geometry, tokens, block))
        last_of_run = i + 1 == len(source) or source[i + 1][:2] != (geometry, tokens)
        if last_of_run and (geometry, tokens) not in committed:
            committed.add((geometry, tokens))
            items.append((geometry, tokens, COMMIT_BLOCK))
    return items


class WarmupResult(NamedTuple):
    """What `warm_up` returns: the captured graphs, the cache they run over, the
    report, and the stack (layers, keys) for building inputs and keys later."""

    graphs: G.GraphCache
    cache: CausalKVCache
    report: G.WarmupReport
    stack: AttentionStack


def warm_up(plan: WarmupPlan | Preset, *, device=None, num_heads: int | None = None,
            cache_dir: str | os.PathLike | None = None, progress: bool = True, stream=None,
            backend=None, debug: bool = False) -> WarmupResult:
    """Capture every forward and commit graph of ``plan`` over a fresh attention stack.

    Args:
        plan: a `WarmupPlan`, or a `Preset` (its plan; query heads from its model).
        device: default cuda when visible, else cpu (where graphs run eagerly).
        num_heads: query heads (default: the preset model's, else ``num_kv_heads``).
        cache_dir: keep compiled numba kernels (``cache_dir/numba``) and built cuDNN
            plans (``cache_dir/cudnn``, default backend only) here across processes
            (default ``plan.cache_dir``); see `use_cache_dir`.
        progress, stream: the progress bar (stderr by default).
        backend: attention backend (default "cudnn" on CUDA, "reference" on CPU).
        debug: `GraphCache` debug checks.
    Raises ValueError for a bad plan; `framekv.graphs.GraphCaptureError` naming the
    item when a capture fails (the cache is shut down then).
    """
    plan, num_heads = _plan_and_heads(plan, num_heads)
    device = torch.device(device) if device is not None else default_device()
    chosen_dir = cache_dir if cache_dir is not None else plan.cache_dir
    plan_dir = None
    if chosen_dir and use_cache_dir(chosen_dir, device):
        plan_dir = os.path.join(os.fspath(chosen_dir), "cudnn")
    stack = AttentionStack(plan.kv, plan_geometries(plan), device=device, num_heads=num_heads,
                           backend=backend, plan_dir=plan_dir)
    graph_cache = G.GraphCache(stack.device, debug=debug)
    try:
        report = graph_cache.warmup(warmup_items(plan), stack.builder, progress=progress,
                                    stream=stream)
        stack.reset()
    except BaseException:
        stack.cache.shutdown()  # nothing else holds the pool yet
        raise
    return WarmupResult(graph_cache, stack.cache, report, stack)


def use_cache_dir(cache_dir: str | os.PathLike, device) -> bool:
    """Keep the numba kernels warm-up compiles under ``cache_dir/numba`` (numba's
    on-disk cache; effective for kernels not compiled yet in this process), for later
    processes. (cuDNN plans go to ``cache_dir/cudnn`` through the backend's
    ``plan_dir``.) On CPU nothing is compiled: returns False and touches nothing.
    """
    if torch.device(device).type != "cuda":
        return False
    _launch.enable_disk_cache(os.path.join(os.fspath(cache_dir), "numba"))
    return True


def _plan_and_heads(plan, num_heads):
    if isinstance(plan, Preset):
        return plan.warmup_plan(), plan.model.num_heads if num_heads is None else num_heads
    if not isinstance(plan, WarmupPlan):
        raise ValueError(f"plan must be a WarmupPlan or a Preset, got {type(plan).__name__}")
    return plan, num_heads


