"""Whether resident runs still pay where host time matters: small models, short chunks.

    python -m framekv.bench.small_chunks [--json FILE] [--specs tiny,mid] [--rounds 5]
        [--chunks 10]

A resident run (``Rollout(..., resident=True)``, `framekv.graphs.ResidentGraph`) saves
the launch a chunk pays when it is issued right after the host waited for the previous
one. With a big model that saving disappears in the chunk's device time; here the
chunks are short, so host time is a visible share of each. For each spec, two rollouts
of it on one GPU, replayed graphs (the default) and resident, run the same serving
loop: ``step()``, wait for the chunk on the current stream, issue the next at once.

Specs: the ``tiny`` preset, and ``mid``, built here (`mid_preset`): 4 layers of width
512 (8 heads of 64, MHA), 256 tokens per frame (a 32 x 32 latent in 2 x 2 patches),
2-frame chunks, a 6-frame window.

Per chunk two host intervals are taken: the wall from the call of ``step()`` to the
chunk done on the stream, and the host time of the ``step()`` call itself (a resident
step returns once its run is done, so there the two nearly coincide; a replayed step
returns after the launch). Each round resets and prefills both rollouts and runs
``--chunks`` chunks of each; the chunks before the window is full are not counted;
the order of the two variants rotates every round, and the host sleeps before each so
that a resident loop has left on its idle limit and both start alike. One untimed round
of each comes first (captures, the resident loop's build). Reported: medians (and
spreads) per variant, and the ratios resident / replayed, as JSON and a table.
"""
from __future__ import annotations

import argparse
import json
import math
import time

from framekv.specs import ModelSpec, Preset, RolloutSpec, load_preset

VARIANTS = ("replayed", "resident")
SPECS = ("tiny", "mid")
#: Sleep before each round: longer than a resident loop's idle limit (0.05 s).
SETTLE_S = 0.2


def mid_preset() -> Preset:
    """A mid-size model: 4 layers, width 512, 8 heads of 64, 256 tokens per frame."""
    model = ModelSpec(name="mid", num_layers=4, hidden_size=512, num_heads=8, num_kv_heads=8,
                      head_dim=64, ffn_size=2048, in_channels=16, patch_size=(1, 2, 2),
                      latent_height=32, latent_width=32, text_dim=512, freq_dim=256,
                      dtype="bfloat16", tokens_per_page=32, seed=0)
    rollout = RolloutSpec(tokens_per_frame=model.tokens_per_frame, frames_per_chunk=2,
                          window_frames=6, prompt_tokens=64, denoising_steps=4, chunks=16)
    return Preset(name="mid", model=model, rollout=rollout,
                  description="Mid-size model for small_chunks: 4 layers, width 512.")


def preset_for(name: str) -> Preset:
    """The preset a ``--specs`` name stands for."""
    return mid_preset() if name == "mid" else load_preset(name)


