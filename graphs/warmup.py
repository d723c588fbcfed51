"""Warm-up: capture everything a user of the graphs replays, up front, with a progress
bar and a report.

A server captures every graph it will replay before taking traffic, so no request pays
a capture. What to capture comes from whoever replays it, as `CaptureRequest`s (the
arguments of `GraphCache.capture`): a rollout's ``capture_requests()`` lists one
whole-chunk graph per chunk length, and its ``capture()`` runs them through here, as
``framekv warmup`` does::

    report = run_warmup(graphs, rollout.capture_requests())
    print(format_report(report))
    open("warmup.json", "wb").write(encode_report(report))

A request whose key is already captured is reported as ``cached`` and costs nothing.
"""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable, NamedTuple

import msgspec

from framekv.specs import Geometry

from .keys import GraphKey


class CaptureRequest(NamedTuple):
    """What a warm-up builder returns: the arguments of `GraphCache.capture`."""

    key: GraphKey
    fn: Callable[..., Any]
    inputs: dict
    after_replay: Callable[[], None] | None = None
    warmup_fn: Callable[..., Any] | None = None


class WarmupRecord(msgspec.Struct, frozen=True):
    """One captured (or already captured) graph.

    Attributes:
        geometry, tokens, block_sizes: from its key (what the graph was built for).
        program: the key's program, e.g. "chunk:4x1576+clean394+commit".
        key: ``GraphKey.summary()``.
        status: "captured", or "cached" when the key was already captured.
        capture_seconds: warm-up plus capture wall time (0 when cached).
        allocated_bytes, reserved_bytes: memory growth during the capture.
    """

    geometry: Geometry | None
    tokens: int
    block_sizes: tuple[int, ...]
    program: str
    key: str
    status: str
    capture_seconds: float
    allocated_bytes: int
    reserved_bytes: int


class WarmupReport(msgspec.Struct, frozen=True):
    """Every item of one warm-up, with totals (``graphs`` counts the cache's graphs)."""

    device: str
    records: tuple[WarmupRecord, ...]
    seconds: float
    graphs: int
    captured: int
    reserved_bytes: int


def run_warmup(cache, requests: Iterable, builder: Callable | None = None, *,
               progress: bool = True, stream=None) -> WarmupReport:
    """Capture every request into ``cache`` (a `GraphCache`), in order.

    ``requests`` are `CaptureRequest`s (or plain tuples ``(key, fn, inputs,
    after_replay[, warmup_fn])``); with ``builder``, they are items that
    ``builder(*item)`` turns into requests. A failed capture raises
    `GraphCaptureError` with a note naming the request; graphs captured before it
    stay. Progress goes to ``stream`` (default stderr) when ``progress`` is true.
    """
    items = list(requests)
    bar = _Progress(len(items), stream or sys.stderr) if progress else None
    records, start = [], time.perf_counter()
    try:
        for i, item in enumerate(items):
            request = CaptureRequest(*(builder(*item) if builder is not None else item))
            if bar:
                bar.update(i, request.key.program)
            records.append(_capture(cache, request, i))
    finally:
        if bar:
            bar.finish(len(records))
    return WarmupReport(
        device=str(cache.device), records=tuple(records), seconds=time.perf_counter() - start,
        graphs=len(cache), captured=sum(r.status == "captured" for r in records),
        reserved_bytes=sum(r.reserved_bytes for r in records))


def _capture(cache, request: CaptureRequest, index: int) -> WarmupRecord:
    key = request.key
    fields = (key.geometry, key.tokens, key.block_sizes, key.program, key.summary())
    if key in cache:
        return WarmupRecord(*fields, "cached", 0.0, 0, 0)
    try:
        entry = cache.capture(key, request.fn, request.inputs, after_replay=request.after_replay,
                              warmup_fn=request.warmup_fn)
    except Exception as exc:
        exc.add_note(f"warm-up request {index}: {key.summary()}")
        raise
    return WarmupRecord(*fields, "captured", entry.capture_seconds, entry.allocated_bytes,
                        entry.reserved_bytes)


class _Progress:
    """A plain-text bar: redrawn in place on a terminal, one line per item otherwise."""

    WIDTH = 30

    def __init__(self, total: int, stream):
        self.total, self.stream = total, stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.start = time.perf_counter()

    def update(self, done: int, label: str) -> None:
        filled = self.WIDTH * done // max(self.total, 1)
        line = (f"warm-up [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{self.total} "
                f"{time.perf_counter() - self.start:6.1f}s {label}")
        self.stream.write(("\r" + line[:120].ljust(120)) if self.tty else line + "\n")
        self.stream.flush()

    def finish(self, done: int) -> None:
        self.update(done, "done" if done == self.total else "stopped")
        if self.tty:
            self.stream.write("\n")
        self.stream.flush()


def format_report(report: WarmupReport) -> str:
    """A text table of a warm-up report, one row per request, totals last."""
    head = ("tokens", "program", "status", "seconds", "reserved MiB", "key")
    rows = [(str(r.tokens), r.program, r.status, f"{r.capture_seconds:.3f}",
             f"{r.reserved_bytes / 2**20:.1f}", r.key) for r in report.records]
    rows.append(("", "", f"{report.captured} new", f"{report.seconds:.3f}",
                 f"{report.reserved_bytes / 2**20:.1f}",
                 f"{report.graphs} graphs on {report.device}"))
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths[:-1]) + "  {}"
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    return "\n".join(lines)


def encode_report(report: WarmupReport, *, indent: int = 2) -> bytes:
    """The report as JSON (``indent=0`` for one line)."""
    data = msgspec.json.encode(report)
    return msgspec.json.format(data, indent=indent) if indent else data


def decode_report(data: bytes | str) -> WarmupReport:
    """A report back from `encode_report`'s JSON."""
    return msgspec.json.decode(data, type=WarmupReport)
