"""Timing primitives shared by the benchmark sections.

Every device time is a CUDA-event interval around one replay of a captured CUDA graph
(launch overhead is out of the number), taken after warm-up, with the L2 cache flushed
before each interval where asked. Host times are `time.perf_counter` intervals.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from typing import Callable

import torch

#: Bytes written to flush the L2 (H200: 60 MiB of L2; four times that evicts it all).
FLUSH_BYTES = 256 << 20


def summary(samples: list[float]) -> dict[str, float]:
    """median, p10, p90, min and count of ``samples``."""
    ts = sorted(samples)
    n = len(ts)
    return {"median": statistics.median(ts), "p10": ts[n // 10], "p90": ts[(9 * n) // 10],
            "min": ts[0], "n": n}


def summary_ms(samples_us: list[float]) -> dict[str, float]:
    """`summary` of samples in µs, given in ms (the count as it is)."""
    return {k: v / 1e3 if k != "n" else v for k, v in summary(samples_us).items()}


def check_bf16_close(name: str, got: torch.Tensor, want: torch.Tensor,
                     atol: float) -> float:
    """Max abs error of ``got`` against a torch reference; stop the bench unless every
    value is within two bf16 units in the last place (relative) plus ``atol``."""
    err = (got.float() - want.float()).abs()
    if not torch.all(err <= want.float().abs() * 2 ** -7 + atol):
        raise SystemExit(f"{name}: result differs from the torch reference "
                         f"(max abs error {err.max().item():.3e})")
    return err.max().item()


def captured_graph(fn: Callable[[], object], launches: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``launches`` calls of ``fn``, warmed up on a side stream first
    (lazy initialisation, kernel loading and cuDNN plans stay out of the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(launches):
            fn()
    for _ in range(3):
        graph.replay()
    return graph


def one_kernel_launcher() -> Callable[[], None]:
    """A launcher of a captured one-kernel graph (one float incremented) through torch's
    ``CUDAGraph.replay``, as a `framekv.graphs.GraphCache` replays graphs. It holds the
    buffer the graph writes, so the buffer lives as long as the launcher."""
    one = torch.zeros(1, device="cuda")
    graph = captured_graph(lambda: one.add_(1))

    def call(_written=one) -> None:
        graph.replay()
    return call


class Flusher:
    """Evicts the L2 by zeroing a buffer larger than it (one memset kernel)."""

    def __init__(self, enabled: bool = True):
        self.buf = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda") if enabled else None

    def __call__(self) -> None:
        if self.buf is not None:
            self.buf.zero_()


def device_times(replay: Callable[[], object], iters: int, flush: Flusher | None = None,
                 warmup: int = 3) -> list[float]:
    """µs of each of ``iters`` calls of ``replay`` between CUDA events (flushed before each)."""
    for _ in range(warmup):
        replay()
    pairs = [_between_events(replay, flush) for _ in range(iters)]
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in pairs]


def _between_events(call: Callable[[], object], flush: Flusher | None):
    """(start, end) CUDA events recorded around one ``call``, the L2 flushed before."""
    if flush is not None:
        flush()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    return start, end


def round_order(names: list[str], r: int, rotate: bool) -> list[str]:
    """The order of round ``r``: ``names`` as given, or rotated to start r places on."""
    k = r % len(names) if rotate and names else 0
    return names[k:] + names[:k]


def interleaved_device_times(calls: dict[str, Callable[[], object]], iters: int,
                             flush: Flusher | None = None, warmup: int = 2,
                             rotate: bool = False) -> dict[str, list[float]]:
    """`device_times` of several callables taken in turn (A B C A B C ...), so that slow
    drifts of the clock (a GPU heating up over seconds of work) hit each alike; with
    ``rotate`` each round starts one variant later (A B C, B C A, C A B, ...), so no
    variant is always the first after the host's sync."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    pairs = {name: [] for name in calls}
    for r in range(iters):
        for name in round_order(list(calls), r, rotate):
            pairs[name].append(_between_events(calls[name], flush))
        torch.cuda.synchronize()
    return {name: [s.elapsed_time(e) * 1e3 for s, e in ps] for name, ps in pairs.items()}


#: Cycles of the sleep kernel a ``busy`` host time queues behind (~2 ms on an H200).
BUSY_CYCLES = 4_000_000


def _host_time(call: Callable[[], object], drain: bool, busy: bool) -> float:
    if drain or busy:
        torch.cuda.synchronize()
    if busy:
        torch.cuda._sleep(BUSY_CYCLES)
    t0 = time.perf_counter()
    call()
    return (time.perf_counter() - t0) * 1e6


def host_times(call: Callable[[], object], iters: int, *, drain: bool = True,
               busy: bool = False) -> list[float]:
    """µs of host wall per call of ``call``; with ``drain`` the device is idle before each
    call, so the number is the launch cost, not time spent waiting on a full queue.
    With ``busy`` the device is drained, then given a ~2 ms sleep kernel, and the call
    queues behind it: the launch cost of a pipelined caller whose device still works."""
    out = [_host_time(call, drain, busy) for _ in range(iters)]
    torch.cuda.synchronize()
    return out


