"""A `StreamScheduler`'s video input (`VideoIn`): video streams, their frames in, and the
encoder's half of a step.

A scheduler built with an ``encoder_factory`` takes video streams (`open_session`
with ``video=S``, S its video strength). Its runner samples them with the
video-to-video sampler (`framekv.engine.samplers.VideoToVideoSampler`) at one strength
for every stream: the runner's, baked into its chunk graph (``video_strength``; a
runner that samples with a base sampler is strength 1, its chunks the text-to-video
ones). A video stream asks for that strength; a text stream is refused where the
strength is below 1 (its chunks would need an input).

A video stream's frames come in through `feed` into its `Intake` (`intake`: the
bound, the drops) and it is ready for chunk i only once chunk i's frames are in. As a
step is planned each video stream of its batch takes its chunk's frames and names its
encoder row (one per slot: the encoder's rows are the decoder's, a slot's) in the
`EncodePlan`, its row's swaps beside the runner's; the step's run encodes them first
(`EncodeStage`), and each row's input latents are its source (`StepPlan.sources`).
"""
from __future__ import annotations

import time

import torch

from ..decode_stage import RowSwap
from ..encode_stage import EncodePlan, EncodeStage
from ..samplers import VideoToVideoSampler
from .intake import Intake
from .stream import Phase, Stream

__all__ = ["VideoIn"]


class VideoIn:
    """The video input of `StreamScheduler` (module doc); its attributes are the
    scheduler's."""

    def _start_video(self, encoder_factory) -> None:
        """The encoder (rows: the slots) and the input geometry: ``video_size`` (H, W),
        ``video_chunk_frames`` (first, later), ``video_strength``; all None without an
        encoder."""
        sampling = self.runner.sampling
        self._sampled_at = (sampling.options["strength"]
                            if isinstance(sampling, VideoToVideoSampler) else 1.0)
        self.video_strength = self._sampled_at if encoder_factory is not None else None
        self._counts.update(frames_in=0, frames_dropped=0)
        self.encode_stage = self.video_size = self.video_chunk_frames = None
        if encoder_factory is None:
            return
        enc = encoder_factory(self.slots)
        self.encode_stage = EncodeStage(enc)
        _, F, h, w = self.chunk_shape
        self.video_size = (h * enc.SPACE, w * enc.SPACE)
        self.video_chunk_frames = (enc.video_frames(F, True), enc.video_frames(F, False))

    def _video_record(self, video) -> Intake | None:
        """A new stream's `Intake` (``video``: its strength; None: a text stream), or a
        ValueError naming what this scheduler takes."""
        if video is None:
            if self._sampled_at < 1:
                raise ValueError(f"input must be video here: this server samples video to "
                                 f"video at strength {self._sampled_at:g}, a text session "
                                 f"would have no input for its chunks")
            return None
        from ..samplers import check_strength

        strength = check_strength(video)
        if self.encode_stage is None:
            raise ValueError("input video needs a server with a video encoder (frames in): "
                             "this one has none")
        if strength != self.video_strength:
            raise ValueError(f"strength must be {self.video_strength:g}, the strength this "
                             f"server samples video to video at, got {strength:g}")
        return Intake(self.video_size, *self.video_chunk_frames)

    def _check_input_fits(self, s: Stream) -> None:
        """ValueError for an imported video stream this scheduler cannot feed: no
        encoder, or another video size or chunk."""
        if s.intake is None:
            return
        here = None if self.encode_stage is None else (self.video_size, self.video_chunk_frames)
        there = (s.intake.size, (s.intake.first, s.intake.later))
        if here != there:
            raise ValueError(f"session {s.id[:64]!r} takes video of size and chunk frames "
                             f"{there}, this scheduler {here or 'no video (no encoder)'}")

    def feed(self, session_id: str, frames: torch.Tensor, when: float | None = None) -> dict:
        """Frames [n, 3, H, W] in [-1, 1] of the video size (``video_size``) into a
        video stream's input, received at ``when`` (`time.monotonic`, default now); the
        oldest waiting past one chunk dropped (`Intake`). Returns its `Intake.info`.
        KeyError for an id that is not open; ValueError for a text stream, one that
        finished, or frames of another shape. Host work only."""
        with self.lock:
            s = self.sessions[session_id]
            if s.intake is None:
                raise ValueError(f"session {session_id[:64]!r} takes no frames: it was "
                                 "opened with text input, not video")
            if s.state != Phase.ACTIVE:
                raise ValueError(f"session {session_id[:64]!r} is {s.state}: no chunk "
                                 "will come of its frames")
            frames = s.intake.check(frames)
            dropped = s.intake.push(frames, time.monotonic() if when is None else when)
            self._counts["frames_in"] += len(frames)
            self._counts["frames_dropped"] += dropped
            self._mark_waiting(s)
            self.ready.notify_all()
            return s.intake.info()

    # ------------------------------------------------------------------ steps
    def _encode_rows(self, plan: EncodePlan, victim: Stream | None, s: Stream,
                     slot: int) -> None:
        """A stream taking ``slot`` (from ``victim``, if any): the video streams'
        encoder row swaps into ``plan`` (a server that takes video in)."""
        if victim is not None and victim.intake is not None and not victim.finished:
            plan.swap_outs.append(RowSwap(victim.id, slot))
        if s.intake is not None:
            plan.swap_ins.append(RowSwap(s.id, slot, s.encoder))
        s.encoder = None

    def _take_inputs(self, plan: EncodePlan, batch: list[Stream]) -> list:
        """Each batch stream's chunk frames taken into ``plan`` (lock held): (when the
        newest came, their frame numbers (first, count)) each, (None, None) for a text
        stream."""
        taken = [(None, None)] * len(batch)
        for r, s in enumerate(batch):
            if s.intake is None:
                continue
            first = s.intake.taken == 0
            frames, when, span = s.intake.take()
            taken[r] = (when, span)
            plan.rows.append(s.slot)
            plan.index.append(r)
            plan.streams.append(s.id)
            plan.frames.append(frames)
            plan.first.append(first)
        return taken

    def _encode(self, step) -> None:
        """The step's encoder work (no lock; a step with an `EncodePlan`): its row swaps
        and input latents, each video row's latents its source."""
        plan = step.encode
        if not (plan.rows or plan.swap_outs or plan.swap_ins):
            return
        step.encoded = self.encode_stage.run(step.encode, self.chunk_shape)
        if step.encode.rows:
            step.plan.sources = [step.encoded.latents.get(r) for r in range(len(step.batch))]
