"""`Step`: one step of a `StreamScheduler` as it passes plan, run and commit (`steps`);
`Overlap`: the step whose decode runs beside the next step's transformer.

The plan fills in what the step does (the runner's `StepPlan`, the decoder's
`DecodePlan`, its batch, the prompt changes it takes); each stage after it adds what it
gave, and none reads back into an earlier one::

    run      ``res`` (`ChunkRunner.execute`'s `StepResult`), ``decoded`` (the
             `DecodeStage`'s `DecodeResult`: row swaps, then frames), ``latents`` (each
             chunk's, `keep_latents`)
    commit   ``made``: the chunks counted made, each queued for its client once its
             frames are taken (at once, or a step later while it overlaps)

A `StreamScheduler` holds an `Overlap` where it decodes and overlaps (`overlap` not False; on a CPU with
``overlap=True`` the lane decodes at once and the chunks are still queued a step late).

    step n     plan (lock) -> the transformer queued -> step n - 1 taken (`take`: its
               decode, which ran beside this transformer, waited for) and delivered ->
               the decoder rows of the swaps -> this step's decode queued (`submit`) ->
               its latents kept -> settled (lock): swaps and prompt changes, each
               stream's next index and rope frame moved on, its chunk counted in flight
    deliver    (the next step, or as soon as there is nothing to plan) the step taken,
               each chunk queued (lock) as a plain step queues it

It holds at most one step: `submit` a step's decode, `take` it back once its frames (or
the error its decode raised) are in its `DecodeResult` and its latents are on the host.
What the step's chunks become is the scheduler's (`steps`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..decode_stage import DecodePlan, DecodeResult, DecodeStage
from ..encode_stage import EncodePlan, EncodeResult
from ..step import StepPlan, StepResult
from .stream import Stream

__all__ = ["Entry", "Overlap", "Step"]


@dataclass
class Entry:
    """One batch row's stream as planned: its record, chunk index, rope frame, whether
    it is its first chunk, when it became ready, and for a video stream when its
    chunk's newest input frame came and the numbers of its input frames (first,
    count) (`Intake.span`; else None each)."""

    stream: Stream
    index: int
    frame0: int
    first: bool
    requested: float
    received: float | None = None
    input: tuple[int, int] | None = None


@dataclass(eq=False)
class Step:
    """One step (module doc). ``plan``: the runner's work; ``decode``: the decoder's
    (None: no decoder); ``batch``: its streams, `Entry` each; ``taken``: the prompt
    changes it takes, stream id -> (changes, prompt); ``encode``: the encoder's work
    (None: no encoder). Then ``encoded`` (`EncodeResult`), ``started``
    (`time.perf_counter` at its run), ``res``, ``decoded``, ``latents`` (each stream's
    chunk latents; ``copied``: the event they are on the host after, None: there now)
    and ``made`` ((batch row, prompt version) of each chunk counted made)."""

    plan: StepPlan
    decode: DecodePlan | None
    batch: list[Entry]
    taken: dict
    started: float = 0.0
    res: StepResult | None = None
    decoded: DecodeResult | None = None
    latents: object = None
    copied: object = None
    made: list = field(default_factory=list)
    encode: EncodePlan | None = None
    encoded: EncodeResult | None = None

    @property
    def failed(self) -> dict[str, str]:
        """Stream id -> why its swap failed: the runner's reason, else its decoder
        row's, else its encoder row's (or its input's encode)."""
        rows = {} if self.decoded is None else self.decoded.failed
        enc = {} if self.encoded is None else self.encoded.failed
        return {**enc, **self.res.failed, **rows}

    @property
    def error(self) -> BaseException | None:
        """What its chunk (or a restart) raised, else what its decode raised; None."""
        if self.res.error is not None or self.decoded is None:
            return self.res.error
        return self.decoded.error

    def decodes(self) -> bool:
        """Whether it has chunks to decode: a decoder, streams, latents, no error."""
        return (self.decoded is not None and bool(self.batch)
                and self.res.latents is not None and self.error is None)

    def keep_latents(self, host: bool) -> None:
        """``latents``: each stream's rows of the result's latents [B, C, F, H, W] as its
        chunk keeps them. ``host``: an fp32 host copy (on CUDA pinned and queued on the
        current stream, ``copied`` the event it is there after); else a copy per row
        where they are (a queued chunk holds no other row's memory)."""
        if self.res.latents is None or self.error is not None:
            return
        x = self.res.latents[:len(self.batch)]                       # [b, C, F, H, W]
        if not host:
            self.latents = [row.clone() for row in x]
        elif x.device.type != "cuda":
            self.latents = x.cpu()
        else:
            self.latents = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.latents.copy_(x, non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def seconds(self) -> float:
        """Seconds since it started running."""
        return time.perf_counter() - self.started


class Overlap:
    """At most one step whose decode runs on ``stage``'s lane (module doc)."""

    def __init__(self, stage: DecodeStage):
        self.stage = stage
        self._step: Step | None = None

    def __len__(self) -> int:
        """Steps in flight: 0 or 1."""
        return int(self._step is not None)

    def submit(self, step: Step) -> bool:
        """Queue the decode of ``step``'s latents (``step.res.latents``, into
        ``step.decoded``) and hold the step until `take`. False, nothing held, where
        queueing raised (``step.decoded.error``). RuntimeError while a step is held."""
        if self._step is not None:
            raise RuntimeError("a step is in flight already: take it first")
        if not self.stage.submit(step.decode, step.res.latents, step.decoded):
            return False
        self._step = step
        return True

    def take(self) -> Step | None:
        """The step in flight, its frames or its decode's error in ``decoded``, its
        latents on the host (waiting for both); None when none is."""
        step, self._step = self._step, None
        if step is None:
            return None
        self.stage.take(step.decode, step.decoded)
        if step.copied is not None:
            step.copied.synchronize()
        return step
