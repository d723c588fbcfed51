"""`framekv bench`: framekv against what users run instead, in one run, on one GPU.

Sections (``--sections``, default all; `SECTIONS`, which the help lists):

    attention   one layer at the geometry of PRESET (``framekv bench PRESET`` or
                ``--preset``, default seed-bench): framekv's paged cuDNN forward and
                clean pass, split-KV rows, torch SDPA cuDNN over a contiguous buffer,
                concatenate-then-SDPA, torch SDPA flash
    chunk       the PRESET chunk cycle over all its layers: per-forward graphs, one
                whole-chunk graph, the commit; the warm-up of its plan cold and warm
    e2e         the ``--e2e-preset`` model (default wan-1.3b) end to end: framekv with
                graphs and eager against a dense rolling cache with torch SDPA, at each
                of ``--windows``
    wan         diffusers' Wan transformer (the 1.3B config, random weights, bf16,
                latent 60x104, 3-frame chunks, 4 steps, a 21-frame window filled first):
                `WanRollout` with graphs and eager against a Self-Forcing-style dense
                rolling cache (eager and under graphs) and the stock model recomputing
                its visible window every step (`framekv.bench.wan`)
    streams     concurrent streams: B = 1, 2, 4, 8 streams of the small-stream preset
                as one batched rollout against B one-stream rollouts in turn, and
                B = 1, 2 at wan-1.3b (`framekv.bench.streams`)
    breakdown   one chunk's kernel time by category (attention, GEMM, framekv, other)
                and its fraction of its roofline (at the burst ceiling and at the SM
                clock sampled while the chunks ran), for the ``--e2e-preset`` model and
                `WanRollout` at the Wan 1.3B config (21-frame windows), and one block's
                glue as torch ops, under torch.compile (inductor) and through framekv's
                fused ops (`framekv.bench.breakdown`, `framekv.bench.glue`)
    pixels      prompt to pixels at 480x832: the Wan VAE's streaming decode, eager and
                graphed, and text -> UMT5 -> `WanRollout` (1.3B, 21-frame window) ->
                decoded frames on the host, the decode after each chunk or overlapped
                with the next chunk's denoising (`framekv.bench.pixels`)

Prints a table per section; ``--json FILE`` writes every number with the environment;
``--png FILE`` draws a chart (needs matplotlib, the ``plot`` extra). ``--chart-from
JSON --png FILE`` draws the chart of an earlier run without a GPU.

Importing this module imports neither torch nor the engine.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys

from .args import writable_file
from .conventions import add_preset_arguments, preset_help

SECTIONS = ("attention", "chunk", "e2e", "wan", "streams", "breakdown", "pixels")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand (with ``func``)."""
    p = subparsers.add_parser("bench", help="measure framekv against dense baselines",
                              description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(p)
    return p


def _sections(text: str) -> list[str]:
    names = [s for s in text.split(",") if s]
    bad = [s for s in names if s not in SECTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"must be a comma-separated subset of {list(SECTIONS)}, "
                                         f"got {text!r}")
    return names


def _windows(text: str) -> list[int]:
    try:
        values = [int(w) for w in text.split(",") if w]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated frame counts >= 1, got {text!r}")
    return values


def _iters(text: str) -> int:
    value = int(text)
    if value < 5:
        raise argparse.ArgumentTypeError(f"must be >= 5, got {value}")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    """Add the command's arguments to ``p`` and set ``func``."""
    p.add_argument("--sections", type=_sections, default=list(SECTIONS),
                   help=f"comma-separated: {','.join(SECTIONS)} (default all)")
    add_preset_arguments(p, default="seed-bench",
                         note="the attention and chunk sections' geometry; default seed-bench")
    p.add_argument("--e2e-preset", metavar="PRESET", default="wan-1.3b",
                   help=preset_help("the model of the e2e and breakdown sections; "
                                    "default wan-1.3b"))
    p.add_argument("--windows", type=_windows, default=[21, 60],
                   help="e2e window sizes in frames (default 21,60)")
    p.add_argument("--chunks", type=_iters, default=8,
                   help="e2e timed chunks per variant (default 8)")
    p.add_argument("--iters", type=_iters, default=50, help="attention iterations (default 50)")
    p.add_argument("--chunk-iters", type=_iters, default=10,
                   help="chunk-cycle iterations (default 10)")
    p.add_argument("--splits", default="2,3,4,5,6",
                   help="split-KV sub-row counts to time (default 2,3,4,5,6)")
    p.add_argument("--no-warmup", action="store_true", help="skip the cold/warm warm-up runs")
    p.add_argument("--json", dest="json_path", metavar="FILE", type=writable_file, default=None,
                   help="write every number, with the environment, to FILE")
    p.add_argument("--png", metavar="FILE", type=writable_file, default=None,
                   help="write a chart (matplotlib)")
    p.add_argument("--chart-from", metavar="JSON", default=None,
                   help="only draw --png from an earlier --json; no GPU needed")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """The command; exit status 2 for bad arguments or no GPU."""
    if args.chart_from:
        if not args.png:
            return _error("--chart-from needs --png FILE", 2)
        with open(args.chart_from) as f:
            results = json.load(f)
        return _chart(results, args.png)
    import torch

    if not torch.cuda.is_available():
        return _error("needs a CUDA GPU (the baselines are GPU kernels)", 2)
    from framekv import specs

    try:
        preset = specs.load_preset(args.preset)
        splits = [int(s) for s in args.splits.split(",") if s]
    except ValueError as exc:
        return _error(exc, 2)
    from framekv.bench.timing import environment

    results = {"command": "framekv bench " + " ".join(sys.argv[2:]),
               "environment": environment(), "sections": {}}

    def save() -> None:  # after every section: a long run cut short keeps what it measured
        if args.json_path:
            with open(args.json_path, "w") as f:
                json.dump(results, f, indent=2)

    _run_sections(args, preset, splits, results, save)
    return _chart(results, args.png) if args.png else 0


def _run_sections(args, preset, splits, results, save) -> None:
    def progress(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    out = results["sections"]
    if "attention" in args.sections:
        from framekv.bench import attention, split

        res = attention.measure_attention(preset, iters=args.iters, progress=progress,
                                          extra=split.variants_for(splits))
        out["attention"] = res
        save()
        print(attention.format_attention(res), flush=True)
    if "chunk" in args.sections:
        from framekv.bench import chunk

        out["chunk"] = chunk.measure_chunk(preset, iters=args.chunk_iters, progress=progress)
        save()
        print(chunk.format_chunk(out["chunk"]), flush=True)
        if not args.no_warmup:
            out["warmup"] = chunk.measure_warmup(args.preset, progress=progress)
            save()
            print(chunk.format_warmup(out["warmup"]), flush=True)
    if "e2e" in args.sections:
        from framekv.bench import e2e

        out["e2e"] = []
        for w in args.windows:
            out["e2e"].append(e2e.measure_e2e(args.e2e_preset, window_frames=w,
                                              chunks=args.chunks, progress=progress))
            save()
            print(e2e.format_e2e(out["e2e"][-1]), flush=True)
    if "wan" in args.sections:
        from framekv.bench import wan

        out["wan"] = wan.measure_wan("1.3b", window_frames=21, chunks=min(args.chunks, 5),
                                     progress=progress)
        save()
        print(wan.format_wan(out["wan"]), flush=True)
    if "breakdown" in args.sections:
        _breakdown(args, out, save, progress)
    if "pixels" in args.sections:
        from framekv.bench import pixels

        out["pixels"] = pixels.measure_pixels(chunks=min(args.chunks, 6), progress=progress)
        save()
        print(pixels.format_pixels(out["pixels"]), flush=True)
    if "streams" in args.sections:
        from framekv.bench import streams

        out["streams"] = []
        for preset_name, batches in streams.DEFAULT_RUNS:
            out["streams"].append(streams.measure_streams(
                preset_name, batches=batches, chunks=args.chunks, progress=progress))
            save()
            print(streams.format_streams(out["streams"][-1]), flush=True)


def _breakdown(args, out: dict, save, progress) -> None:
    """One chunk per category and against its roofline (the reference model at the e2e
    preset and diffusers' Wan 1.3B, a 21-frame window), and one block's glue: torch,
    inductor, framekv."""
    from framekv.bench import breakdown, glue
    from framekv.bench.timing import matmul_ceiling

    ceiling = matmul_ceiling()
    out["breakdown"] = {"ceiling_tflops": ceiling, "chunks": []}
    for measure in (functools.partial(breakdown.measure_reference, args.e2e_preset),
                    functools.partial(breakdown.measure_wan, "1.3b")):
        for r in measure(window_frames=21, ceiling=ceiling, progress=progress):
            out["breakdown"]["chunks"].append(r)
            print(breakdown.format_breakdown(r["model"], r), flush=True)
        save()
    out["breakdown"]["glue"] = glue.measure_glue(args.e2e_preset, progress=progress)
    save()
    print(glue.format_glue(out["breakdown"]["glue"]), flush=True)


def _chart(results: dict, path: str) -> int:
    try:
        from framekv.bench.chart import draw
    except ImportError as exc:
        return _error(f"--png needs matplotlib (pip install 'framekv[plot]'): {exc}", 2)
    draw(results, path)
    print(f"chart written to {path}")
    return 0


def _error(msg, status: int) -> int:
    print(f"framekv bench: error: {msg}", file=sys.stderr)
    return status


def main(argv: list[str] | None = None) -> int:
    """``python -m framekv.tools.bench [...]``."""
    p = argparse.ArgumentParser(prog="framekv bench", description=__doc__.split("\n\n")[0])
    configure(p)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
