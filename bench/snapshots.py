"""Streams that leave the GPU: one stream's export and import against the PCIe bandwidth
of the same run, a restored stream checked bit for bit, and sessions swapped over fewer
slots than sessions.

    transfer   per preset (default wan-1.3b at a 21-frame window, small-stream): a
               one-stream `Rollout` filled past its window; ``export`` =
               `ChunkRunner.snapshot(0)` until its copy to pinned host memory is done,
               ``import`` = `ChunkRunner.restore(0, state)` into a second rollout's
               fresh row until the device is done (its prompt prefill included); host
               wall clock, ``rounds`` each, the first apart (its pinned host memory
               reserved up front, `CausalKVCache.reserve_exports`, as a server does),
               bytes moved. Beside them the pinned-memory copy bandwidth of a buffer of
               the same bytes, device to host and host to device (CUDA events).
               ``exact``: the restored rollout's next chunks equal the source's
               (torch.equal, graph replays on both).
    swap       `StreamScheduler` of the preset (default small-stream, ``--swap-quantum``
               steps a turn): ``sessions`` sessions over ``slots`` slots against
               ``slots`` sessions over as many slots, every session open-ended with a
               consumer thread taking its chunks; aggregate latent frames/s over
               ``seconds`` after a warm-up (``warmup`` seconds and, swapping, the
               second rotation: the first that restores), chunks per session (min,
               max), the steps, their batch sizes (rows -> steps) and scratch rows per
               step, the mean step seconds, the rotations, swaps, their bytes and host
               seconds; ``rotation_seconds``: the swapped run's step seconds beyond
               the resident run's, per rotation; graph captures after start (must be 0).

    python -m framekv.bench.snapshots [--sections transfer,swap] [--swap-quantum N] --json FILE
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

import torch

from .e2e import with_window
from .timing import require_cuda, stderr_progress, summary, write_result

SECTIONS = ("transfer", "swap")
#: swap: the longest the warm-up waits for the swapped run's second rotation
WARMUP_ROTATIONS_S = 300.0
TRANSFER_PRESETS = (("wan-1.3b", 21), ("small-stream", None))


def _filled(pair, model=None):
    """A captured one-stream rollout of ``pair`` with its window full."""
    from framekv.engine.rollout import Rollout

    r = Rollout(pair, "cuda", model=model)
    r.capture()
    r.prefill()
    for _ in range(-(-pair[1].window_frames // pair[1].frames_per_chunk) + 1):
        r.step()
    return r


def _wall(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def pcie_bandwidth(nbytes: int, iters: int = 5) -> dict:
    """GB/s of pinned host <-> device copies of ``nbytes`` (median of ``iters``)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        ms = []
        for _ in range(iters + 1):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(src, non_blocking=True)
            e.record()
            e.synchronize()
            ms.append(s.elapsed_time(e))
        out[f"{name}_gb_s"] = nbytes / (summary(ms[1:])["median"] / 1e3) / 1e9
    return out


def measure_transfer(preset: str, window: int | None, *, rounds: int = 5, check_chunks: int = 3,
                     progress=print) -> dict:
    """One stream's export and import (module doc)."""
    pair = with_window(preset, window)
    progress(f"transfer {preset}: filling the source stream")
    src = _filled(pair)
    dst = _filled(pair, src.model)
    src.cache.reserve_exports(1)  # its host memory page-locked up front, as a server does
    export_s, import_s, state = [], [], None
    for i in range(rounds + 1):
        progress(f"transfer {preset}: round {i}")
        t, state = _wall(lambda: _synced(src.snapshot(0)))
        export_s.append(t)
        dst.prefill_rows([0])                         # a fresh row: no write-back copy
        t, _ = _wall(lambda: dst.restore(0, state))
        import_s.append(t)
    exact = all(torch.equal(src.step(), dst.step()) for _ in range(check_chunks))
    nbytes = state.nbytes
    kv_bytes = sum(s.nbytes for s in state.sequences)
    res = {"preset": preset, "window_frames": pair[1].window_frames,
           "tokens_kept": state.sequences[0].k.shape[1], "bytes": nbytes, "kv_bytes": kv_bytes,
           "pool_bytes": src.cache.pool_bytes, "export_first_s": export_s[0],
           "import_first_s": import_s[0], "export_s": summary(export_s[1:]),
           "import_s": summary(import_s[1:]), "exact_after_restore": exact,
           "path": dst.path, **pcie_bandwidth(kv_bytes)}
    res["export_gb_s"] = nbytes / res["export_s"]["median"] / 1e9
    res["import_gb_s"] = nbytes / res["import_s"]["median"] / 1e9
    for r in (src, dst):
        r.close()
    torch.cuda.empty_cache()
    return res


