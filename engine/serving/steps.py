"""How `StreamScheduler` steps: plan under the lock, run on the GPU without it, commit
under it again. One `Step` record (`step_record`) carries a step from stage to stage.

    plan     (lock; host work only) the streams of the step (`turns`); each one
             without a slot takes a free one or a victim's (`slots.pick_victim`), a
             swap out then a swap in, in the runner's `StepPlan` and, with a decoder,
             its rows' in the `DecodePlan`; prompt changes of resident streams; rows
             padded with scratch rows to a captured batch size. Records move at once
             (the victim leaves its slot, the newcomer takes it).
    run      (GPU thread, no lock) noise and the sampler's inputs drawn,
             `ChunkRunner.execute`, then the `DecodeStage`: the decoder rows' swaps,
             the decode into uint8 frames; each chunk's latents kept (to the host, or
             on the device where the decoder makes the frames: ``host_latents``)
    commit   (lock) `_settle`: parked states stored, failed swaps and rewrites settled,
             prompt changes settled, each stream's next index and rope frame moved on,
             counters; `_deliver_step`: each stream's chunk queued (a chunk made again
             at or below its acknowledged index is dropped), checkpoints due.

A plain step runs the three in turn. An overlapped one (`Overlap`: the decode of step n
on the decode lane's stream beside the transformer of step n + 1) settles as soon as
its decode is queued and is delivered once its frames are on the host: by the next
step, or as soon as there is nothing to plan (`_flush`). A chunk in flight counts as
queued and as made (`_is_ready`), so a stream makes no more than ``queue_chunks``
ahead of its client and none past its budget. Before anything else touches the decoder
or the records' chunks (a request on the GPU thread: an export, an import; `hold`;
`close`) the step in flight is delivered. A step that fails, and every step while
checkpoints are kept (a checkpoint must hold the chunks made up to the state it
saves), runs plainly, after delivering the one in flight.

Readers of the records (a server's routes, metrics) take the lock only around host
work, so none of them waits on a step. A chunk whose stream was closed or exported
while it ran is dropped at the commit.
"""
from __future__ import annotations

import logging
import time

import torch

from ..decode_stage import DecodePlan, RowSwap
from ..encode_stage import EncodePlan
from ..step import StepPlan, Swap
from .records import SessionChunk
from .slots import pick_victim
from .step_record import Entry, Step
from .stream import Phase, Stream

log = logging.getLogger("framekv.scheduler")


def _why(exc: BaseException) -> str:
    """What a failed step's streams keep as their error."""
    return f"{type(exc).__name__}: {exc}"


