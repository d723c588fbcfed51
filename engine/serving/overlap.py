"""`Overlap`: a step's decode beside the next step's transformer. A `StreamScheduler`
holds one where it decodes and overlaps (`overlap` not False; on a CPU with
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

from ..decode_stage import DecodeStage
from .step_record import Step

__all__ = ["Overlap"]


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
