"""Concurrent streams: B sequences on one pool, one batched chunk, against B rollouts in turn.

Variants for each B, on the same model weights:

    batched    `Rollout(preset, sequences=B)`: every chunk one graph replay whose forwards
               run all B streams as batch rows (one cuDNN launch per layer for all)
    in-turn    B one-stream `Rollout`s, each with its own cache, stepped one after the
               other (what a server without batching does); one round = B chunks

Both fill their windows first (steady state), then ``chunks`` rounds are timed host to
host with the device drained around each, the order of the two variants rotating every
round. Aggregate latent frames/s = B x frames per chunk / round time; the per-chunk
latency of a stream is the batched step's time (in turn: the whole round, since a
stream's next chunk waits for the others).

The roofline says how much batching can give at all: a stream's chunk has fixed GEMM
and attention FLOPs (`breakdown.reference_chunk_flops`), and B streams cannot run faster
than B times those FLOPs at the bf16 matmul ceiling measured in the same run. So the
aggregate frames/s of any B over B = 1 is at most 1 / (B = 1's fraction of its
roofline), however the batch is run (``max_gain_vs_b1``).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from framekv.engine.rollout import Rollout

from .breakdown import reference_chunk_flops
from .e2e import with_window
from .timing import matmul_ceiling, require_cuda, stderr_progress, summary, write_result

BATCHES = (1, 2, 4, 8)
#: What `framekv bench` runs: the small streams at every B, the 1.3B model at B = 1, 2.
DEFAULT_RUNS = (("small-stream", BATCHES), ("wan-1.3b", (1, 2)))


def _fill(rollout) -> None:
    spec = rollout.spec
    rollout.prefill()
    for _ in range(-(-spec.window_frames // spec.frames_per_chunk) + 1):
        rollout.step()


def _timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6


def measure_batch(pair, B: int, model, chunks: int) -> tuple[dict, object]:
    """Both variants at B streams; returns (results, the model to share)."""
    batched = Rollout(pair, "cuda", sequences=B, model=model)
    model = batched.model
    alone = [Rollout(pair, "cuda", model=model) for _ in range(B)]
    for r in (batched, *alone):
        _fill(r)
    runs = {"batched": lambda: batched.step(), "in-turn": lambda: [r.step() for r in alone]}
    times: dict[str, list[float]] = {"batched": [], "in-turn": []}
    order = list(runs)
    for i in range(chunks):
        for name in order[i % 2:] + order[:i % 2]:  # rotate which variant goes first
            times[name].append(_timed(runs[name]))
    frames = B * pair[1].frames_per_chunk
    out = {name: {"round_us": summary(t), "frames_per_second": frames / (sum(t) / len(t) / 1e6)}
           for name, t in times.items()}
    out["batched"]["path"] = batched.path
    out["batched"]["captures"] = batched.graphs.stats().captures
    for r in (batched, *alone):
        r.close()
    torch.cuda.empty_cache()
    return out, model


def measure_streams(preset: str = "small-stream", *, batches=BATCHES, chunks: int = 6,
                    window_frames: int | None = None, ceiling: float | None = None,
                    progress=print) -> dict:
    """Aggregate frames/s and per-chunk latency per B (module doc), with the ratios to
    B = 1 that the batching is judged by and each B's fraction of its roofline
    (``ceiling``: the bf16 matmul TFLOP/s, measured here when None)."""
    pair = with_window(preset, window_frames)
    mspec, rspec = pair
    model, per_b = None, {}
    for B in batches:
        progress(f"streams {preset}: B = {B}")
        per_b[str(B)], model = measure_batch(pair, B, model, chunks)
    flops = reference_chunk_flops(pair)
    return {"preset": preset, "layers": mspec.num_layers, "window_frames": rspec.window_frames,
            "frames_per_chunk": rspec.frames_per_chunk, "tokens_per_frame": rspec.tokens_per_frame,
            "chunks": chunks, **judge(per_b, flops, ceiling or matmul_ceiling())}


def judge(per_b: dict, flops: dict, ceiling: float) -> dict:
    """Add to each B's batched record its ratios (to in turn, to B = 1) and its fraction
    of the roofline of B stream chunks of ``flops`` at ``ceiling`` TFLOP/s; return the
    roofline fields and the bound on any B's gain over B = 1 (module doc)."""
    stream_us = (flops["gemm"] + flops["attention"]) / (ceiling * 1e6)  # one chunk at the ceiling
    one = per_b.get("1", {}).get("batched")
    for B, r in per_b.items():
        b = r["batched"]
        b["speedup_vs_in_turn"] = b["frames_per_second"] / r["in-turn"]["frames_per_second"]
        b["roofline_fraction"] = int(B) * stream_us / b["round_us"]["median"]
        if one is not None:
            b["frames_per_second_vs_b1"] = b["frames_per_second"] / one["frames_per_second"]
            b["latency_vs_b1"] = b["round_us"]["median"] / one["round_us"]["median"]
    out = {"flops_per_chunk": flops, "ceiling_tflops": ceiling,
           "roofline_us_per_chunk": stream_us, "batches": per_b}
    if one is not None:  # no batch beats the ceiling: the most any B can give over B = 1
        out["max_gain_vs_b1"] = 1 / one["roofline_fraction"]
    return out