class Steps:
    """The step of `StreamScheduler` (module doc); its attributes are the scheduler's,
    its streams those `Turns` gives."""

    # ------------------------------------------------------------------ plan
    def _plan(self) -> Step | None:
        """The next step (lock held): its plans, its batch, the prompt changes it takes."""
        plan, steps = StepPlan(), self._counts["steps"]
        rows = DecodePlan() if self.decoding else None
        enc = EncodePlan() if self.encode_stage is not None else None
        ready, batch = self._ready(), []
        keep = {s.id for s in ready}
        for s in ready:
            if s.slot is None and not self._place(s, plan, (rows, enc), keep, steps):
                continue
            batch.append(s)
        taken = self._rewrites(plan)
        stale = sorted(self._stale)
        if not batch and not plan.rewrites and not plan.swap_ins and not stale:
            return None
        inputs = ([(None, None)] * len(batch) if enc is None       # no video in
                  else self._take_inputs(enc, batch))
        entries = [Entry(s, s.chunks, s.frames, s.chunks == 0,
                         s.waiting_since if s.waiting_since is not None else time.monotonic(),
                         *inputs[r]) for r, s in enumerate(batch)]
        if batch:
            B = min(b for b in self.batch_sizes if b >= len(batch))
            plan.rows = [s.slot for s in batch] + self._scratch[:B - len(batch)]
            plan.streams = [s.id for s in batch]
            plan.keys = [(s.seed, s.chunks) for s in batch]
            plan.frame0 = [s.frames for s in batch] + [0] * (B - len(batch))
            plan.restarts = [r for r in stale if r in plan.rows]
        if rows is not None:
            rows.rows, rows.first = [s.slot for s in batch], [e.first for e in entries]
        return Step(plan, rows, entries, taken, encode=enc)

    def _place(self, s: Stream, plan: StepPlan, coders: tuple, keep: set, steps: int) -> bool:
        """Give ``s`` a slot in ``plan`` (and its decoder and encoder rows in ``coders``,
        a `DecodePlan` and an `EncodePlan` or None each): a free one, else a victim's
        (swapped out)."""
        rows, enc = coders
        slot, victim = self.pool.take(), None
        if slot is None:
            victim = pick_victim(self.sessions.values(), keep, self._is_ready)
            if victim is None:
                return False
            slot, victim.slot = victim.slot, None
            if self._is_ready(victim):    # a rotation: the next one a turn from now
                self.pool.rotated(steps)
            if not victim.finished:       # a finished one keeps nothing: no copy out
                plan.swap_outs.append(Swap(victim.id, slot))
                if rows is not None:
                    rows.swap_outs.append(RowSwap(victim.id, slot))
        if s.parked is None:              # no stream yet: it starts under its prompt
            plan.swap_ins.append(Swap(s.id, slot, None, s.prompt))
        else:
            rewrite = s.pending_prompt if s.pending else None
            plan.swap_ins.append(Swap(s.id, slot, s.parked, rewrite))
        if rows is not None:              # no row state: its row starts over
            rows.swap_ins.append(RowSwap(s.id, slot, s.decoder))
        if enc is not None:               # a server that takes video in
            self._encode_rows(enc, victim, s, slot)
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
    def _overlapping(self) -> bool:
        return self.overlap is not None and self.checkpoints is None

    def _step_plain(self, step: Step) -> int:
        """One step run, then committed (module doc); the chunks it queued."""
        self._execute(step)
        self._swap_rows(step)
        if step.decodes():
            self.decode_stage.decode(step.decode, step.res.latents, step.decoded)
        step.keep_latents(self.host_latents)
        if step.copied is not None:
            step.copied.synchronize()
        return self._finish(step)

    def _step_overlapped(self, step: Step) -> int:
        """One step whose decode runs beside the next step's transformer (module doc);
        the chunks the step before it delivered."""
        self._execute(step)
        made = self._flush()              # its decode ran beside this step's transformer
        self._swap_rows(step)
        if not (step.decodes() and self.overlap.submit(step)):
            return made + self._finish(step)     # a failure, or nothing to decode
        step.keep_latents(self.host_latents)
        with self.lock:
            step.made = self._settle(step)
        return made

    def _execute(self, step: Step) -> None:
        """The step's noise and sampler inputs drawn, then `ChunkRunner.execute` (no
        lock)."""
        step.started = time.perf_counter()
        if step.encode is not None:
            self._encode(step)
        if step.plan.rows:
            step.plan.draw_noise(self.chunk_shape,
                                 self.runner.sampling if self.runner.input_shapes else None)
        step.res = self.runner.execute(step.plan)

    def _swap_rows(self, step: Step) -> None:
        """The step's decoder rows swapped after the runner's rows (no lock)."""
        if step.decode is not None:
            step.decoded = self.decode_stage.swap(step.decode, step.res.failed)

    def _finish(self, step: Step) -> int:
        """Commit a step whose GPU work is done (its rows started over first after a
        failure); the chunks queued."""
        if step.error is not None and step.plan.rows:
            self._restart_rows(step.plan)    # before its streams are seen failed
        with self.lock:
            step.made = self._settle(step)
            made = 0 if step.made is None else self._deliver_step(step)
            due, self._due = self._due, []
            self.ready.notify_all()
        if due:
            self._checkpoint(due)
        return made

    def _flush(self) -> int:
        """Deliver the step in flight, if any (module doc); the chunks queued."""
        step = None if self.overlap is None else self.overlap.take()
        if step is None:
            return 0
        with self.lock:
            made = self._deliver_step(step)
            self.ready.notify_all()
        return made

    # ------------------------------------------------------------------ commit
    def _settle(self, step: Step) -> list | None:
        """A step's outcome on the records (lock held): its swaps and prompt changes
        settled; after a failure its streams failed (None); else each of its streams
        still going advanced, its chunk counted in flight: (batch row, prompt version)
        each."""
        if self.runner.device.type == "cuda":
            # read on the GPU thread, for `metrics`: a route that called into CUDA itself
            # would contend with this thread for the driver and the allocator
            self._device["gpu_allocated_bytes"] = torch.cuda.memory_allocated(self.runner.device)
        failed = step.failed
        self._commit_swaps(step, failed)
        self._fail_inputs(step, failed)
        self._settle_prompts(step.taken, step.res, failed)
        if step.error is not None:
            self._fail_batch(step.batch, _why(step.error))
            return None
        self._stale.difference_update(step.plan.restarts)
        made = []
        for r, e in enumerate(step.batch):
            s = e.stream
            if self.sessions.get(s.id) is s and not s.finished and s.id not in failed:
                s.chunks += 1
                s.frames += self.frames_per_chunk
                s.inflight += 1           # until `_deliver_step` queues its chunk
                # the version in force once this step's prompt changes are settled: a
                # change it took was re-cached before its chunk
                made.append((r, s.prompt_version))
        self._stepped(step.plan, step.batch)
        return made

    def _deliver_step(self, step: Step) -> int:
        """The chunks `_settle` counted made, queued for their clients (lock held), or
        their streams failed where the decode raised; the chunks queued."""
        seconds, now, made = step.seconds(), time.monotonic(), 0
        error = None if step.decoded is None or step.decoded.error is None else _why(
            step.decoded.error)
        frames = [None] * len(step.batch) if step.decoded is None else step.decoded.frames
        for r, version in step.made:
            e = step.batch[r]
            s = e.stream
            s.inflight -= 1
            if self.sessions.get(s.id) is not s or s.finished:
                continue
            if error is not None:
                self._fail(s, error)
                continue
            self._deliver(s, SessionChunk(e.index, e.frame0, step.latents[r], seconds,
                                          len(step.plan.rows), version, self.frames_per_chunk,
                                          frames[r], s.video_frames, e.requested, now,
                                          e.received, e.input))
            made += 1
        self._counts["chunks"] += made
        self._counts["failed_steps"] += error is not None
        if step.batch:
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

    def _commit_swaps(self, step: Step, failed: dict) -> None:
        """A step's swaps settled: a swap out's states parked with its stream, a swap in
        counted; a failed one fails its stream and a swap in's slot is free again (as
        is one whose stream closed while it came in)."""
        res, plan = step.res, step.plan
        rows = {} if step.decoded is None else step.decoded.parked
        enc = {} if step.encoded is None else step.encoded.parked
        for sw in plan.swap_outs:
            if self._swap_failed(sw.stream, failed):
                continue
            state = res.parked[sw.stream]
            self._swapped("swap_outs", sw.stream, state, res)
            s = self.sessions.get(sw.stream)
            if s is not None and s.slot is None:
                s.parked, s.decoder, s.encoder = state, rows.get(sw.stream), enc.get(sw.stream)
        for sw in plan.swap_ins:
            ok = not self._swap_failed(sw.stream, failed)
            if ok and sw.state is not None:
                self._swapped("swap_ins", sw.stream, sw.state, res)
            if not ok or sw.stream not in self.sessions:   # failed, or closed meanwhile
                self.pool.give(sw.slot)

    def _swap_failed(self, sid: str, failed: dict) -> bool:
        """Whether stream ``sid``'s swap failed; one that did is counted and its stream
        (if still open) fails with the reason."""
        if sid not in failed:
            return False
        self.pool.counts["failed_swaps"] += 1
        if (s := self.sessions.get(sid)) is not None:
            self._fail(s, failed[sid])
        return True

    def _swapped(self, kind: str, sid: str, state, res) -> None:
        """One swap of ``kind`` of ``state`` counted, its seconds observed."""
        self.pool.count(kind, state.nbytes)
        self.pool.seconds.observe(res.swap_seconds.get(sid, 0.0))

    def _settle_prompts(self, taken: dict, res, failed: dict) -> None:
        """The prompt changes the plan took: taken (the stream's prompt and version
        move) or failed (its old prompt stays; each change says why)."""
        for sid, (changes, prompt) in taken.items():
            s = self.sessions.get(sid)
            err = res.rewrite_errors.get(sid) or (RuntimeError(failed[sid])
                                                  if sid in failed else None)
            if s is not None:
                s.pending = [c for c in s.pending if c not in changes]
                if err is None:
                    s.prompt, s.prompt_version = prompt, changes[-1].version
                if not s.pending:
                    s.pending_prompt = None
            for c in changes:
                c.settle(None if s is None else s.chunks, err)

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
        s.parked = s.decoder = s.encoder = None
        if s.slot is not None:
            self.pool.give(s.slot)
            s.slot = None
        log.warning("stream %s failed: %s", s.id, message)

    def _fail_inputs(self, step: Step, failed: dict) -> None:
        """The video streams whose input failed to encode (not a swap: those are
        settled with the swaps) fail with the reason."""
        if step.encoded is None:
            return
        for sid in step.encoded.failed:
            s = self.sessions.get(sid)
            if s is not None and not s.finished and s.slot is not None:
                self._fail(s, failed[sid])

    def _fail_batch(self, batch: list[Entry], message: str) -> None:
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
