"""`Step`: one step of a `StreamScheduler` as it passes plan, run and commit (`steps`).

The plan fills in what the step does (the runner's `StepPlan`, the decoder's
`DecodePlan`, its batch, the prompt changes it takes); each stage after it adds what it
gave, and none reads back into an earlier one::

    run      ``res`` (`ChunkRunner.execute`'s `StepResult`), ``decoded`` (the
             `DecodeStage`'s `DecodeResult`: row swaps, then frames), ``latents`` (each
             chunk's, `keep_latents`)
    commit   ``made``: the chunks counted made, each queued for its client once its
             frames are taken (at once, or a step later while it overlaps)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..decode_stage import DecodePlan, DecodeResult
from ..encode_stage import EncodePlan, EncodeResult
from ..step import StepPlan, StepResult
from .stream import Stream

__all__ = ["Entry", "Step"]


@dataclass
class Entry:
    """One batch row's stream as planned: its record, chunk index, rope frame, whether
    it is its first chunk, when it became ready, and for a video stream when its
    chunk's newest input frame came (else None)."""

    stream: Stream
    index: int
    frame0: int
    first: bool
    requested: float
    received: float | None = None


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
