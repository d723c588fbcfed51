"""bf16 against fp8: the same work over the model's-dtype pool, an fp8 pool, and an fp8
pool with fp8 GEMMs, in one run, side by side, speed beside accuracy.

    python -m framekv.bench.fp8 [--parts forward,dit,reference,wan] [--forward-preset P]
        [--iters 50] [--preset wan-1.3b] [--window 21] [--chunks 8] [--rounds 10]
        [--wan-configs 1.3b[,14b]] [--wan-chunks 20] [--wan-order auto] [--json FILE]

(also ``framekv bench --sections fp8``, or ``framekv bench --kv-dtype both``). Parts:

    forward    one layer's paged attention forward at the seed geometry (seed-bench,
               `framekv.bench.attention`'s; ``--forward-preset``), the denoising
               forward and the clean pass, over a bf16 and an fp8 pool of the same K/V:
               median µs of each, rotated, the fp8 speed-up, and max and mean |d| of
               each output against fp32 exact-window attention over the unquantized
               K/V (`framekv.bench.fp8_forward`; ``--iters`` rounds)
    dit        the reference DiT of ``--preset``, one held-out chunk's whole forward (no
               K/V store) with its GEMMs in bf16 and in fp8: max and mean |d| of the
               velocity against the model in fp32, median µs of each graphed forward
               and the fp8 GEMMs' speed-up (`framekv.bench.fp8_dit`; ``--iters`` rounds)
    reference  the reference DiT of ``--preset`` at a ``--window``-frame window in three
               runs (`fp8_common.RUNS`: "bf16", "fp8" K/V, "fp8-gemm" K/V and GEMMs):
               attention errors at three layers, each fp8 run's latents' relative L2
               from the bf16 run over ``--chunks`` chunks, ms per chunk rotated
               (`framekv.bench.fp8_reference`; ``--rounds`` rounds)
    wan        diffusers' Wan transformer at each of ``--wan-configs`` (random weights,
               bf16), `WanRollout` in the three runs on one model: each fp8 run's
               latents' relative L2 from the bf16 run over ``--wan-chunks`` chunks, ms per
               chunk, latent frames per second, the speed-ups, peak memory
               (`framekv.bench.fp8_wan`; ``--rounds`` rounds; ``--wan-order``)

Each part prints its table as it finishes, then a summary of all; ``--json`` holds
every number. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import sys

from .fp8_common import subset_of
from .fp8_dit import format_dit, measure_dit
from .fp8_forward import format_forward, measure_forward
from .fp8_reference import format_reference, measure_reference
from .fp8_wan import ORDERS, format_wan_pools, measure_wan_pools
from .timing import require_cuda, stderr_progress, write_result

PARTS = ("forward", "dit", "reference", "wan")


def _check(name: str, value, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_options(parts, wan_configs, wan_order, **counts) -> None:
    """ValueError naming the first bad option: ``parts`` a non-empty subset of `PARTS`,
    ``wan_configs`` names of `framekv.engine.wan.CONFIGS` (or config dicts), ``wan_order``
    one of `fp8_wan.ORDERS`, every count an integer >= 1."""
    from framekv.engine.wan import CONFIGS

    if not parts or any(p not in PARTS for p in parts):
        raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {parts!r}")
    if not wan_configs or any(not isinstance(c, dict) and c not in CONFIGS for c in wan_configs):
        raise ValueError(f"wan_configs must name configs of {sorted(CONFIGS)}, got {wan_configs!r}")
    if wan_order not in ORDERS:
        raise ValueError(f"wan_order must be one of {ORDERS}, got {wan_order!r}")
    for name, value in counts.items():
        _check(name, value)


def measure_parts(preset="wan-1.3b", *, parts=PARTS, forward_preset="seed-bench",
                  window_frames: int | None = 21, chunks: int = 8, rounds: int = 10,
                  iters: int = 50, wan_configs=("1.3b",), wan_chunks: int = 20,
                  wan_order: str = "auto", wan_sizes: dict | None = None, device="cuda",
                  backend=None, progress=print):
    """Yield (part, result) as each part finishes (module doc), in `PARTS` order, one
    "wan" result per config. Every option is checked (`check_options`) before anything
    runs. ``wan_sizes``: `WanRollout` sizes over `fp8_wan.SIZES` (and ``prompt_tokens``);
    ``device``, ``backend``: every part's (a CPU runs the same code with host timers)."""
    check_options(parts, wan_configs, wan_order, chunks=chunks, rounds=rounds, iters=iters,
                  wan_chunks=wan_chunks)
    if "forward" in parts:
        yield "forward", measure_forward(forward_preset, iters=iters, device=device,
                                         backend=backend, progress=progress)
    if "dit" in parts:
        yield "dit", measure_dit(preset, rounds=iters, device=device, progress=progress)
    if "reference" in parts:
        yield "reference", measure_reference(preset, window_frames=window_frames, chunks=chunks,
                                             rounds=rounds, device=device, backend=backend,
                                             progress=progress)
    if "wan" in parts:
        for config in wan_configs:
            yield "wan", measure_wan_pools(config, chunks=wan_chunks, rounds=rounds,
                                           order=wan_order, device=device, backend=backend,
                                           progress=progress, **(wan_sizes or {}))


def collect(out: dict, part: str, res: dict) -> None:
    """Put one `measure_parts` result into the section's dict (``wan``: a list)."""
    if part == "wan":
        out.setdefault("wan", []).append(res)
    else:
        out[part] = res


def measure_fp8(preset="wan-1.3b", **kw) -> dict:
    """Every part's result in one dict: ``parts`` (those run), ``forward``, ``dit``,
    ``reference`` and ``wan`` (a list, one per config); arguments as `measure_parts`."""
    out = {"parts": list(kw.get("parts", PARTS))}
    for part, res in measure_parts(preset, **kw):
        collect(out, part, res)
    return out


