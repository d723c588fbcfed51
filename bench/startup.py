"""Process start to the first replayed chunk, cold and warm.

What a server pays between ``exec`` and its first streamed chunk: interpreter and
imports, the model and cache, the captures (numba compiles, cuDNN plan builds, warm-up
calls, graph capture), the prompt, one replayed chunk. Each variant is a new process:

    cold   a fresh, empty cache dir: every kernel compiled, every cuDNN plan built
    warm   the same cache dir after ``framekv warmup PRESET --cache-dir DIR`` ran in
           another process: kernels and plans loaded from disk

The parent times from spawning the child to the child's line saying the first chunk is
done (the device synchronised); the child reports its own phases and what it built.

    python -m framekv.bench.startup --presets tiny,wan-1.3b --json FILE
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

#: The child: a server's start, up to its first replayed chunk. argv: preset, cache dir.
_CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
from framekv.engine import Rollout
from framekv.engine.cache_dir import build_counts
t_import = time.perf_counter()
r = Rollout(sys.argv[1], "cuda", cache_dir=sys.argv[2])
torch.cuda.synchronize()
t_build = time.perf_counter()
r.capture()
torch.cuda.synchronize()
t_capture = time.perf_counter()
r.prefill()
r.step()
torch.cuda.synchronize()
t_chunk = time.perf_counter()
phases = {"import_s": t_import - t0, "build_s": t_build - t_import,
          "capture_s": t_capture - t_build, "prefill_and_chunk_s": t_chunk - t_capture}
print("FIRST-CHUNK " + json.dumps({"phases": phases,
                                   "builds": build_counts(r.model.blocks[0].attn.backend),
                                   "graph_paths": r.paths}), flush=True)
r.close()
"""


def start_to_first_chunk(preset: str, cache_dir: str, timeout_s: float = 900) -> dict:
    """One child process: wall seconds from spawn to its first chunk, and its report."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, preset, cache_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report, wall = None, None
    for line in proc.stdout:
        if line.startswith("FIRST-CHUNK "):
            wall = time.perf_counter() - start
            report = json.loads(line.split(" ", 1)[1])
    err = proc.stderr.read()
    if proc.wait(timeout=timeout_s) or report is None:
        raise RuntimeError(f"the startup child for {preset} failed (exit {proc.returncode}):\n{err}")
    return {"start_to_first_chunk_s": wall, **report}


def warm_cache(preset: str, cache_dir: str) -> None:
    """``framekv warmup PRESET --cache-dir DIR`` in its own process."""
    proc = subprocess.run([sys.executable, "-m", "framekv.tools.warmup", preset, "--device",
                           "cuda", "--cache-dir", cache_dir, "--no-progress"],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"framekv warmup {preset} failed:\n{proc.stderr}")


def measure_startup(presets: list[str], progress=print) -> dict:
    """Cold and warm start to first chunk of each preset (fresh cache dirs)."""
    out = {}
    for preset in presets:
        with tempfile.TemporaryDirectory() as tmp:
            cache_dir = os.path.join(tmp, "cache")
            progress(f"startup: {preset} cold")
            cold = start_to_first_chunk(preset, cache_dir)
            fresh = os.path.join(tmp, "warmed")
            progress(f"startup: {preset} framekv warmup, then warm")
            warm_cache(preset, fresh)
            out[preset] = {"cold": cold, "warm": start_to_first_chunk(preset, fresh)}
    return out


def format_startup(res: dict) -> str:
    lines = ["process start to first replayed chunk (cold: empty cache dir; warm: after "
             "framekv warmup --cache-dir):",
             f"  {'preset':<12}{'run':<6}{'total s':>9}{'import':>9}{'build':>9}{'capture':>9}"
             f"{'chunk':>9}  builds"]
    for preset, runs in res.items():
        for label, r in runs.items():
            p, b = r["phases"], r["builds"]
            built = (f"numba {b['numba_compiled']} compiled / {b['numba_loaded']} loaded, "
                     f"cuDNN {b.get('cudnn_plans_built', 0)} built / "
                     f"{b.get('cudnn_plans_loaded', 0)} loaded")
            lines.append(f"  {preset:<12}{label:<6}{r['start_to_first_chunk_s']:>9.2f}"
                         f"{p['import_s']:>9.2f}{p['build_s']:>9.2f}{p['capture_s']:>9.2f}"
                         f"{p['prefill_and_chunk_s']:>9.2f}  {built}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m framekv.bench.startup",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="tiny,wan-1.3b", help="comma-separated preset names")
    p.add_argument("--json", dest="json_path", metavar="FILE", default=None)
    args = p.parse_args(argv)
    from framekv.bench.timing import require_cuda, stderr_progress, write_result

    require_cuda("framekv.bench.startup")
    res = measure_startup([s for s in args.presets.split(",") if s],
                          progress=stderr_progress("startup"))
    print(format_startup(res))
    write_result(args.json_path, startup=res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
