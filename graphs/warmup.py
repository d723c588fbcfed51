"""Warm-up: capture a whole plan up front, with a progress bar and a report.

A server captures every graph it will replay before taking traffic, so no request pays
a capture. The plan is a sequence of (geometry, token count, block size) triples, as
``framekv.specs.WarmupPlan.items()`` yields; a builder turns each into what to capture::

    def builder(geometry, tokens, block_size):
        key = chunk_key(owner, geometry, tokens, denoise_steps=4, clean_block=block_size,
                        inputs=inputs)
        return key, chunk_fn, inputs, after_replay

    report = graphs.warmup(plan.items(), builder)
    print(format_report(report))
    open("warmup.json", "wb").write(encode_report(report))

Items whose key is already captured (builders may map several triples to one key) are
reported as ``cached`` and cost nothing.
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
    """One plan item.

    Attributes:
        geometry, tokens, block_size: the plan item.
        key: ``GraphKey.summary()`` of what was captured for it.
        status: "captured", or "cached" when the key was already captured.
        capture_seconds: warm-up plus capture wall time (0 when cached).
        allocated_bytes, reserved_bytes: memory growth during the capture.
    """

    geometry: Geometry | None
    tokens: int
    block_size: int
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


def run_warmup(cache, plan_items: Iterable, builder: Callable, *, progress: bool = True,
               stream=None) -> WarmupReport:
    """Capture what ``builder(geometry, tokens, block_size)`` returns for every item.

    ``builder`` returns a `CaptureRequest` or a plain tuple ``(key, fn, inputs,
    after_replay[, warmup_fn])``. A failed capture raises `GraphCaptureError` naming
    the item; graphs captured before it stay. Progress goes to ``stream`` (default
    stderr) when ``progress`` is true.
    """
    items = list(plan_items)
    bar = _Progress(len(items), stream or sys.stderr) if progress else None
    records, start = [], time.perf_counter()
    try:
        for i, item in enumerate(items):
            geometry, tokens, block_size = item
            request = CaptureRequest(*builder(geometry, tokens, block_size))
            if bar:
                bar.update(i, request.key.program)
            records.append(_capture_item(cache, request, geometry, tokens, block_size, i))
    finally:
        if bar:
            bar.finish(len(records))
    return WarmupReport(
        device=str(cache.device), records=tuple(records), seconds=time.perf_counter() - start,
        graphs=len(cache), captured=sum(r.status == "captured" for r in records),
        reserved_bytes=sum(r.reserved_bytes for r in records))


def _capture_item(cache, request: CaptureRequest, geometry, tokens, block_size,
                  index: int) -> WarmupRecord:
    key = request.key
    if key in cache:
        return WarmupRecord(geometry, tokens, block_size, key.summary(), "cached", 0.0, 0, 0)
    try:
        entry = cache.capture(key, request.fn, request.inputs, after_replay=request.after_replay,
                              warmup_fn=request.warmup_fn)
    except Exception as exc:
        exc.add_note(f"warm-up plan item {index}: tokens={tokens} block_size={block_size} "
                     f"geometry={geometry}")
        raise
    return WarmupRecord(geometry, tokens, block_size, key.summary(), "captured",
                        entry.capture_seconds, entry.allocated_bytes, entry.reserved_bytes)


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
    """A text table of a warm-up report, one row per plan item, totals last."""
    head = ("tokens", "block", "status", "seconds", "reserved MiB", "key")
    rows = [(str(r.tokens), str(r.block_size), r.status, f"{r.capture_seconds:.3f}",
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
