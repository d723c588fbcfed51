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
    pixels      prompt to pixels at 480x832: each decoder's streaming decode (the Wan
                VAE fused and through diffusers' modules, the tiny decoder), eager and
                graphed, and text -> UMT5 -> `WanRollout` (1.3B, 21-frame window) ->
                decoded frames on the host, the decode after each chunk or overlapped
                with the next chunk's denoising (`framekv.bench.pixels`)
    fp8         bf16 against fp8 K/V, and fp8 K/V with fp8 GEMMs, side by side, speed
                beside accuracy, in parts (``--fp8-parts``, default all;
                `framekv.bench.fp8`): forward, one
                layer's paged cuDNN forward at the PRESET geometry, the denoising
                forward and the clean pass over a bf16 and an fp8 pool of the same
                K/V (``--iters`` rounds rotated, CUDA events), each output's max and
                mean error against the fp32 exact-window reference; dit, the
                ``--e2e-preset`` model's forward of a held-out chunk with bf16 and fp8
                GEMMs against fp32, and its speed; reference, the
                ``--e2e-preset`` model at a 21-frame window in the three runs (attention
                errors, the fp8 latents' relative L2 from the bf16 path over
                ``--chunks`` chunks, ``--chunk-iters`` rounds rotated); wan, diffusers'
                Wan at each of ``--wan-configs`` (default 1.3b; 14b needs about 28 GiB
                of weights and is timed one pool after the other where both pools do
                not fit beside them), latent 60x104, 3-frame chunks, a 21-frame
                window: ms per chunk, frames per second, peak memory and the fp8
                latents' relative L2 over ``--wan-chunks`` chunks

``--kv-dtype bf16|fp8`` (default bf16) is the K/V pool of framekv's rollouts in the e2e
and wan sections; ``--kv-dtype both`` runs them at bf16 and adds the fp8 section.

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

from .args import add_kv_dtype_argument, positive_int, writable_file
from .conventions import add_preset_arguments, preset_help

SECTIONS = ("attention", "chunk", "e2e", "wan", "streams", "breakdown", "pixels", "fp8")
#: The fp8 section's parts (`framekv.bench.fp8.PARTS`) and the Wan configs it takes
#: (`framekv.engine.wan.CONFIGS`), named here so that parsing imports neither.
FP8_PARTS = ("forward", "dit", "reference", "wan")
WAN_CONFIGS = ("tiny", "1.3b", "14b")


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


def _subset(choices: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [s for s in text.split(",") if s]
        if not names or any(n not in choices for n in names):
            raise argparse.ArgumentTypeError(f"must be a comma-separated subset of "
                                             f"{list(choices)}, got {text!r}")
        return names
    return parse


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
                         note="the geometry of the attention and chunk sections and the fp8 "
                              "forward; default seed-bench")
    p.add_argument("--e2e-preset", metavar="PRESET", default="wan-1.3b",
                   help=preset_help("the model of the e2e and breakdown sections; "
                                    "default wan-1.3b"))
    p.add_argument("--windows", type=_windows, default=[21, 60],
                   help="e2e window sizes in frames (default 21,60)")
    p.add_argument("--chunks", type=_iters, default=8,
                   help="e2e timed chunks per variant; the fp8 reference part's compared "
                        "chunks (default 8)")
    p.add_argument("--iters", type=_iters, default=50,
                   help="attention iterations; fp8 forward rounds (default 50)")
    p.add_argument("--chunk-iters", type=_iters, default=10,
                   help="chunk-cycle iterations; fp8 reference and wan rounds (default 10)")
    p.add_argument("--splits", default="2,3,4,5,6",
                   help="split-KV sub-row counts to time (default 2,3,4,5,6)")
    p.add_argument("--no-warmup", action="store_true", help="skip the cold/warm warm-up runs")
    add_kv_dtype_argument(p, ("bf16", "fp8", "both"),
                          extra=", for framekv's rollouts in the e2e and wan sections; both: "
                                "those at bf16, and the fp8 section side by side")
    p.add_argument("--fp8-parts", type=_subset(FP8_PARTS), default=list(FP8_PARTS),
                   help=f"the fp8 section's parts, comma-separated: {','.join(FP8_PARTS)} "
                        "(default all)")
    p.add_argument("--wan-configs", type=_subset(WAN_CONFIGS), default=["1.3b"],
                   help="the fp8 section's Wan configs, comma-separated: "
                        f"{','.join(WAN_CONFIGS)} (default 1.3b)")
    p.add_argument("--wan-chunks", type=positive_int, default=20,
                   help="the fp8 section's Wan chunks whose latents are compared (default 20)")
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

    args.sections = sections_of(args)
    _run_sections(args, preset, splits, results, save)
    return _chart(results, args.png) if args.png else 0


def sections_of(args: argparse.Namespace) -> list[str]:
    """The sections a run measures: ``--sections``, and fp8 with ``--kv-dtype both``."""
    both = getattr(args, "kv_dtype", "bf16") == "both"
    return [*args.sections, "fp8"] if both and "fp8" not in args.sections else list(args.sections)


def _run_sections(args, preset, splits, results, save) -> None:
    def progress(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    out = results["sections"]
    kv_dtype = "fp8" if getattr(args, "kv_dtype", "bf16") == "fp8" else None
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
                                              chunks=args.chunks, progress=progress,
                                              kv_dtype=kv_dtype))
            save()
            print(e2e.format_e2e(out["e2e"][-1]), flush=True)
    if "wan" in args.sections:
        from framekv.bench import wan

        out["wan"] = wan.measure_wan("1.3b", window_frames=21, chunks=min(args.chunks, 5),
                                     progress=progress, kv_dtype=kv_dtype)
        save()
        print(wan.format_wan(out["wan"]), flush=True)
    if "breakdown" in args.sections:
        _breakdown(args, out, save, progress)
    if "pixels" in args.sections:
        from framekv.bench import pixels

        out["pixels"] = pixels.measure_pixels(chunks=min(args.chunks, 6), progress=progress)
        save()
        print(pixels.format_pixels(out["pixels"]), flush=True)
    if "fp8" in args.sections:
        _fp8(args, preset, out, save, progress)
    if "streams" in args.sections:
        from framekv.bench import streams

        out["streams"] = []
        for preset_name, batches in streams.DEFAULT_RUNS:
            out["streams"].append(streams.measure_streams(
                preset_name, batches=batches, chunks=args.chunks, progress=progress))
            save()
            print(streams.format_streams(out["streams"][-1]), flush=True)


def _fp8(args, preset, out: dict, save, progress) -> None:
    """The fp8 section, part by part (each saved and printed as it finishes), then its
    summary."""
    from framekv.bench import fp8

    res = out["fp8"] = {"parts": list(args.fp8_parts)}
    for part, r in fp8.measure_parts(
            args.e2e_preset, parts=args.fp8_parts, forward_preset=preset, window_frames=21,
            chunks=args.chunks, rounds=args.chunk_iters, iters=args.iters,
            wan_configs=args.wan_configs, wan_chunks=args.wan_chunks, progress=progress):
        fp8.collect(res, part, r)
        save()
        print(fp8.format_part(part, r), flush=True)
    print(fp8.format_summary(res), flush=True)


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
    p = argparse.ArgumentParser(allow_abbrev=False, prog="framekv bench",
                                description=__doc__.split("\n\n")[0])
    configure(p)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
