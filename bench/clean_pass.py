"""A clean pass kept for its K/V only against the whole clean pass, in one process.

    python -m framekv.bench.clean_pass [--models reference,wan] [--rounds 10] [--json F]

A chunk ends with a clean pass at t = 0 whose only product is every layer's K/V, so
its last block's attention, projection and MLP feed nothing (`trim_clean_pass`, the
default of `Rollout` and `WanRollout`). The saving is about one layer of one forward of
five, under 1% of a chunk: less than the spread between runs on different machines,
so it is measured here as an A/B on one GPU. Two graphed rollouts share one model (the
reference ``wan-1.3b`` preset, and diffusers' Wan 1.3B with the fused glue), their
windows filled, then one chunk replay of each per round, CUDA events around each, the
order rotated every round (a GPU at its power limit drifts over seconds: both see it
alike). Reported: median ms per chunk of each, their difference, and the FLOPs the trim
skips at the same run's matmul ceiling (the saving a perfect kernel would give).
"""
from __future__ import annotations

import argparse
import statistics

import torch

from framekv.bench.timing import (interleaved_device_times, matmul_ceiling, require_cuda,
                                  stderr_progress, write_result)

VARIANTS = ("trimmed", "whole")


def _record(times: dict[str, list[float]], skipped: dict, ceiling: float) -> dict:
    med = {k: statistics.median(v) for k, v in times.items()}
    flops = sum(skipped.values())
    return {"chunk_us": {k: {"median": m, "n": len(times[k])} for k, m in med.items()},
            "saved_us": med["whole"] - med["trimmed"],
            "saved_fraction": 1 - med["trimmed"] / med["whole"],
            "skipped_flops": skipped, "skipped_at_ceiling_us": flops / (ceiling * 1e6)}


def measure_reference(preset: str = "wan-1.3b", *, window_frames: int = 21, rounds: int = 10,
                      ceiling: float, progress=print) -> dict:
    """Trimmed against whole clean passes of the reference model (module doc)."""
    from framekv.engine.rollout import Rollout

    from .breakdown import reference_chunk_flops
    from .e2e import time_rollout, with_window

    pair = with_window(preset, window_frames)
    rollouts, model = {}, None
    for name in VARIANTS:
        progress(f"reference {preset}: {name} clean pass, window {window_frames} filled")
        r = Rollout(pair, "cuda", model=model, trim_clean_pass=name == "trimmed")
        model = r.model
        time_rollout(r, 0)  # prefill and fill the window
        rollouts[name] = r
    progress(f"reference {preset}: {rounds} rounds")
    times = interleaved_device_times({k: r.step for k, r in rollouts.items()}, rounds,
                                     warmup=1, rotate=True)
    whole, trimmed = reference_chunk_flops(pair, trimmed=False), reference_chunk_flops(pair)
    for r in rollouts.values():
        r.close()
    return {"model": f"reference {preset}", "window_frames": window_frames,
            **_record(times, {k: whole[k] - trimmed[k] for k in whole}, ceiling)}


def measure_wan(config: str = "1.3b", *, latent_size=(60, 104), frames_per_chunk: int = 3,
                sink_frames: int = 1, window_frames: int = 21, rounds: int = 10,
                ceiling: float, progress=print) -> dict:
    """Trimmed against whole clean passes of `WanRollout` (fused glue; module doc)."""
    from framekv.engine import WanRollout

    from .breakdown import wan_chunk, wan_chunk_flops

    model, kw, text, gen = wan_chunk(config, latent_size=latent_size,
                                     frames_per_chunk=frames_per_chunk,
                                     sink_frames=sink_frames, window_frames=window_frames)
    noise = torch.randn(1, model.config.in_channels, frames_per_chunk, *latent_size,
                        generator=gen)
    rollouts = {}
    for name in VARIANTS:
        progress(f"wan {config}: {name} clean pass, window {window_frames} filled")
        r = WanRollout(model, trim_clean_pass=name == "trimmed", **kw)
        r.set_prompt(text)
        r.capture()
        for _ in range(-(-(sink_frames + window_frames) // frames_per_chunk) + 1):
            r.step(noise)
        rollouts[name] = r
    progress(f"wan {config}: {rounds} rounds")
    times = interleaved_device_times({k: (lambda r=r: r.step(noise)) for k, r in rollouts.items()},
                                     rounds, warmup=1, rotate=True)
    _, skipped = wan_chunk_flops(model, kw, text.shape[1])
    for r in rollouts.values():
        r.close()
    return {"model": f"diffusers Wan {config} (WanRollout), fused glue",
            "window_frames": window_frames, **_record(times, skipped, ceiling)}


def format_clean_pass(records: list[dict]) -> str:
    lines = ["clean pass kept for its K/V only (trimmed) against the whole clean pass, "
             "ms per chunk (graph replay, medians):"]
    for r in records:
        c = r["chunk_us"]
        lines.append(f"  {r['model']}: trimmed {c['trimmed']['median'] / 1e3:.1f}, whole "
                     f"{c['whole']['median'] / 1e3:.1f}: saves {r['saved_us'] / 1e3:.2f} ms "
                     f"({r['saved_fraction']:.2%}); its skipped FLOPs at the ceiling "
                     f"{r['skipped_at_ceiling_us'] / 1e3:.2f} ms")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="reference,wan", help="reference, wan or both")
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds (>= 3)")
    ap.add_argument("--windows", type=int, default=21, help="window frames")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in ("reference", "wan")]
    if bad or not models:
        ap.error(f"--models: expected reference and/or wan, got {args.models!r}")
    if args.rounds < 3:
        ap.error(f"--rounds: expected at least 3, got {args.rounds}")
    require_cuda("framekv.bench.clean_pass")
    progress = stderr_progress("clean_pass")
    ceiling = matmul_ceiling()
    measure = {"reference": measure_reference, "wan": measure_wan}
    records = [measure[m](window_frames=args.windows, rounds=args.rounds, ceiling=ceiling,
                          progress=progress) for m in models]
    print(format_clean_pass(records), flush=True)
    write_result(args.json, clean_pass={"ceiling_tflops": ceiling, "records": records})
    return records


if __name__ == "__main__":
    main()
