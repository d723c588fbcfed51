"""cuDNN's execution plans for framekv's paged forwards, each timed against the others.

framekv builds each paged SDPA graph with the first plan cuDNN's heuristics rank
(`cudnn_graph.build_graph`). This asks whether another plan would be faster: for a
preset's geometry, window full (`attention.Setup`), and each forward (the denoising
forward, one block; the clean pass, one-frame blocks) at the layout the backend chooses
and unpacked unsplit, the graph is rebuilt with every plan the heuristics propose (modes
A, B and the fallback: `cudnn_graph.candidate_plans`) and each plan runs the same
launch, the same tensors. Only the cuDNN call is timed (no K/V write, no merge), with
CUDA events, the L2 flushed before each, the plans in turn with the order rotated every
round; ``backend`` is the graph the backend built, for reference. TFLOP/s count the
forward's FLOPs (`attention.Setup.flops`), against the bf16 matmul ceiling of the same
run.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from framekv import specs
from framekv.engine import CachedAttention
from framekv.engine.attention.cudnn import CudnnBackend
from framekv.engine.attention.cudnn_graph import candidate_plans

from .attention import Setup
from .timing import (Flusher, interleaved_device_times, matmul_ceiling, require_cuda,
                     stderr_progress, summary, write_result)


def plan_calls(backend: CudnnBackend, plan, q, out) -> tuple[dict, dict]:
    """name -> callable of the backend's built graph (``backend``) and of every plan
    cuDNN proposes for its key (``plan <i>``), each one launch of ``plan`` (a prepared
    `CudnnPlan`) for q, out [T, H, D]; and name -> the plan's cuDNN name and workspace."""
    exe, pack = plan.launch(q, 0, out)
    handle = backend.handle_on_stream(q.device)
    calls = {"backend": lambda: exe.graph.execute(pack, exe.workspace, handle=handle)}
    info = {"backend": {"workspace": exe.workspace.numel()}}
    graph = candidate_plans(exe.key, backend.handle())
    for i in range(graph.get_execution_plan_count()):
        name = f"plan {i}"
        try:
            graph.build_plan_at_index(i)
            size = graph.get_workspace_size_plan_at_index(i)
        except Exception as e:  # a proposed plan cuDNN then cannot build: say so, go on
            info[name] = {"cudnn_name": graph.get_plan_name_at_index(i), "error": str(e)[:200]}
            continue
        ws = torch.empty(max(size, 1), dtype=torch.uint8, device=q.device)
        calls[name] = (lambda i=i, ws=ws: graph.execute_plan_at_index(pack, ws, i, handle=handle))
        info[name] = {"cudnn_name": graph.get_plan_name_at_index(i), "workspace": size}
    return calls, info


def measure_plans(preset: str, *, iters: int = 30, ceiling: float | None = None,
                  progress=print) -> dict:
    """Every proposed plan of each forward and layout (module doc), timed."""
    st = Setup(specs.load_preset(preset))
    flusher = Flusher(True)
    ceiling = ceiling or matmul_ceiling(flusher)
    rows = []
    for forward, b in (("denoise", st.T), ("clean", st.frame)):
        for layout in ("auto", "unpacked S=1"):
            backend = CudnnBackend() if layout == "auto" else CudnnBackend(split=1, pack=False)
            mod = CachedAttention(st.H, st.HKV, st.D, backend=backend, layer_idx=0)
            mod(st.qkv, kv_cache=st.cache, seq_len=st.T, causal_block_size=b)  # stage K/V
            plan = mod.plan_for(st.cache, st.T, b)
            plan.prepare(None)
            out = torch.empty_like(st.q)
            calls, info = plan_calls(backend, plan, st.q, out)
            progress(f"cudnn plans {preset} {forward} ({layout}: S = {plan.splits}, packed "
                     f"{plan.packed}): {len(calls) - 1} plans")
            times = interleaved_device_times(calls, iters, flusher, rotate=True)
            flops = st.flops(b)
            plans = {n: {**info[n], **({"us": summary(times[n]),
                                       "tflops": flops / statistics.median(times[n]) / 1e6}
                                      if n in times else {})} for n in info}
            for r in plans.values():
                if "tflops" in r:
                    r["fraction_of_ceiling"] = r["tflops"] / ceiling
            rows.append({"forward": forward, "layout": layout, "splits": plan.splits,
                         "packed": plan.packed, "plans": plans})
    st.cache.shutdown()
    return {"preset": preset, "matmul_tflops": ceiling, "forwards": rows}


def format_plans(res: dict) -> str:
    """The result as a table: one line per plan of each forward and layout."""
    lines = [f"cuDNN plans, {res['preset']}: matmul ceiling {res['matmul_tflops']:.0f} TFLOP/s",
             f"  {'forward':<9}{'layout':<14}{'S/pack':>7}  {'plan':<9}{'cuDNN name':<22}"
             f"{'median µs':>10}{'TFLOP/s':>9}{'of ceil':>8}"]
    for row in res["forwards"]:
        layout = f"{row['splits']}/{'p' if row['packed'] else '-'}"
        for name, r in row["plans"].items():
            head = f"  {row['forward']:<9}{row['layout']:<14}{layout:>7}  {name:<9}" \
                   f"{r.get('cudnn_name', '(built)'):<22}"
            if "us" not in r:
                lines.append(head + f"  not built: {r.get('error', '?')[:60]}")
                continue
            lines.append(head + f"{r['us']['median']:>10.1f}{r['tflops']:>9.0f}"
                         f"{r['fraction_of_ceiling']:>8.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m framekv.bench.cudnn_plans",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", action="append", default=None,
                   help="preset (repeatable; default seed-bench and wan-1.3b)")
    p.add_argument("--iters", type=int, default=30, help="timed rounds (default 30)")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    require_cuda("framekv.bench.cudnn_plans")
    out = []
    for name in args.preset or ("seed-bench", "wan-1.3b"):
        out.append(measure_plans(name, iters=args.iters, progress=stderr_progress("plans")))
        print(format_plans(out[-1]), flush=True)
        write_result(args.json_path, plans=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
