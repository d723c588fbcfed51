"""End to end: the reference model's rollout, framekv against a dense rolling cache.

Variants, all on the same model weights and the same chunk inputs:

    framekv-graphs   `Rollout` over the paged cache, each chunk one graph replay
    framekv-fused-graphs  the same with the model's glue through framekv's fused ops
                     (``glue="fused"``)
    framekv-eager    the same as framekv-graphs, every kernel launched from Python
    dense-eager      `DenseRollout`: contiguous per-layer K/V rolled by copying, torch
                     SDPA (cuDNN) over it; what Self-Forcing-style code runs
    dense-graphs     the same under CUDA graphs, where it captures (once the window
                     is full)

The window is filled first (steady state: every forward sees P + W + T keys), then
each of ``chunks`` chunks is timed host to host with the device drained around it.
Latent frames per second = frames generated / time.
"""
from __future__ import annotations

import time

import msgspec
import torch

from framekv.engine.rollout import Rollout, resolve_specs

from .timing import summary

VARIANTS = ("framekv-graphs", "framekv-fused-graphs", "framekv-eager", "dense-eager",
            "dense-graphs")


def with_window(preset: str, window_frames: int | None):
    """(model spec, rollout spec) of ``preset`` with another window, if given."""
    _, mspec, rspec = resolve_specs(preset)
    if window_frames is not None:
        rspec = msgspec.structs.replace(rspec, window_frames=window_frames)
    return mspec, rspec


def _make(variant: str, pair, model, kv_dtype=None):
    if variant.startswith("framekv"):
        return Rollout(pair, "cuda", use_graphs=variant.endswith("graphs"), model=model,
                       glue="fused" if "fused" in variant else "torch", kv_dtype=kv_dtype)
    from .dense import DenseRollout

    return DenseRollout(pair, "cuda", use_graphs=variant.endswith("graphs"), model=model)


def time_rollout(rollout, chunks: int) -> tuple[list[float], list[torch.Tensor], int]:
    """Fill the window, then time ``chunks`` chunks: (µs per chunk, latents, frames)."""
    spec = rollout.spec
    fill = -(-spec.window_frames // spec.frames_per_chunk) + 1
    rollout.prefill()
    for _ in range(fill):
        rollout.step()
    times, outs = [], []
    for _ in range(chunks):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs.append(rollout.step())
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6)
    return times, outs, sum(o.shape[2] for o in outs)


def measure_e2e(preset: str = "wan-1.3b", *, window_frames: int | None = None, chunks: int = 8,
                variants=VARIANTS, progress=print, kv_dtype=None) -> dict:
    """Per-chunk latency and latent frames per second of each variant (see module doc);
    ``kv_dtype``: the pool of the framekv variants (`Rollout`'s; the dense baselines
    keep the model's dtype)."""
    pair = with_window(preset, window_frames)
    mspec, rspec = pair
    model, results, latents = None, {}, {}
    for variant in variants:
        progress(f"e2e {preset} window {rspec.window_frames} frames: {variant}")
        try:
            rollout = _make(variant, pair, model, kv_dtype)
        except ImportError as exc:
            results[variant] = {"skipped": str(exc)}
            continue
        model = rollout.model
        times, outs, frames = time_rollout(rollout, chunks)
        latents[variant] = outs
        results[variant] = {"chunk_us": summary(times),
                            "frames_per_second": frames / (sum(times) / 1e6),
                            "path": getattr(rollout, "path", "graphs" if rollout.use_graphs else "eager")}
        rollout.close()
    _compare(results, latents)
    return {"preset": preset, "layers": mspec.num_layers, "window_frames": rspec.window_frames,
            "kv_dtype": kv_dtype or "bf16",
            "frames_per_chunk": rspec.frames_per_chunk, "tokens_per_frame": rspec.tokens_per_frame,
            "keys": rspec.prompt_tokens + (rspec.window_frames + rspec.frames_per_chunk)
            * rspec.tokens_per_frame, "chunks": chunks, "variants": results}


def _compare(results: dict, latents: dict) -> None:
    """Max abs difference of each variant's latents from framekv-eager's."""
    base = latents.get("framekv-eager")
    if base is None:
        return
    for name, outs in latents.items():
        results[name]["max_abs_diff_vs_framekv_eager"] = max(
            float((a - b).abs().max()) for a, b in zip(base, outs))


def format_e2e(res: dict) -> str:
    lines = [f"end to end: {res['preset']} ({res['layers']} layers), window "
             f"{res['window_frames']} frames ({res['keys']} keys per forward), "
             f"{res['frames_per_chunk']}-frame chunks, {res['chunks']} timed chunks",
             f"  {'variant':<16}{'ms/chunk':>10}{'p10':>9}{'p90':>9}{'frames/s':>10}"
             f"{'vs eager diff':>15}  path"]
    for name, r in res["variants"].items():
        if "skipped" in r:
            lines.append(f"  {name:<16}skipped: {r['skipped']}")
            continue
        c = r["chunk_us"]
        lines.append(f"  {name:<16}{c['median'] / 1e3:>10.1f}{c['p10'] / 1e3:>9.1f}"
                     f"{c['p90'] / 1e3:>9.1f}{r['frames_per_second']:>10.2f}"
                     f"{r.get('max_abs_diff_vs_framekv_eager', float('nan')):>15.2e}  {r['path']}")
    fk, dn = res["variants"].get("framekv-graphs", {}), res["variants"].get("dense-eager", {})
    if "frames_per_second" in fk and "frames_per_second" in dn:
        lines.append(f"  framekv-graphs / dense-eager frames per second = "
                     f"{fk['frames_per_second'] / dn['frames_per_second']:.3f}")
    return "\n".join(lines)
