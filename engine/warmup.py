"""Warm-up: capture, before serving, exactly the graphs a rollout replays.

A server builds its engine, captures every graph it will replay, then takes traffic.
`warm_up` does the first two steps for a preset's `Rollout`, through the rollout's own
capture path (`Rollout.capture`: one whole-chunk graph per chunk length), and returns
the rollout, ready to ``prefill()`` and ``step()``, with the report::

    result = warm_up("tiny", cache_dir="/var/cache/framekv")
    print(format_report(result.report))
    result.rollout.prefill()
    latents = result.rollout.step()            # one graph replay

With ``cache_dir`` the numba kernels and cuDNN plans built for the captures are kept on
disk (`framekv.engine.cache_dir`): a later process warming up with the same folder
(``framekv warmup``, ``framekv demo --cache-dir``, a server) builds nothing, and
``result.builds`` says so.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from framekv.graphs import WarmupReport
from framekv.specs import Preset, load_preset

from .cache_dir import build_counts
from .rollout import Rollout

__all__ = ["WarmupResult", "warm_up"]


class WarmupResult(NamedTuple):
    """What `warm_up` returns.

    Attributes:
        rollout: the `Rollout` whose graphs were captured, at position 0, no prompt.
        report: the capture report (per graph: seconds, memory).
        builds: `framekv.engine.cache_dir.build_counts` after the captures (numba
            kernels compiled / loaded, cuDNN plans built / loaded in this process).
    """

    rollout: Rollout
    report: WarmupReport
    builds: dict[str, int]


def warm_up(preset="tiny", *, device=None, backend=None,
            cache_dir: str | os.PathLike | None = None, progress: bool = True, stream=None,
            debug: bool = False) -> WarmupResult:
    """Build a preset's `Rollout` and capture every graph it replays.

    Args:
        preset: a `Preset`, a preset name or path, or a (ModelSpec, RolloutSpec) pair.
        device: "cpu", "cuda[:N]" or None (cuda if available; on CPU nothing is
            captured: chunks run eagerly, the report lists them).
        backend: attention backend (default: cudnn on CUDA, reference on CPU).
        cache_dir: keep and load kernels and cuDNN plans here (default: the preset's
            ``warmup.cache_dir``, when a `Preset` or preset name is given).
        progress, stream: the progress bar (stderr by default).
        debug: the graph cache's address checks at every replay.
    Raises ValueError for a bad preset or device; `framekv.graphs.GraphCaptureError`
    naming the graph when a capture fails (the rollout is closed then).
    """
    if isinstance(preset, (str, bytes)) or hasattr(preset, "__fspath__"):
        preset = load_preset(preset)
    if cache_dir is None and isinstance(preset, Preset):
        cache_dir = preset.warmup.cache_dir
    rollout = Rollout(preset, device, backend=backend, debug=debug, cache_dir=cache_dir)
    try:
        report = rollout.capture(progress=progress, stream=stream)
    except BaseException:
        rollout.close()
        raise
    return WarmupResult(rollout, report, build_counts(rollout.model.blocks[0].attn.backend))