def skipped_chunks(preset: Preset) -> int:
    """Chunks of a round before the window is full (at least the first: it follows the
    prefill, not a chunk)."""
    r = preset.rollout
    return max(1, math.ceil(r.window_frames / r.frames_per_chunk))


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; errors name the option, what it takes and what it got."""
    ap = argparse.ArgumentParser(prog="python -m framekv.bench.small_chunks",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--specs", default=",".join(SPECS),
                    help=f"comma-separated, from {', '.join(SPECS)} (default: both)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per spec")
    ap.add_argument("--chunks", type=int, default=10, help="chunks per round and variant")
    args = ap.parse_args(argv)
    args.specs = [s for s in args.specs.split(",") if s]
    bad = [s for s in args.specs if s not in SPECS]
    if bad or not args.specs:
        ap.error(f"--specs: expected names from {list(SPECS)}, got {args.specs or '(none)'}")
    if args.rounds < 1:
        ap.error(f"--rounds: expected at least 1, got {args.rounds}")
    most = max(skipped_chunks(preset_for(s)) for s in args.specs)
    if args.chunks <= most:
        ap.error(f"--chunks: expected more than {most} (the chunks before the window is "
                 f"full are not timed), got {args.chunks}")
    return args


def serve(rollout, chunks: int, skip: int) -> tuple[list[float], list[float]]:
    """One round: reset, prefill, then ``chunks`` chunks back to back, each waited for
    on the stream. Returns µs per counted chunk: (wall, host time of ``step()``)."""
    import torch

    stream = torch.cuda.current_stream()
    rollout.reset()
    rollout.prefill()
    stream.synchronize()
    walls, steps = [], []
    for i in range(chunks):
        t0 = time.perf_counter()
        rollout.step()
        t1 = time.perf_counter()
        stream.synchronize()
        t2 = time.perf_counter()
        if i >= skip:
            walls.append((t2 - t0) * 1e6)
            steps.append((t1 - t0) * 1e6)
    return walls, steps


def measure_spec(name: str, rounds: int, chunks: int, progress=print) -> dict:
    """Both variants of one spec, rounds in rotating order; the samples per variant."""
    from framekv.engine import Rollout

    preset = preset_for(name)
    skip = skipped_chunks(preset)
    rollouts = {v: Rollout(preset, "cuda", resident=v == "resident") for v in VARIANTS}
    samples = {v: {"wall_us": [], "step_host_us": []} for v in VARIANTS}
    try:
        for r in range(rounds + 1):  # round 0: warm-up, not counted
            order = VARIANTS[r % 2:] + VARIANTS[:r % 2]
            for v in order:
                time.sleep(SETTLE_S)
                walls, steps = serve(rollouts[v], chunks, skip)
                if r:
                    samples[v]["wall_us"] += walls
                    samples[v]["step_host_us"] += steps
            progress(f"{name}: round {r}/{rounds} done" + (" (warm-up)" if not r else ""))
    finally:
        time.sleep(SETTLE_S)
        for rollout in rollouts.values():
            rollout.close()
    return summarize(name, preset, skip, samples)


def summarize(name: str, preset: Preset, skip: int, samples: dict) -> dict:
    """Medians and spreads per variant, and the resident / replayed ratios."""
    from .timing import summary

    r, m = preset.rollout, preset.model
    out = {"spec": name, "layers": m.num_layers, "hidden_size": m.hidden_size,
           "chunk_tokens": r.chunk_tokens, "keys_per_forward": r.keys_per_forward,
           "denoising_steps": r.denoising_steps, "skipped_chunks": skip}
    for v in VARIANTS:
        out[v] = {k: summary(s) for k, s in samples[v].items()}
    out["ratio"] = {k: out["resident"][k]["median"] / out["replayed"][k]["median"]
                    for k in ("wall_us", "step_host_us")}
    return out


def format_table(results: dict) -> str:
    """The results as a text table: one row per spec and variant, then the ratios."""
    lines = [f"{'spec':<6}{'tokens':>8}{'variant':>10}{'wall µs':>11}{'p10-p90':>17}"
             f"{'step() µs':>11}{'p10-p90':>17}"]
    for s in results["specs"]:
        for v in VARIANTS:
            w, h = s[v]["wall_us"], s[v]["step_host_us"]
            lines.append(f"{s['spec']:<6}{s['chunk_tokens']:>8}{v:>10}{w['median']:>11.1f}"
                         f"{_spread(w):>17}{h['median']:>11.1f}{_spread(h):>17}")
        ratio = s["ratio"]
        lines.append(f"{s['spec']:<6}{'':>8}{'res/rep':>10}{ratio['wall_us']:>11.3f}{'':>17}"
                     f"{ratio['step_host_us']:>11.3f}")
    return "\n".join(lines)


def _spread(s: dict) -> str:
    return f"{s['p10']:.1f}-{s['p90']:.1f}"


def main(argv=None) -> dict:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("framekv.bench.small_chunks needs a CUDA GPU")
    from .timing import environment

    specs = [measure_spec(name, args.rounds, args.chunks) for name in args.specs]
    results = {"environment": environment(), "rounds": args.rounds, "chunks": args.chunks,
               "settle_s": SETTLE_S, "specs": specs,
               "median_of": "per-chunk samples over all timed rounds"}
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
