"""The chunk cycle over every layer of a preset's attention stack.

One chunk of a rollout is ``denoising_steps`` forwards (the chunk one causal block),
the clean pass (one-frame blocks) and the commit, through all layers. Measured here:

- device time of each piece as its own graph (a denoising forward, the clean pass,
  the commit) and of the whole chunk as one graph, and the chunk against the sum of
  its pieces (what one graph costs beyond its kernels);
- the chunk as per-forward graphs (one replay per forward and the commit);
- host cost of one whole-chunk replay through the graph cache (host mirror included)
  and of torch's bare ``CUDAGraph.replay``: issued back to back while the device still
  runs earlier chunks (a serving loop that keeps the device fed: the launch cost
  proper), in a loop that waits for chunk k - 1 before launching chunk k + 1 (each
  launch while its predecessor runs, the previous run of the same graph just
  finished), right after the host waited for the device to drain, and after such a
  wait behind a ~2 ms sleep kernel; and of the commit's host side alone;
- the first CUDA call (a stream query) after the host waited for a chunk, and after
  it waited as long for a sleep kernel: the cost a call pays after a long wait,
  whatever the call, which the drained rows include;
- a one-kernel graph launched first after such a wait (drained, and in the
  double-buffered loop) with the whole chunk launched right behind it: what any first
  launch after a wait pays, apart from what the chunk's replay adds;
- the eager chunk for reference;
- the warm-up of the preset's plan in a new process, cold and with the cache dir of
  the cold run (numba kernels and cuDNN plans from disk).

The window is filled first (commits only: timing does not depend on K/V values), so
every forward attends the steady-state key count P + W + T.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import msgspec
import torch

from framekv import specs
from .stack import AttentionStack
from framekv.graphs import GraphCache, decode_report
from framekv.graphs.inspect import graph_info

from .timing import (after_wait_sequence_times, device_times,
                     double_buffered_host_times, double_buffered_sequence_times,
                     first_call_after, host_times, interleaved_device_times,
                     interleaved_host_times, one_kernel_launcher, pipelined_host_times,
                     summary, wall_times)

#: Sleep-kernel cycles about as long as the seed chunk on an H200 (~390 ms at ~2 GHz).
_CHUNK_SLEEP_CYCLES = 780_000_000


def _capture_all(stack: AttentionStack, graphs: GraphCache, g, T: int, frame: int, steps: int):
    keys = {}
    for name, req in (("denoise", stack.forward_request(g, T, T)),
                      ("clean", stack.forward_request(g, T, frame)),
                      ("commit", stack.commit_request(g, T)),
                      ("chunk", stack.chunk_request(g, T, denoise_steps=steps, clean_block=frame))):
        graphs.capture(req.key, req.fn, req.inputs, after_replay=req.after_replay,
                       warmup_fn=req.warmup_fn)
        keys[name] = req.key
    return keys


def _fill_window(stack: AttentionStack, graphs: GraphCache, commit_key, g, T: int) -> None:
    cache = stack.cache
    while cache.committed_tokens < g.pin_tokens + g.window_tokens:
        cache.note_staged(T)
        graphs.replay(commit_key)
    torch.cuda.synchronize()


def measure_chunk(preset: specs.Preset, *, iters: int = 10, progress=print) -> dict:
    """Device and host times of a preset's chunk cycle (see the module doc)."""
    g, r = preset.rollout.geometry(), preset.rollout
    T, frame, steps = g.max_staged_tokens, r.tokens_per_frame, r.denoising_steps
    stack = AttentionStack.for_preset(preset)
    graphs = GraphCache("cuda")
    progress(f"chunk: capturing {stack.kv.num_layers}-layer forwards, commit and whole chunk")
    keys = _capture_all(stack, graphs, g, T, frame, steps)
    stack.reset()
    stack.cache.open(g)
    _fill_window(stack, graphs, keys["commit"], g, T)
    cache = stack.cache

    def commit() -> None:
        cache.note_staged(T)
        graphs.replay(keys["commit"])

    def per_forward() -> None:
        for _ in range(steps):
            graphs.replay(keys["denoise"])
        graphs.replay(keys["clean"])
        commit()

    def chunk() -> None:
        graphs.replay(keys["chunk"])

    handle = graphs.get(keys["chunk"])
    x = stack.qkv_input(T)["qkv"]
    progress("chunk: timing pieces, per-forward graphs and the whole-chunk graph")
    # Taken in turn, so that the GPU's clock drifting over minutes of full load shifts
    # the pieces and the whole chunk alike.
    dev = interleaved_device_times({
        "denoise_forward": lambda: graphs.replay(keys["denoise"]),
        "clean_pass": lambda: graphs.replay(keys["clean"]),
        "commit": commit, "per_forward_graphs": per_forward, "whole_chunk_graph": chunk}, iters)
    dev["commit"] += device_times(commit, 50)
    host = interleaved_host_times({
        "whole_chunk_replay": chunk, "whole_chunk_replay_busy": chunk,
        "whole_chunk_cudagraph_launch": handle.graph.replay,
        "whole_chunk_cudagraph_launch_busy": handle.graph.replay}, max(iters, 30),
        busy=("whole_chunk_replay_busy", "whole_chunk_cudagraph_launch_busy"))
    piped = pipelined_host_times({"whole_chunk_replay_pipelined": chunk,
                                  "whole_chunk_cudagraph_launch_pipelined": handle.graph.replay},
                                 max(iters // 2, 4))
    host.update(piped)
    host.update(_behind_one_kernel(chunk, max(iters, 30)))
    host.update({
        "whole_chunk_replay_double_buffered": double_buffered_host_times(chunk, iters),
        "first_call_after_chunk": first_call_after(chunk, 10),
        "first_call_after_sleep": first_call_after(
            lambda: torch.cuda._sleep(_CHUNK_SLEEP_CYCLES), 10),
        "per_forward_replays": host_times(per_forward, max(iters, 20)),
        "commit_replay": host_times(commit, 50),
        "commit_eager": host_times(lambda: (cache.note_staged(T), cache.commit(T)), 50),
        "chunk_eager_wall": wall_times(lambda: stack.chunk(
            x, T, denoise_steps=steps, clean_block=frame), 3)})
    out = _chunk_result(dev, host, stack, g, T, frame, steps)
    out["chunk_graph"] = {**msgspec.structs.asdict(graph_info(handle.graph)),
                          "memsets_replaced": handle.memsets_replaced}
    graphs.clear()
    cache.shutdown()
    return out


def _behind_one_kernel(chunk, iters: int) -> dict[str, list[float]]:
    """The whole chunk issued right behind a one-kernel graph, after a wait (drained and
    double-buffered): the one kernel's launch shows what any first launch after a wait
    costs, and the chunk's launch behind it what the replay itself adds."""
    lead = one_kernel_launcher()
    drained = after_wait_sequence_times({"lead": lead, "chunk": chunk}, iters)
    piped = double_buffered_sequence_times({"lead": lead, "chunk": chunk}, max(iters // 3, 8))
    return {"one_kernel_graph_drained": drained["lead"],
            "whole_chunk_replay_behind_it_drained": drained["chunk"],
            "one_kernel_graph_double_buffered": piped["lead"],
            "whole_chunk_replay_behind_it_double_buffered": piped["chunk"]}


def _chunk_result(dev, host, stack, g, T, frame, steps) -> dict:
    med = {k: statistics.median(v) for k, v in dev.items()}
    parts = steps * med["denoise_forward"] + med["clean_pass"] + med["commit"]
    out = {
        "layers": stack.kv.num_layers, "tokens": T, "clean_block": frame,
        "denoising_steps": steps, "keys": g.pin_tokens + g.window_tokens + T,
        "device_us": {k: summary(v) for k, v in dev.items()},
        "host_us": {k: summary(v) for k, v in host.items()},
        "sum_of_pieces_us": parts,
        "whole_chunk_over_pieces": med["whole_chunk_graph"] / parts,
        # Adjacent in time, so clock drift cancels: the cleaner comparison.
        "whole_over_per_forward_paired": statistics.median(
            w / p for w, p in zip(dev["whole_chunk_graph"], dev["per_forward_graphs"])),
    }
    return out


def measure_warmup(preset_name: str, progress=print) -> dict:
    """``framekv warmup PRESET`` (the preset's rollout) in two new processes sharing a
    fresh cache dir."""
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label in ("cold", "warm"):
            progress(f"warm-up: {label} process")
            path = os.path.join(tmp, f"{label}.json")
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "framekv.tools.warmup", preset_name,
                                   "--device", "cuda", "--cache-dir", os.path.join(tmp, "cache"),
                                   "--json", path, "--no-progress"], capture_output=True, text=True)
            wall = time.perf_counter() - start
            if proc.returncode:
                raise RuntimeError(f"framekv warmup {preset_name} failed:\n{proc.stderr}")
            report = decode_report(open(path, "rb").read())
            plans = [ln for ln in proc.stdout.splitlines() if ln.startswith("numba kernels:")]
            out[label] = {"warmup_seconds": report.seconds, "process_seconds": wall,
                          "graphs": report.graphs, "reserved_bytes": report.reserved_bytes,
                          "builds": plans[0] if plans else ""}
    return out


def format_chunk(res: dict) -> str:
    d, h = res["device_us"], res["host_us"]
    lines = [f"chunk cycle: {res['layers']} layers, T={res['tokens']} over {res['keys']} keys, "
             f"{res['denoising_steps']} denoising forwards + clean pass "
             f"({res['clean_block']}-token blocks) + commit",
             f"  {'device (median µs)':<40}{'median':>12}{'p10':>12}{'p90':>12}"]
    for k, v in d.items():
        lines.append(f"  {k:<40}{v['median']:>12.1f}{v['p10']:>12.1f}{v['p90']:>12.1f}")
    lines.append(f"  whole chunk / sum of pieces = {res['whole_chunk_over_pieces']:.4f} "
                 f"(pieces {res['sum_of_pieces_us']:.1f} µs); per iteration, whole chunk / "
                 f"per-forward graphs = {res['whole_over_per_forward_paired']:.4f}")
    if "chunk_graph" in res:
        cg = res["chunk_graph"]
        lines.append(f"  chunk graph: {cg['nodes']} nodes {cg['types']}, straight-line "
                     f"{cg['straight_line']}, {cg['memsets_replaced']} memsets made kernels")
    lines.append(f"  {'host (median µs)':<40}{'median':>12}{'p10':>12}{'p90':>12}")
    for k, v in h.items():
        lines.append(f"  {k:<40}{v['median']:>12.1f}{v['p10']:>12.1f}{v['p90']:>12.1f}")
    return "\n".join(lines)


def format_warmup(res: dict) -> str:
    lines = ["warm-up of the preset's rollout in a new process (cold, then with the cold "
             "run's cache dir):"]
    for label, r in res.items():
        lines.append(f"  {label:<5} warm-up {r['warmup_seconds']:8.2f} s, process "
                     f"{r['process_seconds']:6.1f} s, {r['graphs']} graphs, "
                     f"{r['reserved_bytes'] / 2**20:.0f} MiB pool; {r['builds']}")
    return "\n".join(lines)
