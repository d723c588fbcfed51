"""The `framekv` command line."""
from __future__ import annotations

import argparse
import json
import sys


def _cmd_info(args) -> int:
    from .info import collect, format_info

    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _cmd_demo(args) -> int:
    # The rollout demo needs the reference model; until it exists the main job
    # reports what this machine can run.
    print("framekv demo: the reference-model rollout is not part of this release yet; "
          "showing what this machine can run.\n")
    return _cmd_info(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="framekv",
        description="framekv: a CUDA-graph-centric runtime for autoregressive video diffusion.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="versions, the device, and which backends are usable")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=_cmd_info)
    demo = sub.add_parser("demo", help="the main job (for now: what this machine can run)")
    demo.add_argument("--json", action="store_true", help="print JSON instead of text")
    demo.set_defaults(func=_cmd_demo)
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
