"""An overlapped step of `StreamScheduler` (`Overlap`, a part of `Steps`): the decode of
step n runs on the decode lane's stream (`DecodeLane`) beside the transformer of step
n + 1, and step n's chunks are queued once their frames are on the host.

    step n     plan (lock) -> the transformer queued -> step n - 1 delivered (its
               decode waited for: it ran beside this transformer) -> the decoder rows
               of the swaps -> this step's decode and latents queued on the lane ->
               advance (lock): swaps and prompt changes settled, each stream's next
               index and rope frame moved on, its chunk counted in flight
    deliver    (the next step, or as soon as there is nothing to plan) the frames
               taken from the lane, each chunk queued (lock) as a plain step queues it

A chunk in flight counts as queued and as made (`Steps._is_ready`), so a stream makes
no more than ``queue_chunks`` ahead of its client and none past its budget. Before
anything else touches the decoder or the records' chunks (a request on the GPU thread:
an export, an import; `hold`; `close`) the step in flight is delivered (`_flush`). A
step that fails, and every step while checkpoints are kept (a checkpoint must hold the
chunks made up to the state it saves), runs plainly, after delivering the one in
flight.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .records import SessionChunk


@dataclass
class InFlight:
    """A step whose decode runs on the lane: its plan, batch, the lane submissions
    (batch indices per stage), its latents on their way to the host (and the event
    they are there after), when it started, and the chunks it advanced ((batch row,
    prompt version) each)."""

    plan: object
    batch: list
    stages: list
    latents: torch.Tensor
    copied: object
    started: float
    made: list


class Overlap:
    """The overlapped step (module doc); its attributes are the scheduler's."""

    def _overlapping(self) -> bool:
        return self.lane is not None and self.checkpoints is None

    def _step_overlapped(self, plan, batch, taken) -> int:
        """One overlapped step (module doc); the chunks the step before it delivered."""
        t0 = time.perf_counter()
        res = self._execute(plan)
        made = self._flush()
        rows_out = self._decoder_swaps(plan, res) if self.decoder is not None else {}
        stages = None
        if res.error is None and res.latents is not None and batch:
            try:
                stages = self._submit(plan, batch, res.latents)
            except Exception as exc:   # a decode that fails fails the step's streams
                res.error = exc
                self._empty_lane()
        if stages is None:
            if res.error is not None and plan.rows:
                self._restart_rows(plan)
            with self.lock:
                made += self._commit(plan, batch, taken, res, rows_out, [None] * len(batch),
                                     None, time.perf_counter() - t0)
                self.ready.notify_all()
            return made
        latents, copied = _to_host(res.latents)
        with self.lock:
            self._commit_swaps(plan, res, rows_out)
            self._settle_prompts(taken, res)
            self._stale.difference_update(plan.restarts)
            advanced = []
            for r, e in enumerate(batch):
                s = e.stream
                if self.sessions.get(s.id) is s and not s.finished and s.id not in res.failed:
                    self._advance(s, self.frames_per_chunk)
                    s.inflight += 1
                    advanced.append((r, s.prompt_version))
            self._stepped(plan, batch)
        self._inflight = InFlight(plan, batch, stages, latents, copied, t0, advanced)
        return made

    def _submit(self, plan, batch, latents) -> list:
        """Each stage's rows (first chunks, later ones) queued on the lane."""
        stages = []
        for first in (True, False):
            idx = [i for i, e in enumerate(batch) if e.first == first]
            if idx:
                self.lane.submit(latents[idx], rows=[plan.rows[i] for i in idx])
                stages.append(idx)
        return stages

    def _empty_lane(self) -> None:
        """Drop what the lane holds (a failed step's other stage goes with it)."""
        while len(self.lane):
            try:
                self.lane.take()
            except Exception:
                pass

    def _flush(self) -> int:
        """Deliver the step in flight, if any (module doc); the chunks queued."""
        f, self._inflight = self._inflight, None
        if f is None:
            return 0
        video, error = [None] * len(f.batch), None
        try:
            for idx in f.stages:
                frames = self.lane.take()                            # [b, F', H, W, 3]
                for j, i in enumerate(idx):
                    video[i] = frames[j]
        except Exception as exc:    # a decode that fails fails the step's streams
            error = f"{type(exc).__name__}: {exc}"
            self._empty_lane()
        if f.copied is not None:
            f.copied.synchronize()
        seconds, now, made = time.perf_counter() - f.started, time.monotonic(), 0
        with self.lock:
            for r, version in f.made:
                e = f.batch[r]
                s = e.stream
                s.inflight -= 1
                if self.sessions.get(s.id) is not s or s.finished:
                    continue
                if error is not None:
                    self._fail(s, error)
                    continue
                self._deliver(s, SessionChunk(e.index, e.frame0, f.latents[r], seconds,
                                              len(f.plan.rows), version, self.frames_per_chunk,
                                              video[r], s.video_frames, e.requested, now))
                made += 1
            self._counts["chunks"] += made
            self._counts["failed_steps"] += error is not None
            self._step_seconds.observe(seconds)
            self.ready.notify_all()
        return made


def _to_host(latents: torch.Tensor) -> tuple[torch.Tensor, object]:
    """fp32 host copy of ``latents``, queued on the current stream on CUDA (pinned, with
    the event it is done after), made at once on a CPU (no event)."""
    if latents.device.type != "cuda":
        return latents.cpu(), None
    host = torch.empty(latents.shape, dtype=latents.dtype, pin_memory=True)
    host.copy_(latents, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done
