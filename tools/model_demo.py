"""`framekv demo --model NAME`: a model family's model rolled out, timed and checked
(the reference DiT's own demo is `framekv.tools.demo`).

The family loads the model as every command loads it (`framekv.engine.models`: for
diffusers' Wan a shipped config with random weights, ``--weights DIR`` or a checkpoint,
at the sizes of ``--preset``, by default the config's); its own default prompt (a
seeded random embedding for Wan, standing in for the text encoder's output) is the
prompt. It generates ``--chunks`` chunks (one graph replay each on CUDA), prints
per-chunk latency and latent frames per second, then re-runs the first chunks eagerly
and with the reference attention backend (new runners of the same model) and compares
the latents.
"""
from __future__ import annotations

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


def _name(backend) -> str:
    """A runner's attention backend by name (an instance's, or the name itself)."""
    return getattr(backend, "name", backend)


def run_model_demo(model, *, chunks: int | None = None, backend=None, check_chunks: int = 2,
                   stream=None, cache_dir=None) -> dict:
    """Run the demo of ``model`` (a `LoadedModel`, with its options' pool and GEMMs);
    returns its report. Text goes to ``stream`` (default stdout)."""
    stream = stream or sys.stdout
    t0 = time.perf_counter()
    r = model.rollout(backend=backend, cache_dir=cache_dir)
    n, prompt = chunks or 6, r.default_prompt()
    r.set_prompt(prompt)
    print(f"framekv demo: {model.title}, {r.cache.num_layers} layers, device {r.device}, "
          f"backend {_name(r.backend)}, {str(r.dtype).removeprefix('torch.')}, K/V pool "
          f"{str(r.kv_dtype).removeprefix('torch.')}, GEMMs "
          f"{str(r.gemm_dtype).removeprefix('torch.')}; latent {r.chunk_shape[2]}x"
          f"{r.chunk_shape[3]}, {r.frames_per_chunk}-frame chunks, sink {r.sink_frames} + "
          f"window {r.geometry.window_tokens // r.tokens_per_frame} frames", file=stream)
    if r.use_graphs:
        r.capture()
    _sync(r.device)
    setup = time.perf_counter() - t0
    noises = [torch.randn(1, *r.chunk_shape, generator=torch.Generator().manual_seed(100 + i))
              for i in range(n)]
    lat, kept = [], []
    for i, noise in enumerate(noises):
        t = time.perf_counter()
        out = r.step(noise)
        _sync(r.device)
        lat.append(time.perf_counter() - t)
        if i < check_chunks:
            kept.append(out)
    F = r.frames_per_chunk
    report = {"model": model.family.name, "label": model.family.label(model.options),
              "device": str(r.device), "backend": _name(r.backend),
              "kv_dtype": str(r.kv_dtype).removeprefix("torch."),
              "gemm_dtype": str(r.gemm_dtype).removeprefix("torch."),
              "chunks": n, "frames": n * F, "setup_seconds": setup, "chunk_seconds": lat,
              "median_chunk_seconds": statistics.median(lat),
              "latent_frames_per_second": n * F / sum(lat)}
    print(f"setup {setup:.2f} s; {n * F} latent frames in {sum(lat):.3f} s: "
          f"{report['latent_frames_per_second']:.2f} latent frames/s (median chunk "
          f"{report['median_chunk_seconds'] * 1e3:.1f} ms)", file=stream)
    if r.kv_dtype == torch.float8_e4m3fn:
        from .demo import format_saturation

        report["kv_stats"] = r.cache.kv_stats()
        print(format_saturation(report["kv_stats"]), file=stream)
    report["checks"] = _checks(model, r, prompt, noises[:len(kept)], kept, stream)
    r.close()
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report


def _checks(model, r, prompt, noises, kept, stream) -> list[dict]:
    """The first chunks again: eagerly, and with the reference attention backend (each
    a new runner of the same model)."""
    from .demo import uses_fp8

    out = []
    tol = FP8_TOLERANCE if uses_fp8(r) else TOLERANCE.get(r.dtype, 5e-2)
    for name, backend in (("graphs vs eager", _name(r.backend)),
                          (f"{_name(r.backend)} vs reference backend", "reference")):
        twin = model.rollout(backend=backend, use_graphs=False)
        twin.set_prompt(prompt)
        got = [twin.step(n) for n in noises]
        twin.close()
        err = max((float((a - b).abs().max()) for a, b in zip(got, kept)), default=0.0)
        bound = tol * max(1.0, max((float(b.abs().max()) for b in kept), default=1.0))
        out.append({"check": name, "max_abs_error": err, "bound": bound,
                    "ok": err == err and err <= bound})
        print(f"  {name}: max abs error {err:.2e} (bound {bound:.1e}) "
              f"{'ok' if out[-1]['ok'] else 'FAILED'}", file=stream)
    return out
