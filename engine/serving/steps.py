"""How `StreamScheduler` steps: plan under the lock, run on the GPU without it, commit
under it again.

    plan     (lock; host work only) the streams of the step (turns, below); each one
             without a slot takes a free one or a victim's (`slots.pick_victim`), a
             swap out then a swap in; prompt changes of resident streams; rows padded
             with scratch rows to a captured batch size. Records move at once (the
             victim leaves its slot, the newcomer takes it).
    run      (GPU thread, no lock) noise and the sampler's inputs drawn,
             `ChunkRunner.execute`, then the result stage: the decoder rows of the
             swaps, the decode (first chunks and later ones apart), the uint8 frames,
             the latents to the host.
    commit   (lock) parked states stored, failed swaps and rewrites settled, prompt
             changes settled, each stream's chunk queued (a chunk made again at or
             below its acknowledged index is dropped), counters, checkpoints due.

Turns: a step runs every ready stream on the pool, and ready streams off it (the
longest waiting first) in the slots that are free or held by streams not ready, so no
row runs scratch while a ready stream waits for a slot. A ready stream on the pool
gives its slot up only at a turn boundary, ``swap_quantum`` steps or more after the
last rotation, and only once it held the slot ``swap_quantum`` steps: at a boundary as
many of those as there are streams waiting (at most S) leave, the first in first, in
one step (its swaps in one plan); the rest stay until a later boundary. So N > S ready
streams rotate in groups, a full batch every step, and share the chunks alike (round
robin: the first to leave comes back first; over any window each stream's count is
within a quantum's worth of the others').

Readers of the records (a server's routes, metrics) take the lock only around host
work, so none of them waits on a step. A chunk whose stream was closed or exported
while it ran is dropped at the commit.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from ..step import StepPlan, Swap
from .frames import to_uint8
from .overlap import Overlap
from .records import SessionChunk
from .slots import pick_victim
from .stream import Phase, Stream

log = logging.getLogger("framekv.scheduler")


@dataclass
class Entry:
    """One batch row's stream as planned: its record, chunk index, rope frame, whether
    it is its first chunk, and when it became ready."""

    stream: Stream
    index: int
    frame0: int
    first: bool
    requested: float


def _waited(s: Stream) -> tuple:
    """How long ``s`` has waited for its next chunk, as a sort key: longest first (of
    those that left the pool together, the first to leave)."""
    return (math.inf if s.waiting_since is None else s.waiting_since, s.entered)


class Steps(Overlap):
    """The step of `StreamScheduler` (module doc); its attributes are the scheduler's."""

    def _is_ready(self, s: Stream) -> bool:
        # chunks in flight (an overlapped step's) count as queued and as made
        return (s.state == Phase.ACTIVE and not s.paused
                and len(s.delivery.queue) + s.inflight < self.queue_chunks
                and (s.budget is None or s.chunks < s.budget))

    def _ready(self) -> list[Stream]:
        """The streams of the next step (at most S; none while held): the ready ones on
        the pool, and ready ones off it (longest waiting first) as many as there are
        slots free, slots of streams not ready, and at a turn boundary slots of streams
        whose quantum ran (`_rotating`), less those the rotation takes."""
        if self._held:
            return []
        ready = [s for s in self.sessions.values() if self._is_ready(s)]
        on = sorted((s for s in ready if s.slot is not None), key=lambda s: s.entered)
        off = sorted((s for s in ready if s.slot is None), key=_waited)
        idle = self.slots - len(on)        # slots free or held by streams not ready
        if len(off) <= idle:
            return on + off
        leaving = {s.id for s in self._rotating(on)[:len(off) - idle]}
        staying = [s for s in on if s.id not in leaving]
        return staying + off[:self.slots - len(staying)]

    def _rotating(self, on: list[Stream]) -> list[Stream]:
        """The ready streams on the pool that give their slots up to waiting ones, in
        that order: at a turn boundary (``swap_quantum`` steps since the last rotation),
        those whose own quantum ran, longest on the pool first; else none."""
        steps = self._counts["steps"]
        if steps - self.pool.turn < self.swap_quantum:
            return []
        ran = [s for s in on if steps - s.slot_since >= self.swap_quantum]
        return sorted(ran, key=lambda s: s.entered)

    def _mark_waiting(self, s: Stream) -> None:
        """Start (or stop) the clock of a stream's next chunk as it turns ready (or not)."""
        if not self._is_ready(s):
            s.waiting_since = None
        elif s.waiting_since is None:
            s.waiting_since = time.monotonic()

    # ------------------------------------------------------------------ plan
    def _plan(self) -> tuple[StepPlan, list[Entry], dict] | None:
        """The next step (lock held): the plan, its batch, the prompt changes it takes."""
        plan, batch, steps = StepPlan(), [], self._counts["steps"]
        ready = self._ready()
        keep = {s.id for s in ready}
        for s in ready:
            if s.slot is None and not self._place(s, plan, keep, steps):
                continue
            batch.append(s)
        taken = self._rewrites(plan)
        stale = sorted(self._stale)
        if not batch and not plan.rewrites and not plan.swap_ins and not stale:
            return None
        entries = [Entry(s, s.chunks, s.frames, s.chunks == 0,
                         s.waiting_since if s.waiting_since is not None else time.monotonic())
                   for s in batch]
        if batch:
            B = min(b for b in self.batch_sizes if b >= len(batch))
            plan.rows = [s.slot for s in batch] + self._scratch[:B - len(batch)]
            plan.streams = [s.id for s in batch]
            plan.keys = [(s.seed, s.chunks) for s in batch]
            plan.frame0 = [s.frames for s in batch] + [0] * (B - len(batch))
            plan.restarts = [r for r in stale if r in plan.rows]
        return plan, entries, taken

    def _place(self, s: Stream, plan: StepPlan, keep: set, steps: int) -> bool:
        """Give ``s`` a slot in ``plan``: a free one, else a victim's (swapped out)."""
        slot = self.pool.take()
        if slot is None:
            victim = pick_victim(self.sessions.values(), keep, self._is_ready)
            if victim is None:
                return False
            slot, victim.slot = victim.slot, None
            if self._is_ready(victim):    # a rotation: the next one a turn from now
                self.pool.rotated(steps)
            if not victim.finished:       # a finished one keeps nothing: no copy out
                plan.swap_outs.append(Swap(victim.id, slot))
        if s.parked is None:              # no stream yet: it starts under its prompt
            plan.swap_ins.append(Swap(s.id, slot, None, s.prompt))
        else:
            rewrite = s.pending_prompt if s.pending else None
            plan.swap_ins.append(Swap(s.id, slot, s.parked, rewrite, s.decoder))
            s.parked, s.decoder = None, None
        self.pool.entries += 1
        s.slot, s.last_stepped, s.slot_since, s.entered = slot, steps, steps, self.pool.entries
        return True

    def _rewrites(self, plan: StepPlan) -> dict:
        """Prompt changes the plan takes: resident streams' rewrites, and the changes
        of those swapped in (their swap in rewrites). stream id -> (changes, prompt)."""
        entering = {sw.stream for sw in plan.swap_ins}
        taken = {}
        for s in self.sessions.values():
            if s.pending and s.late_prompt() is not None:   # its last chunk came first
                for change in s.pending:
                    change.settle(error=s.late_prompt())
                s.pending, s.pending_prompt = [], None
            if not s.pending or s.slot is None:
                continue
            taken[s.id] = (list(s.pending), s.pending_prompt)
            if s.id not in entering:
                plan.rewrites.append(Swap(s.id, s.slot, None, s.pending_prompt))
        return taken

    # ------------------------------------------------------------------ run
    def _run_plan(self, plan: StepPlan, batch: list[Entry]):
        """GPU work of a plan (no lock): (result, decoder rows out, videos, host latents)."""
        res = self._execute(plan)
        rows_out, video, latents = {}, [None] * len(batch), None
        if self.decoder is not None:
            rows_out = self._decoder_swaps(plan, res)
        if res.error is None and res.latents is not None:
            try:
                if self.decoder is not None:
                    video = self._decode(batch, plan, res.latents[:len(batch)])
                latents = res.latents.cpu()
            except Exception as exc:   # a decode that fails fails the step's streams
                res.error = exc
        return res, rows_out, video, latents

    def _execute(self, plan: StepPlan):
        """The plan's noise and sampler inputs drawn, then `ChunkRunner.execute` (no
        lock)."""
        if plan.rows:
            plan.draw_noise(self.chunk_shape, self.runner.sampling)
        return self.runner.execute(plan)

    def _decoder_swaps(self, plan: StepPlan, res) -> dict:
        """The decoder rows of the swaps: each swapped-out stream's copied out, then each
        swapped-in one's restored (or reset: a new stream)."""
        out = {}
        for sw in plan.swap_outs:
            if sw.stream not in res.failed:
                try:
                    out[sw.stream] = self.decoder.snapshot(sw.slot)
                except Exception as exc:
                    res.failed[sw.stream] = f"swapping the session out failed: its decoder row: {exc!r}"
        for sw in plan.swap_ins:
            try:
                if sw.state is None or sw.stream in res.failed:
                    self.decoder.reset(rows=[sw.slot])
                else:
                    self.decoder.restore(sw.slot, sw.decoder)
            except Exception as exc:
                res.failed[sw.stream] = f"swapping the session in failed: its decoder row: {exc!r}"
        return out

    def _decode(self, batch: list[Entry], plan: StepPlan, latents: torch.Tensor) -> list:
        """Each stream's frames (host uint8 [F', H, W, 3]): one batched decode per stage,
        first chunks and later ones (the decoder takes one stage per call)."""
        video = [None] * len(batch)
        for first in (True, False):
            idx = [i for i, e in enumerate(batch) if e.first == first]
            if idx:
                frames = self.decoder.decode(latents[idx], rows=[plan.rows[i] for i in idx])
                frames = to_uint8(frames).cpu()                       # [b, F', H, W, 3]
                for j, i in enumerate(idx):
                    video[i] = frames[j]
        return video

    # ------------------------------------------------------------------ commit
    def _commit(self, plan: StepPlan, batch: list[Entry], taken: dict, res, rows_out: dict,
                video: list, latents, seconds: float) -> int:
        """Apply a run's outcome to the records (lock held); the streams that got a chunk."""
        if self.runner.device.type == "cuda":
            # read on the GPU thread, for `metrics`: a route that called into CUDA itself
            # would contend with this thread for the driver and the allocator
            self._device["gpu_allocated_bytes"] = torch.cuda.memory_allocated(self.runner.device)
        self._commit_swaps(plan, res, rows_out)
        self._settle_prompts(taken, res)
        if res.error is not None:
            self._fail_batch(batch, plan, f"{type(res.error).__name__}: {res.error}")
            return 0
        self._stale.difference_update(plan.restarts)
        now, made = time.monotonic(), 0
        for r, e in enumerate(batch):
            s = e.stream
            if self.sessions.get(s.id) is not s or s.finished or s.id in res.failed:
                continue
            # the version in force once this step's prompt changes are settled: a change
            # it took was re-cached before its chunk
            chunk = SessionChunk(e.index, e.frame0, latents[r], seconds, len(plan.rows),
                                 s.prompt_version, self.frames_per_chunk, video[r],
                                 s.video_frames, e.requested, now)
            self._queue(s, chunk)
            made += 1
        self._counts["chunks"] += made
        self._stepped(plan, batch)
        if batch:
            self._step_seconds.observe(seconds)
        return made

    def _stepped(self, plan: StepPlan, batch: list[Entry]) -> None:
        """A step that ran ``batch`` is counted (steps, rows, scratch rows, its batch
        size) and its streams were stepped at it."""
        if not batch:
            return
        self._counts["steps"] += 1
        self._counts["rows"] += len(plan.rows)
        self._counts["scratch_rows"] += len(plan.rows) - len(batch)
        self._batch_sizes[len(plan.rows)] = self._batch_sizes.get(len(plan.rows), 0) + 1
        for e in batch:
            e.stream.last_stepped = self._counts["steps"]

    def _commit_swaps(self, plan: StepPlan, res, rows_out: dict) -> None:
        for sw in plan.swap_outs:
            s = self.sessions.get(sw.stream)
            if sw.stream in res.failed:
                self.pool.counts["failed_swaps"] += 1
                if s is not None:
                    self._fail(s, res.failed[sw.stream])
                continue
            state = res.parked[sw.stream]
            self.pool.count("swap_outs", state.nbytes)
            self.pool.seconds.observe(res.swap_seconds.get(sw.stream, 0.0))
            if s is not None and s.slot is None:
                s.parked, s.decoder = state, rows_out.get(sw.stream)
        for sw in plan.swap_ins:
            s = self.sessions.get(sw.stream)
            if sw.stream in res.failed:
                self.pool.counts["failed_swaps"] += 1
                if s is not None:
                    self._fail(s, res.failed[sw.stream])
                    s.slot = None
                self.pool.give(sw.slot)
            elif sw.state is not None:
                self.pool.count("swap_ins", sw.state.nbytes)
                self.pool.seconds.observe(res.swap_seconds.get(sw.stream, 0.0))
            if s is None and sw.stream not in res.failed:  # closed while it came in
                self.pool.give(sw.slot)

    def _settle_prompts(self, taken: dict, res) -> None:
        """The prompt changes the plan took: taken (the stream's prompt and version
        move) or failed (its old prompt stays; each change says why)."""
        for sid, (changes, prompt) in taken.items():
            s = self.sessions.get(sid)
            err = res.rewrite_errors.get(sid) or (RuntimeError(res.failed[sid])
                                                  if sid in res.failed else None)
            if s is not None:
                s.pending = [c for c in s.pending if c not in changes]
                if err is None:
                    s.prompt, s.prompt_version = prompt, changes[-1].version
                if not s.pending:
                    s.pending_prompt = None
            for c in changes:
                c.settle(None if s is None else s.chunks, err)

    def _queue(self, s: Stream, chunk: SessionChunk) -> None:
        self._advance(s, chunk.frames)
        self._deliver(s, chunk)

    def _advance(self, s: Stream, frames: int) -> None:
        """``s`` made a chunk: its next index and rope frame move on."""
        s.chunks += 1
        s.frames += frames

    def _deliver(self, s: Stream, chunk: SessionChunk) -> None:
        """``s``'s chunk queued for its client (unless it acknowledged it already: a
        chunk counted made while it decoded may be), and what follows from it: frames
        counted, the budget spent, a checkpoint due."""
        s.delivery.put(chunk)
        if chunk.video is not None:
            s.video_frames += chunk.video.shape[0]
            self._counts["video_frames"] += chunk.video.shape[0]
        if s.budget is not None and chunk.index + 1 >= s.budget:
            s.state = Phase.DONE
        self._chunk_seconds.observe(chunk.queued - chunk.requested)
        s.waiting_since = None
        self._mark_waiting(s)
        if self.checkpoints is not None and self.checkpoints.due(chunk.index + 1):
            self._due.append(s.id)

    def _fail(self, s: Stream, message: str) -> None:
        """``s`` failed: its record keeps why, its slot is free (its next user starts it
        over), what it held off the pool is dropped."""
        s.state, s.error, s.waiting_since = Phase.FAILED, message, None
        s.parked = s.decoder = None
        if s.slot is not None:
            self.pool.give(s.slot)
            s.slot = None
        log.warning("stream %s failed: %s", s.id, message)

    def _fail_batch(self, batch: list[Entry], plan: StepPlan, message: str) -> None:
        """Fail the streams of a step that raised (each keeps ``message``); their rows and
        the scratch rows are started over next (`_restart_rows`)."""
        self._counts["failed_steps"] += 1
        for e in batch:
            if self.sessions.get(e.stream.id) is e.stream and not e.stream.finished:
                self._fail(e.stream, message)

    def _restart_rows(self, plan: StepPlan) -> None:
        """After a failed step (GPU work, no lock): its rows and the scratch rows started
        over (a step that failed part way may have moved them). Never raises: a failing
        start-over is logged and counted (``failed_resets``), and the scratch rows stay
        stale until a step that runs them starts them over first."""
        rows = list(dict.fromkeys(plan.rows + self._scratch))
        try:
            self.runner.prefill_rows(rows)
            with self.lock:
                self._stale.clear()
        except Exception:
            with self.lock:
                self._counts["failed_resets"] += 1
                self._stale.update(self._scratch)
            log.exception("starting rows %s over after a failed step raised too; the "
                          "scratch rows are started over before their next step", rows)