def interleaved_host_times(calls: dict[str, Callable[[], object]], iters: int, *,
                           busy: tuple[str, ...] = ()) -> dict[str, list[float]]:
    """`host_times` (drained) of several callables taken in turn, so that the host's
    own drifts (frequency, other load) hit each alike; names in ``busy`` are timed
    queued behind a sleep kernel instead."""
    out: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(iters):
        for name, call in calls.items():
            out[name].append(_host_time(call, True, name in busy))
    torch.cuda.synchronize()
    return out


def pipelined_host_times(calls: dict[str, Callable[[], object]], rounds: int, depth: int = 6
                         ) -> dict[str, list[float]]:
    """µs of host wall per call issued back to back while the device still runs the
    earlier ones (a serving loop that keeps the device fed): per round and callable,
    the device is drained, then ``depth`` calls are timed one after another; the first
    of each run (issued right after the wait) is dropped. Callables taken in turn."""
    out: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            torch.cuda.synchronize()
            for i in range(depth):
                t0 = time.perf_counter()
                call()
                if i:
                    out[name].append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


def double_buffered_host_times(call: Callable[[], object], iters: int) -> list[float]:
    """µs of host wall per call in a loop that keeps one call queued ahead of the
    device: call k + 1 is issued once call k - 1 has finished (the host waits on an
    event recorded after it), so each call is launched while its predecessor runs, as
    a serving loop overlapping the next chunk's launch with the current chunk."""
    return double_buffered_sequence_times({"call": call}, iters)["call"]


def double_buffered_sequence_times(calls: dict[str, Callable[[], object]], iters: int
                                   ) -> dict[str, list[float]]:
    """`double_buffered_host_times` of a sequence: each step of the loop issues every
    callable of ``calls`` in order, timed one by one, once the step before the previous
    one has finished. The first callable pays whatever the host's wait left behind; the
    ones after it are issued by a host that has just launched something."""
    torch.cuda.synchronize()
    done: list[torch.cuda.Event] = []
    out: dict[str, list[float]] = {name: [] for name in calls}
    for k in range(iters + 2):
        if len(done) == 2:
            done.pop(0).synchronize()
        step = {}
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            step[name] = (time.perf_counter() - t0) * 1e6
        event = torch.cuda.Event()
        event.record()
        done.append(event)
        if k >= 2:  # the first two steps start from a drained device
            for name, elapsed in step.items():
                out[name].append(elapsed)
    torch.cuda.synchronize()
    return out


def after_wait_sequence_times(calls: dict[str, Callable[[], object]], iters: int
                              ) -> dict[str, list[float]]:
    """µs of host wall of each callable of ``calls``, issued in order right after the
    host waited for the device to drain: splits what the first launch after a wait
    pays from what the launches behind it pay."""
    out: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(iters):
        torch.cuda.synchronize()
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            out[name].append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


def first_call_after(work: Callable[[], object], iters: int) -> list[float]:
    """µs of host wall of the first CUDA call (a stream query) after the host waited
    for ``work`` to finish: what any call pays right after a long wait."""
    out = []
    stream = torch.cuda.current_stream()
    for _ in range(iters):
        work()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        stream.query()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def wall_times(call: Callable[[], object], iters: int) -> list[float]:
    """µs of host wall per call including the device finishing it (synchronized)."""
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def matmul_ceiling(flush: Flusher | None = None) -> float:
    """Measured bf16 TFLOP/s of an 8192³ matmul: the roofline the attention is put against."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    graph = captured_graph(lambda: torch.matmul(a, b, out=c))
    us = statistics.median(device_times(graph.replay, 20, flush))
    return 2 * n ** 3 / us / 1e6


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def environment() -> dict[str, str]:
    """What the numbers were measured on."""
    import importlib.metadata as md

    device = (torch.cuda.get_device_name() if torch.cuda.is_available()
              else f"cpu: {_cpu_model()} x {os.cpu_count()}")   # serve_load, cluster
    env = {"device": device, "torch": torch.__version__,
           "cuda": str(torch.version.cuda), "cudnn_torch": str(torch.backends.cudnn.version())}
    for dist in ("nvidia-cudnn-frontend", "numba-cuda"):
        try:
            env[dist] = md.version(dist)
        except md.PackageNotFoundError:
            env[dist] = "absent"
    try:
        import cudnn

        env["cudnn_frontend_backend"] = str(cudnn.backend_version())
    except ImportError:
        pass
    return env


def require_cuda(module: str) -> None:
    """What ``python -m framekv.bench.NAME`` does first (after its arguments are checked)
    where torch sees no CUDA GPU: one line on stderr, naming ``module`` and why, and
    exit status 2; no traceback."""
    if torch.cuda.is_available():
        return
    why = ("torch was built without CUDA" if torch.version.cuda is None
           else "torch sees no CUDA device")
    print(f"python -m {module}: needs a CUDA GPU; {why} (torch {torch.__version__})",
          file=sys.stderr, flush=True)
    raise SystemExit(2)


def stderr_progress(tag: str) -> Callable[[str], None]:
    """A progress callback printing ``[tag] message`` to stderr (stdout keeps the tables)."""
    return lambda message: print(f"[{tag}] {message}", file=sys.stderr, flush=True)


def write_result(path: str | None, **sections) -> None:
    """``{"environment": environment(), **sections}`` as JSON to ``path``; nothing when
    ``path`` is None."""
    if path:
        with open(path, "w") as f:
            json.dump({"environment": environment(), **sections}, f, indent=2)
