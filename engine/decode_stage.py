"""`DecodeStage`: the decoder's half of a served step, as data in and data out.

A scheduler names the runner's work of a step in a `StepPlan` (`framekv.engine.step`)
and the decoder's in a `DecodePlan`, one row of the decoder per slot of the pool::

    swap_outs   rows copied to the host (`snapshot`): each stream's row state in the
                result's ``parked``
    swap_ins    rows restored from a stream's row state, or started over (a new stream:
                no state)
    rows        the decoder row of each stream of the batch, batch order (no scratch
                rows: nothing reads their frames)
    first       whether each is its stream's first chunk: a decoder runs first chunks
                and later ones as two stages, one call each

The stage runs it after the runner's result and reports a `DecodeResult`: `swap` the
row swaps (a stream whose runner swap failed keeps no row copy and its row starts
over; a row swap that raises fails its stream: ``failed``), then `submit` and `take`
(or `decode`, both at once) the batch's latents turned into uint8 frames on the host,
one [F', H, W, 3] per stream, through a `DecodeLane`: on CUDA on a stream of its own,
beside whatever the caller queues between the two. A decode that raises is the
result's ``error`` (the lane emptied). The stage owns the decoder while a decode is in
flight: `take` it before a `swap` or a direct use (a snapshot for an export).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .decode_lane import DecodeLane

__all__ = ["DecodePlan", "DecodeResult", "DecodeStage", "RowSwap", "swap_rows"]


@dataclass(eq=False)
class RowSwap:
    """One stream's decoder row moving out of or into ``row``: ``state`` is a swap in's
    row state (`snapshot`'s; None: the row starts over, a new stream)."""

    stream: str
    row: int
    state: dict | None = None


def swap_rows(coder, swap_outs, swap_ins, res, failed=()) -> None:
    """A streaming coder's row swaps (`RowSwap` s), every swap out first: a swap out's
    row state into ``res.parked``; a swap in restored, or started over (no state, or
    its stream in ``failed``: no copy out either); what one raises fails its stream
    (``res.failed``, naming the coder's role)."""
    role = getattr(coder, "ROLE", "decoder")
    for sw in swap_outs:
        if sw.stream not in failed:
            _row(res, sw, "out", role, coder.snapshot, sw.row)
    for sw in swap_ins:
        if sw.state is None or sw.stream in failed:
            _row(res, sw, "in", role, coder.reset, rows=[sw.row])
        else:
            _row(res, sw, "in", role, coder.restore, sw.row, sw.state)


def _row(res, sw: RowSwap, way: str, role: str, move, *args, **kw) -> None:
    """One row's swap, ``move(*args, **kw)``: a swap out's row state parked; what it
    raises fails the stream's swap."""
    try:
        state = move(*args, **kw)
    except Exception as exc:
        res.failed[sw.stream] = f"swapping the session {way} failed: its {role} row: {exc!r}"
        return
    if way == "out":
        res.parked[sw.stream] = state


@dataclass(eq=False)
class DecodePlan:
    """The decoder's work of one step (module doc)."""

    swap_outs: list[RowSwap] = field(default_factory=list)
    swap_ins: list[RowSwap] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)

    def stages(self) -> list[list[int]]:
        """The batch indices of each decode call: first chunks, then later ones (the
        empty one left out)."""
        runs = ([i for i, f in enumerate(self.first) if f == want] for want in (True, False))
        return [idx for idx in runs if idx]


@dataclass(eq=False)
class DecodeResult:
    """What the decoder's work of a step gave: ``parked``: stream id -> the row state of
    each swap out (host); ``failed``: stream id -> why its row swap failed; ``frames``:
    each batch stream's uint8 [F', H, W, 3] on the host (None until taken); ``error``:
    what the decode raised, None if it ran."""

    parked: dict[str, dict] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    frames: list = field(default_factory=list)
    error: BaseException | None = None


class DecodeStage:
    """A streaming decoder (``decode(latents, rows=)``, ``reset(rows=)``,
    ``snapshot(row)``, ``restore(row, state)``, ``close()``) and its `DecodeLane` on
    ``device`` (``overlap``: the lane's; None: beside the caller's work on CUDA,
    False: at once) running `DecodePlan` s (module doc)."""

    def __init__(self, decoder, *, device=None, overlap: bool | None = None):
        self.decoder = decoder
        self.lane = DecodeLane(decoder, device=device, overlap=overlap)

    def swap(self, plan: DecodePlan, failed=()) -> DecodeResult:
        """The plan's row swaps, every swap out first; ``failed``: the streams whose
        runner swap failed (no copy out; their rows start over). A fresh result."""
        res = DecodeResult(frames=[None] * len(plan.rows))
        swap_rows(self.decoder, plan.swap_outs, plan.swap_ins, res, failed)
        return res

    def submit(self, plan: DecodePlan, latents: torch.Tensor, res: DecodeResult) -> bool:
        """Queue the decode of the batch's latents [B', C, F, H, W] (B' >= its streams;
        scratch rows past them are left out), one lane call per stage. False (the
        error in ``res``, the lane emptied) where it raised."""
        try:
            for idx in plan.stages():
                self.lane.submit(latents[idx], rows=[plan.rows[i] for i in idx])
        except Exception as exc:
            res.error = exc
            self.lane.discard()
            return False
        return True

    def take(self, plan: DecodePlan, res: DecodeResult) -> None:
        """Each stream's frames of the decode `submit` queued into ``res.frames``
        (waiting for them), or the error it raised into ``res.error``."""
        try:
            for idx in plan.stages():
                frames = self.lane.take()                            # [b, F', H, W, 3]
                for j, i in enumerate(idx):
                    res.frames[i] = frames[j]
        except Exception as exc:
            res.error = exc
            self.lane.discard()

    def decode(self, plan: DecodePlan, latents: torch.Tensor, res: DecodeResult) -> None:
        """`submit` and `take` at once."""
        if self.submit(plan, latents, res):
            self.take(plan, res)

    def close(self) -> None:
        """Drop what is in flight and free the decoder."""
        self.lane.discard()
        self.decoder.close()