def format_part(part: str, res: dict) -> str:
    """One part's table."""
    return {"forward": format_forward, "dit": format_dit, "reference": format_reference,
            "wan": format_wan_pools}[part](res)


def summary_rows(res: dict) -> list[tuple[str, float, float, float, str]]:
    """(what, bf16 time, the fp8 run's time, its speed-up, its error) of every part in
    ``res``: a row per fp8 run (fp8 K/V; fp8 K/V and GEMMs) where a part has both."""
    rows = []
    for pas in ("denoise", "clean") if "forward" in res else ():
        p = {pool: res["forward"]["pools"][pool]["passes"][pas] for pool in ("bf16", "fp8")}
        t = [p[pool]["us"]["median"] for pool in ("bf16", "fp8")]
        rows.append((f"forward {pas} µs", *t, t[0] / t[1], f"max|d| {p['fp8']['max_abs']:.2e} "
                     f"(bf16 {p['bf16']['max_abs']:.2e})"))
        if "call_us" in p["bf16"]:
            t = [p[pool]["call_us"]["median"] for pool in ("bf16", "fp8")]
            rows.append((f"forward {pas} call µs", *t, t[0] / t[1], "-"))
    if "dit" in res:
        d = res["dit"]
        t = [d["us"][n]["median"] for n in ("bf16", "fp8-gemm")]
        c = d["check"]
        rows.append(("dit fp8-gemm forward µs", *t, t[0] / t[1],
                     f"vs fp32 max|d| {c['fp8-gemm']['max_abs']:.2e} mean "
                     f"{c['fp8-gemm']['mean_abs']:.2e} (bf16 {c['bf16']['max_abs']:.2e} / "
                     f"{c['bf16']['mean_abs']:.2e})"))
    runs = ([("reference", res["reference"])] if "reference" in res else []) + [
        (f"wan {w['config']}", w) for w in res.get("wan", [])]
    for what, r in runs:
        for name in (n for n in r["pools"] if n != "bf16"):
            t = [r["pools"][p]["chunk_ms"]["median"] for p in ("bf16", name)]
            d = r["pools"][name]["latents_rel_l2"]
            rows.append((f"{what} {name} ms/chunk", *t, t[0] / t[1],
                         f"latents rel L2 median {d['median']:.2e}, max {d['max']:.2e}"))
    return rows


def format_summary(res: dict) -> str:
    """Every part in one table: bf16's time, each fp8 run's, its speed-up and error."""
    lines = ["bf16 vs fp8, summary (speed-up = bf16 time / fp8 time)",
             f"  {'':<32}{'bf16':>11}{'fp8':>11}{'speed-up':>10}  fp8 error"]
    for what, a, b, s, err in summary_rows(res):
        lines.append(f"  {what:<32}{a:>11.2f}{b:>11.2f}{s:>10.3f}  {err}")
    return "\n".join(lines)


def format_fp8(res: dict) -> str:
    """The section's tables: each part's, then the summary."""
    tables = [format_part(p, r) for p in PARTS if p in res
              for r in (res[p] if p == "wan" else [res[p]])]
    return "\n".join(tables + [format_summary(res)])


def parser() -> argparse.ArgumentParser:
    """The module's command line."""
    from framekv.engine.wan import CONFIGS

    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m framekv.bench.fp8",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", type=subset_of(PARTS), default=PARTS,
                   help=f"comma-separated: {','.join(PARTS)} (default all)")
    p.add_argument("--forward-preset", default="seed-bench",
                   help="the forward part's geometry (default seed-bench)")
    p.add_argument("--iters", type=int, default=50,
                   help="forward and dit rounds (default 50)")
    p.add_argument("--preset", default="wan-1.3b", help="the dit and reference parts' model "
                   "preset (default wan-1.3b)")
    p.add_argument("--window", type=int, default=21, help="reference window frames (default 21)")
    p.add_argument("--chunks", type=int, default=8,
                   help="reference chunks whose latents are compared (default 8)")
    p.add_argument("--rounds", type=int, default=10,
                   help="timed rounds of the reference and wan parts (default 10)")
    p.add_argument("--wan-configs", type=subset_of(tuple(CONFIGS)), default=("1.3b",),
                   help=f"comma-separated Wan configs of {','.join(CONFIGS)} (default 1.3b)")
    p.add_argument("--wan-chunks", type=int, default=20,
                   help="Wan chunks whose latents are compared (default 20)")
    p.add_argument("--wan-order", choices=ORDERS, default="auto",
                   help="Wan rollouts timed in turn (rotated), one after the other "
                        "(sequential), or rotated where both pools fit (auto, default)")
    p.add_argument("--json", dest="json_path", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    kw = dict(parts=args.parts, forward_preset=args.forward_preset, window_frames=args.window,
              chunks=args.chunks, rounds=args.rounds, iters=args.iters,
              wan_configs=args.wan_configs, wan_chunks=args.wan_chunks, wan_order=args.wan_order)
    try:
        check_options(args.parts, args.wan_configs, args.wan_order, chunks=args.chunks,
                      rounds=args.rounds, iters=args.iters, wan_chunks=args.wan_chunks)
    except ValueError as exc:
        print(f"python -m framekv.bench.fp8: error: {exc}", file=sys.stderr)
        return 2
    require_cuda("framekv.bench.fp8")
    res = {"parts": list(args.parts)}
    for part, r in measure_parts(args.preset, progress=stderr_progress("fp8"), **kw):
        collect(res, part, r)
        print(format_part(part, r), flush=True)
        write_result(args.json_path, fp8=res)  # after each part: a cut-short run keeps it
    print(format_summary(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