def format_streams(res: dict) -> str:
    lines = [f"concurrent streams: {res['preset']} ({res['layers']} layers, "
             f"{res['tokens_per_frame']} tokens per frame, window {res['window_frames']} frames, "
             f"{res['frames_per_chunk']}-frame chunks), {res['chunks']} timed rounds",
             f"  {'B':>3}  {'batched ms':>10}{'frames/s':>10}{'x B=1 fps':>10}{'x B=1 lat':>10}"
             f"  {'in turn ms':>10}{'frames/s':>10}{'batched/in turn':>16}{'of roofline':>12}"]
    for B, r in res["batches"].items():
        b, t = r["batched"], r["in-turn"]
        lines.append(f"  {B:>3}  {b['round_us']['median'] / 1e3:>10.1f}{b['frames_per_second']:>10.2f}"
                     f"{b.get('frames_per_second_vs_b1', float('nan')):>10.2f}"
                     f"{b.get('latency_vs_b1', float('nan')):>10.2f}"
                     f"  {t['round_us']['median'] / 1e3:>10.1f}{t['frames_per_second']:>10.2f}"
                     f"{b['speedup_vs_in_turn']:>16.2f}{b['roofline_fraction']:>12.2f}")
    if "max_gain_vs_b1" in res:
        lines.append(f"  roofline: {res['roofline_us_per_chunk'] / 1e3:.1f} ms per stream chunk "
                     f"at {res['ceiling_tflops']:.0f} TFLOP/s; no B can exceed "
                     f"{res['max_gain_vs_b1']:.2f}x the aggregate frames/s of B = 1")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m framekv.bench.streams",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", action="append", default=None,
                   help="preset (repeatable; default small-stream at B = 1, 2, 4, 8 and "
                        "wan-1.3b at B = 1, 2)")
    p.add_argument("--batches", default=None, help="comma-separated B (default per preset)")
    p.add_argument("--chunks", type=int, default=6, help="timed rounds per B")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    require_cuda("framekv.bench.streams")
    runs = DEFAULT_RUNS if args.preset is None else tuple(
        (name, BATCHES if name == "small-stream" else (1, 2)) for name in args.preset)
    out = []
    for name, batches in runs:
        if args.batches:
            batches = tuple(int(b) for b in args.batches.split(","))
        out.append(measure_streams(name, batches=batches, chunks=args.chunks,
                                   progress=stderr_progress("streams")))
        print(format_streams(out[-1]), flush=True)
        write_result(args.json_path, streams=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
