"""`framekv demo --model wan-diffusers`: diffusers' Wan transformer rolled out, timed and
checked.

A shipped config (``--config tiny|1.3b``) with random weights, or local weights
(``--weights DIR``: a diffusers folder), loaded as every command loads them
(`framekv.engine.wan.pipeline.WanPipeline`), at the sizes of a preset (``--preset``,
default the config's, or with ``--weights`` that of the shipped config the transformer
matches: `framekv.engine.wan.PRESETS`); a seeded random prompt embedding
stands in for the text encoder's output. It generates ``--chunks`` chunks (one graph replay each on
CUDA), prints per-chunk latency and latent frames per second, then re-runs the first
chunks eagerly and with the reference attention backend and compares the latents.
"""
from __future__ import annotations

import os
import statistics
import sys
import time

import torch

#: A check passes when max|a - b| <= tolerance * max(1, max|b|).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}
#: The same over an fp8 pool or fp8 GEMMs (both sides fp8;
#: `framekv.tools.demo.FP8_CHECK_TOLERANCE`).
FP8_TOLERANCE = 1e-1


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_wan_demo(config: str = "tiny", *, preset=None, weights=None, chunks: int | None = None,
                 device=None, backend=None, check_chunks: int = 2, stream=None,
                 cache_dir=None, kv_dtype=None, gemm_dtype=None) -> dict:
    """Run the demo; returns its report. Text goes to ``stream`` (default stdout).
    ``kv_dtype``: the K/V pool, ``gemm_dtype``: the blocks' GEMMs (`WanRollout`'s; the
    checks' rollouts use the same)."""
    from framekv.engine.wan.pipeline import WanPipeline

    stream = stream or sys.stdout
    t0 = time.perf_counter()
    # The transformer alone: a seeded random embedding stands in for the text encoder.
    pipe = WanPipeline.load(None if weights else config, weights=weights, preset=preset,
                            device=device, text_encoder=False, vae=False)
    model, kw, n = pipe.transformer, pipe.rollout_kwargs(), chunks or 6
    latent, frames = kw["latent_size"], kw["frames_per_chunk"]
    sink, window = kw["sink_frames"], kw["window_frames"]
    kw["kv_dtype"], kw["gemm_dtype"] = kv_dtype, gemm_dtype
    r = pipe.rollout(backend=backend, cache_dir=cache_dir, kv_dtype=kv_dtype,
                     gemm_dtype=gemm_dtype)
    text = torch.randn(1, kw["prompt_tokens"], model.config.text_dim,
                       generator=torch.Generator().manual_seed(0))
    r.set_prompt(text)
    name = pipe.config_name or os.path.basename(os.path.normpath(weights))
    print(f"framekv demo: Wan {name} ({len(model.blocks)} layers, "
          f"{'weights ' + str(weights) if weights else 'random weights'}), device {r.device}, "
          f"backend {r.backend.name}, {str(r.dtype).removeprefix('torch.')}, K/V pool "
          f"{str(r.kv_dtype).removeprefix('torch.')}, GEMMs "
          f"{str(r.gemm_dtype).removeprefix('torch.')}; latent "
          f"{latent[0]}x{latent[1]}, {frames}-frame chunks, sink {sink} + window {window} frames",
          file=stream)
    if r.use_graphs:
        r.capture()
    _sync(r.device)
    setup = time.perf_counter() - t0
    noises = [torch.randn(1, model.config.in_channels, frames, *latent,
                          generator=torch.Generator().manual_seed(100 + i)) for i in range(n)]
    lat, kept = [], []
    for i, noise in enumerate(noises):
        t = time.perf_counter()
        out = r.step(noise)
        _sync(r.device)
        lat.append(time.perf_counter() - t)
        if i < check_chunks:
            kept.append(out)
    report = {"model": "wan-diffusers", "config": config, "device": str(r.device),
              "backend": r.backend.name, "kv_dtype": str(r.kv_dtype).removeprefix("torch."),
              "gemm_dtype": str(r.gemm_dtype).removeprefix("torch."),
              "chunks": n, "frames": n * frames,
              "setup_seconds": setup, "chunk_seconds": lat,
              "median_chunk_seconds": statistics.median(lat),
              "latent_frames_per_second": n * frames / sum(lat)}
    print(f"setup {setup:.2f} s; {n * frames} latent frames in {sum(lat):.3f} s: "
          f"{report['latent_frames_per_second']:.2f} latent frames/s (median chunk "
          f"{report['median_chunk_seconds'] * 1e3:.1f} ms)", file=stream)
    if r.kv_dtype == torch.float8_e4m3fn:
        from .demo import format_saturation

        report["kv_stats"] = r.cache.kv_stats()
        print(format_saturation(report["kv_stats"]), file=stream)
    report["checks"] = _checks(model, r, text, noises[:len(kept)], kept, kw, stream)
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report


def _checks(model, r, text, noises, kept, kw, stream) -> list[dict]:
    """The first chunks again: eagerly, and with the reference attention backend (each
    a new rollout over the same model)."""
    from framekv.engine import WanRollout

    from .demo import uses_fp8

    out = []
    tol = FP8_TOLERANCE if uses_fp8(r) else TOLERANCE.get(r.dtype, 5e-2)
    for name, backend in (("graphs vs eager", r.backend.name), ("vs reference backend", "reference")):
        twin = WanRollout(model, backend=backend, use_graphs=False, **kw)
        twin.set_prompt(text)
        got = [twin.step(n) for n in noises]
        err = max((float((a - b).abs().max()) for a, b in zip(got, kept)), default=0.0)
        bound = tol * max(1.0, max((float(b.abs().max()) for b in kept), default=1.0))
        out.append({"check": name, "max_abs_error": err, "bound": bound,
                    "ok": err == err and err <= bound})
        print(f"  {name}: max abs error {err:.2e} (bound {bound:.1e}) "
              f"{'ok' if out[-1]['ok'] else 'FAILED'}", file=stream)
    return out
