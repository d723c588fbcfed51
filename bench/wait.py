"""What a graph launch costs after the host has waited, and what changes it.

    python -m framekv.bench.wait [--rounds 8] [--json out.json]

A whole-chunk replay launched back to back costs a few µs of host time; launched after
the host waited for the device, an order of magnitude more (docs/benchmarks.md). This
module isolates the wait: for three graphs of the seed geometry's stack (a one-kernel
graph, the commit, one 36-layer denoising forward, each replayed as a
`framekv.graphs.GraphCache` replays them: torch's replay) it
drains the device, lets the host pass 50 ms in one of several ways, and times the next
launch. Ways of passing the time:

- ``none``: launch at once after the drain;
- ``sleep``: the thread sleeps (the CPU may idle); ``spin``: it spins in Python;
- ``spin+launch``: it spins, launching the one-kernel graph on a side stream every
  0.5 ms from the same thread; ``spin+query``: it spins, querying the stream every 0.5 ms;
- ``sleep,launch``: it sleeps, then launches the one-kernel graph on a side stream
  right before the timed launch;
- ``sleep+keeper``: it sleeps while another thread launches the one-kernel graph on a
  side stream every 1 ms;
- ``sleep,pinned``: ``sleep`` with the thread pinned to one CPU.

Waits and graphs are taken in turn over the rounds. Each row has the median host µs of
the launch and the medians of minor page faults and context switches during it.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import threading
import time

import torch

from framekv.bench.timing import one_kernel_launcher, require_cuda, write_result
from framekv.bench.stack import AttentionStack
from framekv.graphs import GraphCache

PAUSE_S = 0.05


def _spin(seconds: float, every: float = 0.0, action=None) -> None:
    end, due = time.perf_counter() + seconds, 0.0
    while (now := time.perf_counter()) < end:
        if action is not None and now >= due:
            action()
            due = now + every


class _Keeper:
    """A thread that calls ``action`` every ``period`` seconds while it is entered."""

    def __init__(self, action, period: float):
        self.action, self.period, self.stop = action, period, threading.Event()
        self.device = torch.cuda.current_device()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        torch.cuda.set_device(self.device)  # a new thread has no current context
        while not self.stop.wait(self.period):
            self.action()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def _one_kernel_on(stream: torch.cuda.Stream | None):
    """A launcher of a one-kernel graph on ``stream`` (None: the current stream)."""
    launch = one_kernel_launcher()
    if stream is None:
        return launch

    def call() -> None:
        with torch.cuda.stream(stream):
            launch()
    return call


def _waits(side_launch, query) -> dict:
    sleep = lambda: time.sleep(PAUSE_S)  # noqa: E731
    return {
        "none": lambda: None,
        "sleep": sleep,
        "spin": lambda: _spin(PAUSE_S),
        "spin+launch": lambda: _spin(PAUSE_S, 5e-4, side_launch),
        "spin+query": lambda: _spin(PAUSE_S, 5e-4, query),
        "sleep,launch": lambda: (time.sleep(PAUSE_S), side_launch()),
        "sleep+keeper": sleep,
        "sleep,pinned": sleep,
    }


@contextlib.contextmanager
def _around(wait: str, side_launch):
    """What a wait needs around the whole sample: the keeper thread, or the pinning."""
    if wait == "sleep+keeper":
        with _Keeper(side_launch, 1e-3):
            yield
    elif wait == "sleep,pinned":
        every = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {min(every)})
        try:
            yield
        finally:
            os.sched_setaffinity(0, every)
    else:
        yield


def _launch_sample(launch, wait, drain) -> tuple[float, int, int]:
    drain()
    wait()
    r0 = resource.getrusage(resource.RUSAGE_THREAD)
    t0 = time.perf_counter()
    launch()
    us = (time.perf_counter() - t0) * 1e6
    r1 = resource.getrusage(resource.RUSAGE_THREAD)
    switches = r1.ru_nvcsw - r0.ru_nvcsw + r1.ru_nivcsw - r0.ru_nivcsw
    return us, r1.ru_minflt - r0.ru_minflt, switches


def _stack_launches():
    stack = AttentionStack.for_preset("seed-bench")
    g = stack.geometries[0]
    graphs, T = GraphCache("cuda"), g.max_staged_tokens
    keys = {}
    for name, req in (("commit (4 nodes)", stack.commit_request(g, T)),
                      ("denoising forward, 36 layers", stack.forward_request(g, T, T))):
        graphs.capture(req.key, req.fn, req.inputs, after_replay=req.after_replay,
                       warmup_fn=req.warmup_fn)
        keys[name] = req.key

    def commit() -> None:
        stack.cache.note_staged(T)
        graphs.replay(keys["commit (4 nodes)"])
    forward = keys["denoising forward, 36 layers"]
    return {"commit (4 nodes)": commit,
            "denoising forward, 36 layers": lambda: graphs.replay(forward)}, stack


def measure(rounds: int) -> list[dict]:
    launches, stack = _stack_launches()
    main_stream = torch.cuda.current_stream()
    launches = {"one-kernel graph": _one_kernel_on(None), **launches}
    side_launch = _one_kernel_on(torch.cuda.Stream())
    waits = _waits(side_launch, main_stream.query)
    commit = launches["commit (4 nodes)"]

    def drain() -> None:  # the window moves as in a rollout: a commit, then a wait
        commit()
        torch.cuda.synchronize()
    for launch in launches.values():
        launch()
    samples: dict[tuple[str, str], list] = {}
    for _ in range(rounds):
        for wname, wait in waits.items():
            for gname, launch in launches.items():
                with _around(wname, side_launch):
                    s = _launch_sample(launch, wait, drain)
                samples.setdefault((wname, gname), []).append(s)
    torch.cuda.synchronize()
    stack.cache.shutdown()
    return [{"wait": w, "graph": g, "host_us": statistics.median(x[0] for x in v),
             "host_us_min": min(x[0] for x in v),
             "minor_faults": statistics.median(x[1] for x in v),
             "context_switches": statistics.median(x[2] for x in v), "n": len(v)}
            for (w, g), v in samples.items()]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"unreadable ({e.strerror})"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    require_cuda("framekv.bench.wait")
    host = {"numa_balancing": _read("/proc/sys/kernel/numa_balancing"),
            "numa_nodes": len([d for d in os.listdir("/sys/devices/system/node")
                               if d.startswith("node")]) if os.path.isdir(
                                   "/sys/devices/system/node") else None,
            "cpus": len(os.sched_getaffinity(0))}
    print(f"host: {host}; launch after the device drained and {PAUSE_S * 1e3:.0f} ms passed")
    rows = measure(args.rounds)
    print(f"{'wait':<14}{'graph':<32}{'host µs':>9}{'min':>8}{'faults':>8}{'switches':>10}")
    for r in rows:
        print(f"{r['wait']:<14}{r['graph']:<32}{r['host_us']:>9.1f}{r['host_us_min']:>8.1f}"
              f"{r['minor_faults']:>8.0f}{r['context_switches']:>10.0f}")
    write_result(args.json, host=host, rows=rows)


if __name__ == "__main__":
    main()
