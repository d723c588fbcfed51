"""What the parts of the bf16-vs-fp8 section (`framekv.bench.fp8`) share: the runs side
by side (bf16, fp8 K/V, fp8 K/V and fp8 GEMMs), rotated timing on a GPU or a CPU,
speed-ups, distributions, peak memory and an fp8 pool's statistics in brief."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from .timing import Flusher, interleaved_device_times, round_order

#: The runs side by side: each name and the (``kv_dtype``, ``gemm_dtype``) a rollout takes
#: for it: the model's dtype throughout, an fp8 K/V pool, an fp8 pool and fp8 GEMMs.
RUNS = {"bf16": (None, None), "fp8": ("fp8", None), "fp8-gemm": ("fp8", "fp8")}
#: The runs that differ in their pool alone: each name and its ``kv_dtype``.
POOLS = {name: kv for name, (kv, gemm) in RUNS.items() if gemm is None}


def subset_of(choices):
    """An argument type: a comma-separated, non-empty subset of ``choices`` (a tuple)."""
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(s for s in text.split(",") if s)
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(f"must be a comma-separated subset of "
                                             f"{list(choices)}, got {text!r}")
        return names
    return parse


def distribution(values: list[float]) -> dict[str, float]:
    """median, p90 and max of ``values`` (p90: the value at 90% of the sorted list)."""
    v = sorted(values)
    return {"median": statistics.median(v), "p90": v[min(len(v) - 1, (9 * len(v)) // 10)],
            "max": v[-1], "n": len(v)}


def quantile(samples: list[float], q: float) -> float:
    """The value at fraction ``q`` of the sorted ``samples`` (no interpolation)."""
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms_summary(us: list[float]) -> dict[str, float]:
    """median, p10 and p90 in ms of µs ``us``, and their count."""
    return {"median": statistics.median(us) / 1e3, "p10": quantile(us, 0.1) / 1e3,
            "p90": quantile(us, 0.9) / 1e3, "n": len(us)}


def rotated_times(calls: dict[str, Callable[[], object]], rounds: int, *, cuda: bool,
                  warmup: int = 1, flush: Flusher | None = None) -> dict[str, list[float]]:
    """µs of each call per round, one call of each per round, each round starting one
    call later (A B, B A, ...): CUDA events (`interleaved_device_times`, ``flush``
    before each) when ``cuda``, else host timers (each call returns with its work done
    on a CPU). ``warmup`` untimed calls of each first."""
    if cuda:
        return interleaved_device_times(calls, rounds, flush, warmup=warmup, rotate=True)
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {n: [] for n in calls}
    for r in range(rounds):
        for name in round_order(list(calls), r, True):
            t0 = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - t0) * 1e6)
    return times


def speedups(bf16: list[float], fp8: list[float], name: str = "fp8") -> dict[str, float]:
    """fp8's speed-up over bf16 from per-round times: ``fp8_speedup`` the ratio of the
    medians (bf16 / fp8: above 1, fp8 is faster) and ``fp8_speedup_paired`` the median
    of the per-round ratios (rounds taken side by side); ``name`` for "fp8" in the keys."""
    return {f"{name}_speedup": statistics.median(bf16) / statistics.median(fp8),
            f"{name}_speedup_paired": statistics.median(b / f for b, f in zip(bf16, fp8))}


def run_speedups(times: dict[str, list[float]]) -> dict[str, float]:
    """`speedups` over "bf16" of every other run in ``times`` ("fp8_speedup", ...,
    "fp8_gemm_speedup_paired")."""
    out: dict[str, float] = {}
    for name, us in times.items():
        if name != "bf16":
            out.update(speedups(times["bf16"], us, name.replace("-", "_")))
    return out


def latents_from_bf16(latents: dict[str, list[torch.Tensor]]) -> dict[str, dict]:
    """Per run other than "bf16": its clean latents' relative L2 from bf16's, chunk by
    chunk (``per_chunk``) and their `distribution`."""
    out = {}
    for name, lat in latents.items():
        if name != "bf16":
            rel = [rel_l2(b, a) for a, b in zip(latents["bf16"], lat)]
            out[name] = {**distribution(rel), "per_chunk": rel}
    return out


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in fp32."""
    got, want = got.float(), want.float()
    return float((got - want).norm() / want.norm())


class PeakMeter:
    """torch's peak allocation on a CUDA device over a phase, from its construction to
    `stop` (one meter at a time: each resets torch's peak), above what was allocated
    when the phase began (0 on a CPU): what the phase itself needed at most."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.base, self.stopped = 0, None
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
        self.device = device

    def stop(self) -> int:
        """End the phase; its peak above its start in bytes (also `peak` from now on)."""
        if self.stopped is None:
            self.stopped = self.peak()
        return self.stopped

    def peak(self) -> int:
        """Bytes of the phase's peak above its start (so far, until `stop`)."""
        if self.stopped is not None:
            return self.stopped
        if not self.cuda:
            return 0
        return torch.cuda.max_memory_allocated(self.device) - self.base


def fp8_pool_stats(stats: dict) -> dict:
    """`CausalKVCache.kv_stats` in brief: saturated values (all, and [L][K, V]), the
    largest |K| and |V| seen, and the range of the K and V scales."""
    def span(kind: int) -> list[float]:
        values = [s for layer in stats["scales"] for s in layer[kind]]
        return [min(values), max(values)]
    return {"saturated": sum(k + v for k, v in stats["saturated"]),
            "saturated_per_layer": stats["saturated"],
            "amax": {"k": max(max(row[0]) for row in stats["amax"]),
                     "v": max(max(row[1]) for row in stats["amax"])},
            "scales": {"k": span(0), "v": span(1)}}


def saturation_line(f: dict) -> str:
    """One line of `fp8_pool_stats`: a WARNING when any value saturated."""
    sat = f"{f['saturated']} values saturated"
    if f["saturated"]:
        sat = f"WARNING: {sat} (clamped to +-448; per layer K/V {f['saturated_per_layer']})"
    (k0, k1), (v0, v1) = f["scales"]["k"], f["scales"]["v"]
    return (f"fp8 pool: {sat}; largest |K| {f['amax']['k']:.3g}, |V| {f['amax']['v']:.3g}; "
            f"scales K {k0:.3g}..{k1:.3g}, V {v0:.3g}..{v1:.3g}")


def latents_line(f: dict, name: str = "fp8") -> str:
    """A run's clean latents against bf16's (``f["latents_rel_l2"]``), one line."""
    d = f["latents_rel_l2"]
    return (f"{name} latents vs bf16, relative L2 over {d['n']} chunks: median "
            f"{d['median']:.2e}, p90 {d['p90']:.2e}, max {d['max']:.2e}")