def _synced(state):
    state.synchronize()
    return state


def _consume(sched, sid: str, stop: threading.Event, got: list) -> None:
    while not stop.is_set():
        chunk = sched.next_chunk(sid, timeout=0.5)
        if chunk is not None:
            sched.ack(sid, chunk.index)     # a client that keeps up: its queue never fills
            got.append(time.perf_counter())


def measure_swap(preset: str = "small-stream", *, sessions: int = 16, slots: int = 8,
                 seconds: float = 30.0, warmup: float = 10.0, device: str = "cuda",
                 quantum: int = 16, progress=print) -> dict:
    """``sessions`` over ``slots`` against ``slots`` resident (module doc)."""
    out = {}
    for name, n in (("resident", slots), ("swapped", sessions)):
        out[name] = _serve(preset, n, slots, seconds, warmup, device, quantum, progress)
        if out[name]["frames_per_second"] <= 0:
            raise RuntimeError(f"swap {preset}: {name} made no frames in {seconds} s")
    out["swapped_vs_resident"] = (out["swapped"]["frames_per_second"]
                                  / out["resident"]["frames_per_second"])
    sw, res = out["swapped"], out["resident"]
    out["rotation_seconds"] = ((sw["step_seconds_mean"] - res["step_seconds_mean"]) * sw["steps"]
                               / max(sw["rotations"], 1))
    return {"preset": preset, "sessions": sessions, "slots": slots, "swap_quantum": quantum,
            **out}


def _serve(preset, n: int, slots: int, seconds: float, warmup: float, device: str,
           quantum: int, progress) -> dict:
    from framekv.engine.serving import StreamScheduler

    progress(f"swap {preset}: {n} sessions over {slots} slots, capturing")
    sched = StreamScheduler(preset, max_sessions=n, slots=slots, device=device,
                            swap_quantum=quantum)
    captures0 = sched.metrics()["graph_captures"]
    ids = [sched.open_session(seed=i).id for i in range(n)]
    stop, got = threading.Event(), [[] for _ in ids]
    threads = [threading.Thread(target=_consume, args=(sched, sid, stop, g), daemon=True)
               for sid, g in zip(ids, got)]
    loop_stop = threading.Event()
    loop = threading.Thread(target=sched.run, args=(loop_stop,), daemon=True)
    for t in (*threads, loop):
        t.start()
    time.sleep(warmup)
    # swapping: past the second rotation too, the first whose swaps in restore streams
    deadline = time.monotonic() + WARMUP_ROTATIONS_S
    while (n > slots and sched.metrics()["rotations"] < 2 and time.monotonic() < deadline
           and loop.is_alive()):
        time.sleep(0.05)
    m0, t0, c0 = sched.metrics(), time.perf_counter(), sum(map(len, got))
    progress(f"swap {preset}: {n} sessions over {slots} slots, {seconds:.0f} s")
    time.sleep(seconds)
    m1, t1, c1 = sched.metrics(), time.perf_counter(), sum(map(len, got))
    loop_stop.set()
    stop.set()
    loop.join()
    per_session = [sum(t0 <= x < t1 for x in g) for g in got]
    res = {"sessions": n, "slots": slots, "seconds": t1 - t0,
           "frames_per_second": (c1 - c0) * sched.frames_per_chunk / (t1 - t0),
           "chunks_per_session_min": min(per_session), "chunks_per_session_max": max(per_session),
           "captures_after_start": m1["graph_captures"] - captures0, **_steps_between(m0, m1)}
    sched.close()
    if device == "cuda":
        torch.cuda.empty_cache()
    return res


