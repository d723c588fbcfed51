"""The `framekv` command line: info, demo, verify and warmup here; bench, serve and
generate in their own modules. Importing it imports neither torch nor the engine: a
command does, when it runs.

Every command that runs a preset takes it as its positional argument or as ``--preset``
(`framekv.tools.conventions`): ``framekv demo wan-1.3b`` is ``framekv demo --preset
wan-1.3b``. ``framekv --version`` prints ``framekv X.Y.Z``. Every command that runs a
model (demo, warmup, generate, serve) takes the model flags of
`framekv.tools.model_flags` (``--model``, a family of `framekv.engine.models`, and its
options), checked before any model is built.

``framekv warmup PRESET`` captures every graph the rollout of ``--model``'s model at a
preset replays (default the reference DiT's), up front, and
reports time and memory: a server runs it (or `framekv.engine.warm_up`) at start so that
no request pays a capture. PRESET (required) is a shipped preset's name or a
``.toml``/``.json`` preset file; ``--json FILE`` writes the report
(`framekv.graphs.decode_report` reads it); ``--cache-dir DIR`` (default: the preset's
``[warmup] cache_dir``) keeps the compiled numba kernels and built cuDNN plans, so a
later process given the same folder (``framekv demo --cache-dir``, a server) builds
nothing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from . import bench, generate, serve
from .cluster import command as cluster
from .args import (add_kv_dtype_argument, nonnegative_int, positive_int, tolerance,
                   writable_file)
from .conventions import (CommandParser, PresetError, add_backend_argument,
                          add_preset_arguments, fail, load_preset_arg, preset_help,
                          version_line)
from .model_flags import checked_model, model_parent

CPU_NOTE = "cpu: graphs run eagerly; nothing is captured"


def _cmd_info(args) -> int:
    from .info import collect, format_info

    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    return 0


def _cmd_demo(args) -> int:
    """The demo of ``--model``'s family: the reference DiT's own (`framekv.tools.demo`:
    a preset's `Rollout`, Ulysses under torchrun), or any other's
    (`framekv.tools.model_demo`)."""
    try:
        family, options, _ = checked_model(args)
        from framekv.engine.models import ReferenceModel

        model = family.load(options, device=args.device, text_encoder=False, decode=False)
        if isinstance(model, ReferenceModel):
            from .demo import run_demo

            report = run_demo(model.preset, chunks=args.chunks, device=args.device,
                              backend=args.backend, check_chunks=args.check_chunks,
                              progress=not args.no_progress, cache_dir=args.cache_dir,
                              kv_dtype=options.kv_dtype, gemm_dtype=options.gemm_dtype)
        else:
            from .model_demo import run_model_demo

            report = run_model_demo(model, chunks=args.chunks, backend=args.backend,
                                    check_chunks=args.check_chunks, cache_dir=args.cache_dir)
    except (ValueError, FileNotFoundError) as exc:
        return fail("demo", exc)
    if args.json and report.get("rank", 0) == 0:  # under torchrun, rank 0 writes it
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


def _cmd_verify(args) -> int:
    from .verify import run_verify

    try:
        report = run_verify(args.preset or "tiny", chunks=args.chunks, device=args.device,
                            backend=args.backend, tolerance=args.tolerance, glue=args.glue,
                            kv_dtype=args.kv_dtype)
    except (ValueError, FileNotFoundError) as exc:
        return fail("verify", exc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
    return 0 if report.ok else 1


def _rollout_args(p: argparse.ArgumentParser, note: str) -> None:
    add_preset_arguments(p, default=None, note=note)
    p.add_argument("--chunks", type=positive_int, default=None,
                   help="chunks to generate (default: the preset's)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    add_backend_argument(p, "cudnn on CUDA, reference on CPU")


def _cmd_warmup(args: argparse.Namespace) -> int:
    """The command: warm up ``--model``'s runner at PRESET, print the table, write the
    JSON. Returns the exit status (2 for a bad PRESET, device or model flag, 1 for a
    failed capture)."""
    from framekv.graphs import GraphCaptureError, encode_report, format_report

    try:
        if args.preset is None:
            raise PresetError(f"PRESET (or --preset) is required: expected {preset_help()}, "
                              "got none")
        preset = load_preset_arg(args.preset)
        device = pick_device(args.device)
        family, options, _ = checked_model(args)
        model = family.load(dataclasses.replace(options, preset=preset), device=device,
                            text_encoder=False, decode=False)
    except ValueError as exc:  # PresetError included
        return fail("warmup", exc)
    from framekv.engine.rollout import captured

    cache_dir = args.cache_dir or preset.warmup.cache_dir
    try:
        result = captured(model.rollout(backend=args.backend, cache_dir=cache_dir),
                          progress=not args.no_progress, stream=sys.stderr)
    except GraphCaptureError as exc:  # its note names the graph
        return fail("warmup", exc, 1)
    except ValueError as exc:
        return fail("warmup", exc)
    try:
        print(_header(args.preset, result, cache_dir))
        print(format_report(result.report))
        if args.json_path:
            with open(args.json_path, "wb") as f:
                f.write(encode_report(result.report))
    finally:
        result.rollout.close()  # the process ends here; a server keeps the rollout
    return 0


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
    a = r.chunk_model.attention                    # every layer plans alike
    lines = [f"warm-up of {name}: {len(result.report.records)} chunk graph(s) of "
             f"{len(r.sampling.timesteps)} denoising forwards + clean pass + commit; "
             f"{r.cache.num_layers} layers, {a.num_heads}/{a.num_kv_heads} heads of "
             f"{a.head_dim}, {str(r.dtype).removeprefix('torch.')} on {r.device}, "
             f"backend {a.backend.name}"]
    if r.graphs.eager:
        lines.append(CPU_NOTE)
    if cache_dir:
        lines.append(f"cache dir: {cache_dir}" + (" (unused on cpu: nothing is compiled)"
                                                  if r.graphs.eager else ""))
    b = result.builds
    if not r.graphs.eager:
        line = f"numba kernels: {b['numba_compiled']} compiled, {b['numba_loaded']} loaded from disk"
        if "cudnn_plans_built" in b:
            line += (f"; cuDNN plans: {b['cudnn_plans_built']} built, "
                     f"{b['cudnn_plans_loaded']} loaded from disk")
        lines.append(line)
    return "\n".join(lines)


def _warmup_args(p: argparse.ArgumentParser) -> None:
    add_preset_arguments(p, default=None, note="required")
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:N] (default: cuda when a GPU is visible, else cpu)")
    add_backend_argument(p, "cudnn on CUDA, reference on CPU")
    p.add_argument("--json", dest="json_path", metavar="FILE", type=writable_file, default=None,
                   help="write the report as JSON to FILE")
    p.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="keep compiled numba kernels and cuDNN plans in DIR "
                        "(default: the preset's [warmup] cache_dir)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=_cmd_warmup)


def _demo_args(p: argparse.ArgumentParser) -> None:
    _rollout_args(p, "default the model family's: tiny; with --model wan-diffusers the "
                     "config's: tiny or wan-1.3b")
    p.add_argument("--json", metavar="FILE", type=writable_file, default=None,
                   help="also write the report as JSON to FILE")
    p.add_argument("--check-chunks", type=nonnegative_int, default=2,
                   help="chunks re-run eagerly and with the reference backend (default 2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--cache-dir", metavar="DIR", default=None,
                   help="load and keep compiled kernels and cuDNN plans in DIR "
                        "(framekv warmup --cache-dir fills it)")
    p.set_defaults(func=_cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="framekv",
        description="framekv: a CUDA-graph-centric runtime for autoregressive video diffusion.")
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="versions, the device, and which backends are usable")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=_cmd_info)
    _demo_args(sub.add_parser("demo", help="the main job: a timed, checked rollout of the "
                              "reference model (or of --model's)",
                              parents=[model_parent(skip=("steps", "decoder"))]))
    verify = sub.add_parser("verify", help="replay-correctness harness: eager vs graphs vs the fp32 reference")
    _rollout_args(verify, "default tiny")
    add_kv_dtype_argument(verify)
    verify.add_argument("--tolerance", type=tolerance, default=None,
                        help="max abs error allowed (default: 1e-4 in fp32, 2e-2 in bf16, "
                             "2.5e-1 over an fp8 pool)")
    verify.add_argument("--glue", choices=("fused", "torch"), default="fused",
                        help="the model's glue: framekv's fused ops (default) or torch ops")
    verify.add_argument("--json", metavar="FILE", type=writable_file, default=None,
                        help="also write the report as JSON to FILE (errors, and an fp8 "
                             "pool's saturation counts)")
    verify.set_defaults(func=_cmd_verify)
    _warmup_args(sub.add_parser("warmup", help="capture every graph a preset's rollout "
                                "replays, up front", parents=[model_parent(skip=("decoder",))]))
    bench.add_parser(sub)
    cluster.add_arguments(serve.add_parser(sub))
    cluster.add_parser(sub)
    generate.add_parser(sub)
    return p


#: the exit status of a command that Ctrl-C (SIGINT) stopped: 128 + the signal's number
INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    """``framekv COMMAND ...``: the command's exit status. Ctrl-C ends a command with one
    line, ``framekv COMMAND: interrupted``, and status 130, not a traceback (a server
    drains first: its sessions end cleanly)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        return args.func(args)
    except KeyboardInterrupt:
        # a terminal's cursor may stand in a progress bar, or after its ^C
        lead = "\n" if sys.stderr.isatty() else ""
        print(f"{lead}framekv {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
