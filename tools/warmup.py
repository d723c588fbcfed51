"""`framekv warmup PLAN|PRESET`: capture every graph of a plan, report time and memory.

A server runs this (or `framekv.engine.warmup.warm_up`) at start so that no request
pays a capture. PLAN is a ``.toml``/``.json`` `framekv.specs.WarmupPlan` file (a
preset file works too); anything else is a shipped preset's name, whose rollout
implies the plan. Prints one row per graph (capture seconds, pool memory) and the
totals; ``--json FILE`` writes the report (`framekv.graphs.decode_report` reads it).
``--cache-dir DIR`` (default: the plan's ``cache_dir``) keeps compiled numba kernels
and built cuDNN plans for the next process.

Run as ``framekv warmup ...`` or ``python -m framekv.tools.warmup ...``. Importing this
module imports neither torch nor the engine: the command does, when it runs.
"""
from __future__ import annotations

import argparse
import os
import sys

CPU_NOTE = "cpu: graphs run eagerly; nothing is captured"


class PlanError(ValueError):
    """PLAN names neither a readable plan file nor a shipped preset."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``warmup`` subcommand (with ``func``) on an argparse subparsers object."""
    p = subparsers.add_parser(
        "warmup", help="capture every graph of a warm-up plan or preset up front",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(p)
    return p


def configure(p: argparse.ArgumentParser) -> None:
    """Add the command's arguments to ``p`` and set ``func``."""
    p.add_argument("plan", metavar="PLAN|PRESET",
                   help="a .toml/.json WarmupPlan (or preset) file, or a preset name")
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:N] (default: cuda when a GPU is visible, else cpu)")
    p.add_argument("--json", dest="json_path", metavar="FILE", default=None,
                   help="write the report as JSON to FILE")
    p.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="keep compiled numba kernels and cuDNN plans in DIR "
                        "(default: the plan's cache_dir)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def load_plan(plan: str):
    """``(WarmupPlan, Preset or None)`` from a plan/preset file path or a preset name.

    Raises `PlanError` saying what PLAN was taken for and why it failed.
    """
    from framekv import specs

    if _is_path(plan):
        return _load_file(plan)
    try:
        preset = specs.load_preset(plan)
    except ValueError as exc:
        raise PlanError(f"PLAN must be a .toml/.json plan file or a preset name: {exc}") from exc
    return preset.warmup_plan(), preset


def _is_path(plan: str) -> bool:
    # Preset names may hold dots ("wan-1.3b"): only a spec suffix or a separator makes
    # PLAN a path (the rule `framekv.specs.load_preset` uses).
    return plan.lower().endswith((".toml", ".json")) or "/" in plan or os.sep in plan


def _load_file(path: str):
    from framekv import specs

    try:
        return specs.load(path, specs.WarmupPlan), None
    except FileNotFoundError as exc:
        raise PlanError(f"plan file not found: {path}") from exc
    except ValueError as plan_error:
        try:  # a preset file is a plan too (its rollout implies one)
            preset = specs.load(path, specs.Preset)
        except ValueError:
            raise PlanError(f"not a warm-up plan (nor a preset) file: {plan_error}") from plan_error
        return preset.warmup_plan(), preset


def run(args: argparse.Namespace) -> int:
    """The command: warm up, print the table, write the JSON. Returns the exit status
    (2 for a bad PLAN or device, 1 for a failed capture)."""
    from framekv.graphs import GraphCaptureError, encode_report, format_report

    try:
        plan, preset = load_plan(args.plan)
        device = pick_device(args.device)
    except ValueError as exc:  # PlanError included
        return _error(exc, 2)
    from framekv.engine.warmup import warm_up

    cache_dir = args.cache_dir or plan.cache_dir
    try:
        result = warm_up(preset or plan, device=device, cache_dir=cache_dir,
                         progress=not args.no_progress, stream=sys.stderr)
    except GraphCaptureError as exc:  # its note names the plan item
        return _error(exc, 1)
    print(_header(args.plan, plan, result, cache_dir))
    print(format_report(result.report))
    if args.json_path:
        with open(args.json_path, "wb") as f:
            f.write(encode_report(result.report))
    # The process ends here (a server keeps the result): graphs first, then the memory
    # they read.
    result.graphs.clear()
    result.cache.shutdown()
    return 0


def _error(exc: Exception, status: int) -> int:
    notes = "".join(f"\n  {note}" for note in getattr(exc, "__notes__", ()))
    print(f"framekv warmup: error: {exc}{notes}", file=sys.stderr)
    return status


def pick_device(name: str | None):
    """The torch device ``--device`` names (default cuda when visible, else cpu);
    ValueError for a name torch does not know or a CUDA device that is not there."""
    from framekv.engine.rollout import resolve_device

    try:
        return resolve_device(name)
    except ValueError as exc:
        raise ValueError(f"--device: {exc}") from exc


def _header(name: str, plan, result, cache_dir) -> str:
    """What was warmed up, where, and what the numbers below mean on this device."""
    stack = result.stack
    lines = [f"warm-up of {name}: {len(plan.entries)} plan entries, {plan.num_forwards} forwards, "
             f"{len(result.report.records) - plan.num_forwards} commits; "
             f"{stack.kv.num_layers} layers, {stack.num_heads}/{stack.kv.num_kv_heads} heads of "
             f"{stack.kv.head_dim}, {str(stack.dtype).removeprefix('torch.')} on {stack.device}"]
    if result.graphs.eager:
        lines.append(CPU_NOTE)
    if cache_dir:
        lines.append(f"cache dir: {cache_dir}" + (" (unused on cpu: nothing is compiled)"
                                                  if result.graphs.eager else ""))
    built = getattr(stack.backend, "plans_built", None)
    if built is not None:
        lines.append(f"cuDNN plans: {built} built, {stack.backend.plans_loaded} loaded from disk")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m framekv.tools.warmup PLAN|PRESET [...]``."""
    p = argparse.ArgumentParser(prog="framekv warmup", description=__doc__.split("\n\n")[0])
    configure(p)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
