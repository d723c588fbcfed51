"""Where the ops' compiled kernels come from: numba's on-disk cache, and a count.

Every `framekv.ops._launch.Kernel` registers here, so that `enable_disk_cache` reaches
kernels made before and after it is called, and obtains each compiled function through
`obtain`, which counts whether numba compiled it or loaded it from the disk cache, and
how long that took (`compile_stats`): what a warm-up with a cache directory saves is
visible without timing it. numba-cuda dispatchers count their disk-cache hits and
misses per signature; the count here reads those counters around each compile.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time

import numba

__all__ = ["CompileStats", "compile_stats", "enable_disk_cache", "obtain", "register"]

_KERNELS: list = []  # every Kernel made, so that enable_disk_cache reaches them all
_DISK_CACHE_DIR: str | None = None


def register(kernel) -> None:
    """Note a new `Kernel` (its ``_dispatcher``) so that the disk cache reaches it."""
    _KERNELS.append(kernel)
    if _DISK_CACHE_DIR is not None:
        kernel._dispatcher.enable_caching()


def enable_disk_cache(path) -> bool:
    """Keep compiled kernels under ``path`` (numba's on-disk cache) from now on.

    A later process that enables the same directory loads each kernel instead of
    compiling it (numba keys entries by source file, signature and device). The
    lean launcher compiles through ``dispatcher.compile``, which reads and writes
    this cache, so turning it on is all it takes; kernels this process compiled
    already are not written. Sets ``NUMBA_CACHE_DIR`` for child processes. Returns
    False under the simulator, which has no cache.
    """
    global _DISK_CACHE_DIR
    if numba.config.ENABLE_CUDASIM:
        return False
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    os.environ["NUMBA_CACHE_DIR"] = path
    # numba-cuda reads its own config object (reloaded from the environment only when
    # it compiles); the cache locator reads it when caching is enabled, so set it now.
    try:
        from numba.cuda.core import config as cuda_config
    except ImportError:  # older numba-cuda reads numba's own config
        cuda_config = numba.config
    cuda_config.CACHE_DIR = numba.config.CACHE_DIR = path
    _DISK_CACHE_DIR = path
    for kernel in _KERNELS:
        kernel._dispatcher.enable_caching()
    return True


@dataclasses.dataclass(frozen=True)
class CompileStats:
    """What `Kernel` compiles cost this process so far.

    Attributes:
        compiled: functions numba compiled.
        loaded: functions numba loaded from its on-disk cache (`enable_disk_cache`).
        seconds: wall time of both, module loads into the context included.
    """

    compiled: int = 0
    loaded: int = 0
    seconds: float = 0.0


_STATS = CompileStats()
_STATS_LOCK = threading.Lock()


def compile_stats() -> CompileStats:
    """Totals over every `Kernel` of this process: how many compiled functions were
    compiled, how many loaded from numba's disk cache, and the seconds both took. A
    function numba already held in memory (compiled for another device or another
    caller of the same kernel) counts in neither."""
    return _STATS


def _cache_counts(dispatcher) -> tuple[int, int] | None:
    """(disk-cache hits, misses) a numba-cuda dispatcher has counted, or None where it
    keeps no such counters."""
    hits, misses = (getattr(dispatcher, "_cache_hits", None),
                    getattr(dispatcher, "_cache_misses", None))
    if hits is None or misses is None:
        stats = getattr(dispatcher, "stats", None)
        hits, misses = getattr(stats, "cache_hits", None), getattr(stats, "cache_misses", None)
    if hits is None or misses is None:
        return None
    return sum(hits.values()), sum(misses.values())


def _record(before, after, seconds: float) -> None:
    """Count one obtained function from the dispatcher's counters around it."""
    global _STATS
    if before is None or after is None:
        kind = "compiled"  # no counters: nothing says it came from the disk
    elif after[1] > before[1]:
        kind = "compiled"
    elif after[0] > before[0]:
        kind = "loaded"
    else:
        return  # numba had it in memory
    with _STATS_LOCK:
        s = _STATS
        _STATS = dataclasses.replace(s, seconds=s.seconds + seconds,
                                     **{kind: getattr(s, kind) + 1})


def obtain(dispatcher, types):
    """The loaded cuda.core kernel of ``dispatcher`` for ``types`` in the current
    context: compiled, or loaded from the disk cache, and counted."""
    before = _cache_counts(dispatcher)
    t0 = time.perf_counter()
    kernel = dispatcher.compile(types)
    function = kernel._codelibrary.get_cufunc().kernel
    _record(before, _cache_counts(dispatcher), time.perf_counter() - t0)
    return function
