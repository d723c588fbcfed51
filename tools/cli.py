"""The `framekv` command line."""
from __future__ import annotations

import argparse
import json
import sys

from . import bench, serve, warmup
from .args import nonnegative_int, positive_int, tolerance, writable_file


def _cmd_info(args) -> int:
    from .info import collect, format_info

    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _fail(command: str, exc: Exception) -> int:
    print(f"framekv {command}: error: {exc}", file=sys.stderr)
    return 2


def _cmd_demo(args) -> int:
    try:
        if args.model == "wan-diffusers":
            from .wan_demo import run_wan_demo

            report = run_wan_demo(args.config, weights=args.weights, chunks=args.chunks,
                                  device=args.device, backend=args.backend,
                                  check_chunks=args.check_chunks, cache_dir=args.cache_dir)
        else:
            from .demo import run_demo

            report = run_demo(args.preset, chunks=args.chunks, device=args.device,
                              backend=args.backend, check_chunks=args.check_chunks,
                              progress=not args.no_progress, cache_dir=args.cache_dir)
    except (ValueError, FileNotFoundError) as exc:
        return _fail("demo", exc)
    if args.json and report.get("rank", 0) == 0:  # under torchrun, rank 0 writes it
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


def _cmd_verify(args) -> int:
    from .verify import run_verify

    try:
        report = run_verify(args.preset, chunks=args.chunks, device=args.device,
                            backend=args.backend, tolerance=args.tolerance, glue=args.glue)
    except (ValueError, FileNotFoundError) as exc:
        return _fail("verify", exc)
    return 0 if report.ok else 1


def _rollout_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="tiny",
                   help="preset name (tiny, seed-bench, wan-1.3b) or a .toml/.json file (default tiny)")
    p.add_argument("--chunks", type=positive_int, default=None,
                   help="chunks to generate (default: the preset's)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--backend", default=None,
                   help="attention backend: cudnn or reference (default: cudnn on CUDA, reference on CPU)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="framekv",
        description="framekv: a CUDA-graph-centric runtime for autoregressive video diffusion.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="versions, the device, and which backends are usable")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=_cmd_info)
    demo = sub.add_parser("demo", help="the main job: a timed, checked rollout of the reference model")
    _rollout_args(demo)
    demo.add_argument("--json", metavar="FILE", type=writable_file, default=None,
                      help="also write the report as JSON to FILE")
    demo.add_argument("--check-chunks", type=nonnegative_int, default=2,
                      help="chunks re-run eagerly and with the reference backend (default 2)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    demo.add_argument("--model", choices=("reference", "wan-diffusers"), default="reference",
                      help="the reference DiT of --preset (default), or diffusers' Wan "
                           "transformer (needs the wan extra)")
    demo.add_argument("--config", default="tiny",
                      help="with --model wan-diffusers: tiny or 1.3b (random weights)")
    demo.add_argument("--weights", metavar="DIR", default=None,
                      help="with --model wan-diffusers: a local diffusers folder")
    demo.add_argument("--cache-dir", metavar="DIR", default=None,
                      help="load and keep compiled kernels and cuDNN plans in DIR "
                           "(framekv warmup --cache-dir fills it)")
    demo.set_defaults(func=_cmd_demo)
    verify = sub.add_parser("verify", help="replay-correctness harness: eager vs graphs vs the fp32 reference")
    _rollout_args(verify)
    verify.add_argument("--tolerance", type=tolerance, default=None,
                        help="max abs error allowed (default: 1e-4 in fp32, 2e-2 in bf16)")
    verify.add_argument("--glue", choices=("fused", "torch"), default="fused",
                        help="the model's glue: framekv's fused ops (default) or torch ops")
    verify.set_defaults(func=_cmd_verify)
    warmup.add_parser(sub)
    bench.add_parser(sub)
    serve.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
