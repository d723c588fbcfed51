"""`framekv warmup PRESET`: capture every graph a preset's rollout replays, report time
and memory.

A server runs this (or `framekv.engine.warm_up`) at start so that no request pays a
capture: it builds the preset's `Rollout` and captures exactly what that rollout
replays (one whole-chunk graph per chunk length). PRESET is a shipped preset's name
or a ``.toml``/``.json`` preset file. Prints one row per graph (capture seconds, pool
memory) and the totals; ``--json FILE`` writes the report
(`framekv.graphs.decode_report` reads it). ``--cache-dir DIR`` (default: the preset's
``[warmup] cache_dir``) keeps the compiled numba kernels and built cuDNN plans, so a
later process given the same folder (``framekv demo --cache-dir``, a server) builds
nothing.

Run as ``framekv warmup ...`` or ``python -m framekv.tools.warmup ...``. Importing this
module imports neither torch nor the engine: the command does, when it runs.
"""
from __future__ import annotations

import argparse
import os
import sys

from .args import writable_file

CPU_NOTE = "cpu: graphs run eagerly; nothing is captured"


class PlanError(ValueError):
    """PRESET names neither a readable preset file nor a shipped preset."""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``warmup`` subcommand (with ``func``) on an argparse subparsers object."""
    p = subparsers.add_parser(
        "warmup", help="capture every graph a preset's rollout replays, up front",
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    configure(p)
    return p


def configure(p: argparse.ArgumentParser) -> None:
    """Add the command's arguments to ``p`` and set ``func``."""
    p.add_argument("preset", metavar="PRESET",
                   help="a preset name (tiny, seed-bench, wan-1.3b) or a .toml/.json preset file")
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:N] (default: cuda when a GPU is visible, else cpu)")
    p.add_argument("--backend", default=None,
                   help="attention backend: cudnn or reference (default: cudnn on CUDA)")
    p.add_argument("--json", dest="json_path", metavar="FILE", type=writable_file, default=None,
                   help="write the report as JSON to FILE")
    p.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="keep compiled numba kernels and cuDNN plans in DIR "
                        "(default: the preset's [warmup] cache_dir)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def load_preset_arg(name: str):
    """The `Preset` PRESET names (a file path or a shipped preset's name).

    Raises `PlanError` saying what PRESET was taken for and why it failed.
    """
    from framekv import specs

    if not _is_path(name):
        try:
            return specs.load_preset(name)
        except ValueError as exc:
            raise PlanError(f"PRESET must be a preset name or a .toml/.json preset file: "
                            f"{exc}") from exc
    try:
        return specs.load(name, specs.Preset)
    except FileNotFoundError as exc:
        raise PlanError(f"preset file not found: {name}") from exc
    except ValueError as preset_error:
        try:  # say so plainly when it is a bare warm-up plan: it names no model
            specs.load(name, specs.WarmupPlan)
        except ValueError:
            raise PlanError(f"not a preset file: {preset_error}") from preset_error
        raise PlanError(f"{name} is a warm-up plan, not a preset: warm-up captures a "
                        "rollout's graphs, and a preset defines the rollout (its model and "
                        "chunks)") from preset_error


def _is_path(name: str) -> bool:
    # Preset names may hold dots ("wan-1.3b"): only a spec suffix or a separator makes
    # PRESET a path (the rule `framekv.specs.load_preset` uses).
    return name.lower().endswith((".toml", ".json")) or "/" in name or os.sep in name


def run(args: argparse.Namespace) -> int:
    """The command: warm up, print the table, write the JSON. Returns the exit status
    (2 for a bad PRESET or device, 1 for a failed capture)."""
    from framekv.graphs import GraphCaptureError, encode_report, format_report

    try:
        preset = load_preset_arg(args.preset)
        device = pick_device(args.device)
    except ValueError as exc:  # PlanError included
        return _error(exc, 2)
    from framekv.engine.warmup import warm_up

    cache_dir = args.cache_dir or preset.warmup.cache_dir
    try:
        result = warm_up(preset, device=device, backend=args.backend, cache_dir=cache_dir,
                         progress=not args.no_progress, stream=sys.stderr)
    except GraphCaptureError as exc:  # its note names the graph
        return _error(exc, 1)
    except ValueError as exc:
        return _error(exc, 2)
    try:
        print(_header(args.preset, result, cache_dir))
        print(format_report(result.report))
        if args.json_path:
            with open(args.json_path, "wb") as f:
                f.write(encode_report(result.report))
    finally:
        result.rollout.close()  # the process ends here; a server keeps the rollout
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


def _header(name: str, result, cache_dir) -> str:
    """What was warmed up, where, and what was built or loaded."""
    r = result.rollout
    m, s = r.model_spec, r.spec
    lines = [f"warm-up of {name}: {len(result.report.records)} chunk graph(s) of "
             f"{s.denoising_steps} denoising forwards + clean pass + commit; "
             f"{m.num_layers} layers, {m.num_heads}/{m.num_kv_heads} heads of {m.head_dim}, "
             f"{str(r.dtype).removeprefix('torch.')} on {r.device}, backend {r.backend}"]
    if result.rollout.graphs.eager:
        lines.append(CPU_NOTE)
    if cache_dir:
        lines.append(f"cache dir: {cache_dir}" + (" (unused on cpu: nothing is compiled)"
                                                  if result.rollout.graphs.eager else ""))
    b = result.builds
    if not result.rollout.graphs.eager:
        line = f"numba kernels: {b['numba_compiled']} compiled, {b['numba_loaded']} loaded from disk"
        if "cudnn_plans_built" in b:
            line += (f"; cuDNN plans: {b['cudnn_plans_built']} built, "
                     f"{b['cudnn_plans_loaded']} loaded from disk")
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m framekv.tools.warmup PRESET [...]``."""
    p = argparse.ArgumentParser(prog="framekv warmup", description=__doc__.split("\n\n")[0])
    configure(p)
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