def _steps_between(m0: dict, m1: dict) -> dict:
    """What the scheduler's metrics say of the steps between two snapshots: counts,
    batch sizes (rows -> steps), scratch rows per step, swaps and their seconds."""
    out = {k: m1[k] - m0[k] for k in ("steps", "rows", "scratch_rows", "rotations",
                                       "swap_outs", "swap_ins", "swap_bytes")}
    out["batch_sizes"] = {b: n - m0["batch_sizes"].get(b, 0)
                          for b, n in m1["batch_sizes"].items() if n > m0["batch_sizes"].get(b, 0)}
    steps = max(out["steps"], 1)
    out["scratch_rows_per_step"] = out["scratch_rows"] / steps
    out["step_seconds_mean"] = (m1["step_seconds"]["sum"] - m0["step_seconds"]["sum"]) / steps
    out["swap_seconds"] = m1["swap_seconds"]["sum"] - m0["swap_seconds"]["sum"]
    out["swap_seconds_per_rotation"] = out["swap_seconds"] / max(out["rotations"], 1)
    return out


def format_snapshots(res: dict) -> str:
    lines = []
    for t in res.get("transfer", []):
        lines.append(f"{t['preset']} ({t['window_frames']}-frame window): {t['tokens_kept']} "
                     f"tokens kept, {t['bytes'] / 2**30:.2f} GiB (pool {t['pool_bytes'] / 2**30:.2f} GiB)")
        lines.append(f"  export {t['export_s']['median'] * 1e3:8.1f} ms ({t['export_gb_s']:.1f} GB/s; "
                     f"first {t['export_first_s'] * 1e3:.1f} ms)   pinned D2H {t['d2h_gb_s']:.1f} GB/s")
        lines.append(f"  import {t['import_s']['median'] * 1e3:8.1f} ms ({t['import_gb_s']:.1f} GB/s; "
                     f"first {t['import_first_s'] * 1e3:.1f} ms)   pinned H2D {t['h2d_gb_s']:.1f} GB/s")
        lines.append(f"  restored stream equal bit for bit: {t['exact_after_restore']}")
    s = res.get("swap")
    if s:
        for name in ("resident", "swapped"):
            r = s[name]
            lines.append(f"{name:>9}: {r['sessions']} sessions / {r['slots']} slots  "
                         f"{r['frames_per_second']:.2f} latent frames/s, chunks per session "
                         f"{r['chunks_per_session_min']}-{r['chunks_per_session_max']}, "
                         f"swaps {r['swap_ins']}, captures {r['captures_after_start']}")
            lines.append(f"           {r['steps']} steps ({r['step_seconds_mean'] * 1e3:.1f} ms "
                         f"mean), batch sizes {r['batch_sizes']}, scratch rows per step "
                         f"{r['scratch_rows_per_step']:.2f}; {r['rotations']} rotations, "
                         f"{r['swap_seconds_per_rotation'] * 1e3:.1f} ms of swaps each")
        lines.append(f"  swapped / resident {s['swapped_vs_resident']:.3f} (swap quantum "
                     f"{s['swap_quantum']} steps; a rotation costs "
                     f"{s['rotation_seconds'] * 1e3:.1f} ms of steps beyond resident)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m framekv.bench.snapshots",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=30.0, help="swap: seconds measured")
    p.add_argument("--warmup", type=float, default=10.0, help="swap: seconds before measuring")
    p.add_argument("--swap-quantum", type=int, default=16, help="swap: the scheduler's turn")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    if args.swap_quantum < 1:
        p.error(f"--swap-quantum must be >= 1, got {args.swap_quantum}")
    require_cuda("framekv.bench.snapshots")
    sections = [s for s in args.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        p.error(f"--sections: unknown {bad}; choose from {list(SECTIONS)}")
    progress, res = stderr_progress("snapshots"), {}
    if "transfer" in sections:
        res["transfer"] = [measure_transfer(pr, w, rounds=args.rounds, progress=progress)
                           for pr, w in TRANSFER_PRESETS]
        write_result(args.json_path, snapshots=res)
    if "swap" in sections:
        res["swap"] = measure_swap(seconds=args.seconds, warmup=args.warmup,
                                   quantum=args.swap_quantum, progress=progress)
    print(format_snapshots(res))
    write_result(args.json_path, snapshots=res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
