"""`StreamScheduler`: streaming sessions on one batched pool, stepped together.

A server keeps one session per client and one GPU for all of them. Here up to
``max_sessions`` N sessions are open, and up to ``slots`` S <= N of them hold a slot,
one sequence of a `ChunkRunner`'s pool (a `Rollout(preset, sequences=S + scratch,
batch_sizes=...)` by default, or any runner ``runner_factory`` builds: a `WanRollout`).
One loop steps the ready sessions together::

    ready = active, not paused, budget left, fewer than queue_chunks chunks undelivered
    batch = the S ready sessions (at most): first the resident ones within their swap
            quantum (fewer than ``swap_quantum`` steps since they took their slot), then
            those that have waited longest (``waiting_since``)
    slots = each one in the batch without a slot takes a free one, else one a resident
            session outside the batch gives up (`framekv.engine.swap`: not ready
            first, then least recently stepped), swapped out to host memory; it is
            swapped back in (restored, no capture) before its chunk
    B     = the smallest captured batch size >= len(batch)   (1, 2, 4, ... S)
    rows  = the batch's sequences, then B - len(batch) scratch sequences (idle rows:
            computed, dropped; they belong to no session)
    one `ChunkRunner.step_rows` = one whole-chunk graph replay for all B rows
    with a decoder: one batched decode of the ready sessions on their first chunk, one
            of those going on (decoder row = the session's sequence)

The scheduler uses the runner through its interface alone: ``capture``,
``prefill_rows`` (a sequence started over under a prompt, or its prompt changed under
way), ``step_rows``, ``snapshot`` / ``restore`` (swaps), ``describe``, ``stats``,
``close`` and the shapes. Every graph is captured when the scheduler is built (the
warm-up path, ``cache_dir`` honoured; the decoder comes captured from
``decoder_factory``); sessions join (a free sequence started over, its decoder row
reset; with no slot free, swapped out until their turn), swap and leave between steps
without a capture. With S = N (``slots`` None) no session ever swaps. The quantum
bounds the swapping: every session gets a turn, and a swapped-in one keeps its slot for
``swap_quantum`` steps while it is ready, so a stream's swap (its kept K/V out and back
over PCIe) is paid once per quantum, not once per chunk. A consumer that
does not fetch its chunks fills its bounded queue and only its session pauses. A step
(or its decode) that raises fails the sessions in it (each keeps the error message;
their sequences and the scratch rows start over) and the loop goes on with the others;
a start-over that raises too is logged, and the scratch rows are started over before
their next step. A swap that raises fails that one session the same way. A loop that
ends by an exception fails every session and refuses new ones
(`StreamScheduler.loop_error`, `LoopStopped`).

A session's chunks are one video: its first chunk decodes to 1 + 4 (F - 1) frames,
every later one to 4 F, going on from its decoder row's causal state (a prompt change
keeps it). `SessionChunk.video` holds them as host uint8 [F', H, W, 3] (`video_uint8`,
on the device: a sender only encodes images). A prompt is a tensor [L, text_dim], or
text where the runner has a ``text_encoder`` (else ValueError), encoded outside the lock.

Chunk i of a session starts from `chunk_noise(seed, i)`, so a session's stream is a
function of its seed and prompt alone: the same seed run alone gives the same latents.
A chunk's latency runs from its session being ready for it (opened, a queue place
freed, resumed) to its being queued, decode included. A closed session leaves its
`Session.info` in `ended` (`session_info`). `save_sessions` / `restore_sessions` carry
the open sessions over a restart (`framekv.engine.session_files`). No web imports here:
`framekv.tools.serve` puts HTTP and WebSockets around it and reads `metrics`.

One file: one lock guards the sessions, the slots, the runner and the decoder, and every
method here keeps their invariants together; the swaps (`framekv.engine.swap`), the
files (`framekv.engine.session_files`) and the records (`framekv.engine.sessions`) live
beside it.
"""
from __future__ import annotations

import functools
import logging
import math
import secrets
import threading
import time

import torch

from .checks import check_prompt
from .rollout import Rollout
from .runner import ChunkRunner, chunk_noise
from .session_files import read_sessions, save_session
from .sessions import (LATENCY_BUCKETS, EndedSessions, Histogram, PromptChange, Session,
                       SessionChunk, default_batch_sizes, video_uint8)
from .swap import SlotPool

__all__ = ["Histogram", "LATENCY_BUCKETS", "LoopStopped", "PromptChange", "SchedulerFull",
           "Session", "SessionChunk", "StreamScheduler", "default_batch_sizes", "video_uint8"]
log = logging.getLogger("framekv.scheduler")


class SchedulerFull(Exception):
    """``max_sessions`` sessions are open."""


class LoopStopped(RuntimeError):
    """The GPU loop (`StreamScheduler.run`) ended by an exception: no session can be
    stepped any more; the message says why."""


class StreamScheduler:
    """Sessions on one batched pool (module doc).

    Args:
        preset: the rollout preset of the reference model (a name, path or `Preset`).
        max_sessions: sessions open at once; beyond them `open_session` raises
            `SchedulerFull`.
        slots: sessions on the pool at once (the runner's sequences, besides scratch
            rows; the batch sizes reach it), in [1, max_sessions]; None: max_sessions
            (no session swaps). The others wait swapped out to host memory.
        swap_quantum: steps a ready session keeps a slot it took before a waiting one
            may take it (module doc).
        device, backend, cache_dir, use_graphs: as for `Rollout`.
        queue_chunks: undelivered chunks a session may hold before it pauses.
        batch_sizes: the batch sizes captured (default `default_batch_sizes`).
        runner_factory: instead of the preset's `Rollout`, a callable
            ``(sequences=N, batch_sizes=sizes) -> ChunkRunner`` (e.g. a `WanRollout`
            partial).
        kv_dtype: the K/V pool of the preset's `Rollout` (its ``kv_dtype``: None or
            "bf16" the model's dtype, "fp8"); a ``runner_factory`` sets its own runner's,
            so it takes None here.
        decoder_factory: None (latents only), or a callable ``(slots) ->`` a
            streaming video decoder (``decode(latents [B, C, F, H, W], rows=...)`` ->
            frames [B, 3, F', H', W'] in [-1, 1], ``reset(rows=...)``, ``snapshot(row)``
            and ``restore(row, state)`` where sessions swap, ``close()``;
            `framekv.engine.wan.StreamingVAEDecoder`), ready to decode.
        ended_records: the closed sessions' infos `ended` keeps (the latest).
    """

    def __init__(self, preset="tiny", *, max_sessions: int = 8, slots: int | None = None,
                 device=None, backend=None, cache_dir=None, use_graphs: bool = True,
                 queue_chunks: int = 4, batch_sizes=None, progress: bool = False,
                 runner_factory=None, decoder_factory=None, ended_records: int = 1024,
                 swap_quantum: int = 16, kv_dtype=None):
        S = _check_counts(max_sessions, slots, queue_chunks, ended_records)
        if kv_dtype is not None and runner_factory is not None:
            raise ValueError(f"kv_dtype is the preset's Rollout's: with a runner_factory, "
                             f"set it in the factory, got kv_dtype={kv_dtype!r}")
        if isinstance(swap_quantum, bool) or not isinstance(swap_quantum, int) or swap_quantum < 1:
            raise ValueError(f"swap_quantum must be an integer >= 1, got {swap_quantum!r}")
        self.swap_quantum = swap_quantum
        if decoder_factory is not None and not callable(decoder_factory):
            raise ValueError(f"decoder_factory must be a callable, got {decoder_factory!r}")
        sizes = tuple(sorted(set(batch_sizes or default_batch_sizes(S))))
        if sizes[-1] < S or sizes[0] < 1:
            raise ValueError(f"batch_sizes must reach slots={S}, got {sizes}")
        scratch = max(min(b for b in sizes if b >= k) - k for k in range(1, S + 1))
        self.max_sessions, self.slots, self.queue_chunks = max_sessions, S, queue_chunks
        self.batch_sizes = sizes
        make = runner_factory or functools.partial(
            Rollout, preset, device, backend=backend, cache_dir=cache_dir, use_graphs=use_graphs,
            kv_dtype=kv_dtype)
        self.runner: ChunkRunner = make(sequences=S + scratch, batch_sizes=sizes)
        if not isinstance(self.runner, ChunkRunner):
            raise ValueError(f"runner_factory must build a ChunkRunner, got "
                             f"{type(self.runner).__name__}")
        try:
            self.report = self.runner.capture(progress=progress) if self.runner.use_graphs else None
            self.runner.prefill_rows(range(S + scratch))
            cache = self.runner.cache
            if cache is not None and max_sessions > S:  # host memory of the swapped-out
                rows = 1 if getattr(self.runner, "guidance", None) is None else 2
                cache.reserve_exports(rows * (max_sessions - S))
            self.decoder = None if decoder_factory is None else decoder_factory(S)
        except BaseException:
            self.runner.close()
            raise
        self._scratch = list(range(S, S + scratch))
        #: the slots, the free ones and the sessions swapped out (`framekv.engine.swap`)
        self.pool = SlotPool(self.runner, self.decoder, S)
        self._free = self.pool.free
        self._held = False                  # `hold`: no session is stepped
        self.sessions: dict[str, Session] = {}
        self.ended = EndedSessions(ended_records)     # the sessions closed last
        self.lock = threading.RLock()       # sessions, the runner and the decoder
        self.ready = threading.Condition(self.lock)
        self._text_lock = threading.Lock()
        self._counts = {"steps": 0, "chunks": 0, "failed_steps": 0, "failed_resets": 0,
                        "video_frames": 0}
        self._stale: set[int] = set()       # scratch rows to start over before a step
        #: why the GPU loop ended by an exception (`run`); None while it has not
        self.loop_error: str | None = None
        self._step_seconds, self._chunk_seconds = Histogram(), Histogram()
        #: one chunk of a session, [C, F, H, W]; prompt: [L, text_dim]
        self.chunk_shape = tuple(self.runner.chunk_shape)
        self.frames_per_chunk = self.runner.frames_per_chunk
        self.prompt_shape = tuple(self.runner.prompt_shape)
        #: chunks carry video frames; prompts may be text (the runner has a text_encoder)
        self.decoding = self.decoder is not None
        self.text_prompts = getattr(self.runner, "text_encoder", None) is not None

    # ------------------------------------------------------------------ sessions
    def _prompt(self, prompt):
        """``prompt`` as the runner takes it: None, a tensor, or a string encoded here
        (ValueError where the runner has no text encoder)."""
        if not isinstance(prompt, str):
            return prompt
        if not self.text_prompts:
            raise ValueError(f"prompt text needs a runner with a text encoder; "
                             f"{type(self.runner).__name__} has none: give a "
                             f"{list(self.prompt_shape)} tensor, got {prompt!r}")
        with self._text_lock:  # the encoder's prompt cache is not thread safe
            return self.runner.encode_prompt(prompt)                # [1, L, text_dim]

    def open_session(self, *, seed: int, prompt: torch.Tensor | str | None = None,
                     chunks: int | None = None, paused: bool = False) -> Session:
        """A new session at position 0 (``prompt``: `prompt_shape` or text (module doc),
        default the runner's; ``chunks``: a budget, None for open-ended; ``paused``: no
        chunk until `pause` (..., False), e.g. after a `set_prompt`). It takes a free
        slot, else starts swapped out and takes one at its turn. Raises `SchedulerFull`
        when ``max_sessions`` are open, ValueError for a bad argument, `LoopStopped`
        once the GPU loop has ended by an exception (`run`)."""
        if self.loop_error is not None:
            raise LoopStopped(f"the GPU loop stopped ({self.loop_error}): no session can "
                              "be stepped; restart the server")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise ValueError(f"seed must be an integer in [0, 2**31), got {seed!r}")
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                                   or chunks < 1):
            raise ValueError(f"chunks must be None or an integer >= 1, got {chunks!r}")
        prompt = self._prompt(prompt)
        with self.lock:
            if len(self.sessions) >= self.max_sessions:
                raise SchedulerFull(f"all {self.max_sessions} sessions are open")
            s = Session(secrets.token_urlsafe(18), None, seed, chunks, paused=bool(paused),
                        waiting_since=None if paused else time.monotonic(),
                        last_stepped=self._counts["steps"], slot_since=self._counts["steps"])
            if self._free:
                seq = self._free.pop(0)
                try:
                    self.runner.prefill_rows([seq], prompt)
                    if self.decoder is not None:
                        self.decoder.reset(rows=[seq])
                except BaseException:
                    self._free.insert(0, seq)
                    raise
                s.sequence = seq
            else:                       # its start waits for a slot (`SlotPool.place`)
                self.pool.park_start(s.id, check_prompt("prompt", prompt, self.prompt_shape))
            self.sessions[s.id] = s
            self.ready.notify_all()
            return s

    def close_session(self, session_id: str, reason: str = "closed") -> None:
        """End a session ("closed" unless done or failed), drop its undelivered chunks
        and free its slot (its row started over) or its swapped-out stream; its
        `Session.info`, ``end_reason`` = ``reason``, goes to `ended`. Raises KeyError
        for an id that is not open (unknown, or closed before), so of two racing closes
        exactly one succeeds. `metrics` counts ``reason`` by value (``ended``): callers
        use a fixed vocabulary."""
        with self.lock:
            s = self.sessions[session_id]
            if s.sequence is not None:
                self.pool.release(s.sequence)
            self.pool.parked.pop(s.id, None)
            # Out of `sessions` last: a reader without the lock sees it open until its
            # slot is free.
            del self.sessions[session_id]
            if s.state == "active":
                s.state = "closed"
            s.end_reason, s.waiting_since = reason, None
            s.queue.clear()
            self.ended.add(s.info())
            self.ready.notify_all()

    def session_info(self, session_id: str) -> dict | None:
        """`Session.info` of an open session, else the one `ended` keeps, else None."""
        with self.lock:
            s = self.sessions.get(session_id)
            return s.info() if s is not None else self.ended.get(session_id)

    def set_prompt(self, session_id: str, prompt: torch.Tensor | str) -> PromptChange:
        """Re-cache a session's history under a new prompt (a tensor, or text: module
        doc) before its next chunk (the reference model: its pinned prompt region
        rewritten, the window's K/V stay; Wan: the visible frames' K/V recomputed by
        clean passes); its video goes on. A session swapped out keeps the prompt
        (checked now) and is re-cached as it swaps back in. Returns its new prompt
        version and the index of the first chunk made under it: the next one, as the
        change happens between steps (`PromptChange`). KeyError for an id that is not
        open."""
        if session_id not in self.sessions:
            raise KeyError(session_id)
        prompt = self._prompt(prompt)
        with self.lock:
            s = self.sessions[session_id]
            if s.sequence is not None:
                self.runner.prefill_rows([s.sequence], prompt, rewrite=True)
            elif s.id in self.pool.parked:      # none parked: finished, nothing to re-cache
                self.pool.parked[s.id].prompt = check_prompt("prompt", prompt, self.prompt_shape)
            s.prompt_version += 1
            return PromptChange(s.prompt_version, s.chunks)

    def pause(self, session_id: str, paused: bool = True) -> None:
        """Stop (or, ``paused=False``, restart) stepping a session."""
        with self.lock:
            s = self.sessions[session_id]
            s.paused = paused
            self._mark_waiting(s)
            self.ready.notify_all()

    def hold(self, held: bool = True) -> None:
        """Step no session (or, ``held=False``, step them again), their own pause
        untouched: a server's drain, before `save_sessions`. Returns once a step under
        way has ended."""
        with self.lock:
            self._held = bool(held)
            self.ready.notify_all()

    # ------------------------------------------------------------------ steps
    def _is_ready(self, s: Session) -> bool:
        return s.state == "active" and not s.paused and len(s.queue) < self.queue_chunks

    def _ready(self) -> list[Session]:
        """The next step's sessions: the ``slots`` ready ones, those within their swap
        quantum first, then those that waited longest (module doc)."""
        if self._held:
            return []
        ready = [s for s in self.sessions.values() if self._is_ready(s)]
        steps = self._counts["steps"]

        def order(s: Session) -> tuple:
            within = s.sequence is not None and steps - s.slot_since < self.swap_quantum
            # Stable: ties in opening order; a clock not started yet counts as started now.
            return (not within, math.inf if s.waiting_since is None else s.waiting_since)

        return sorted(ready, key=order)[:self.slots]

    def _mark_waiting(self, s: Session) -> None:
        """Start (or stop) the clock of a session's next chunk as it turns ready (or not)."""
        if not self._is_ready(s):
            s.waiting_since = None
        elif s.waiting_since is None:
            s.waiting_since = time.monotonic()

    def step(self) -> int:
        """One batched chunk of every ready session; returns how many sessions got one."""
        with self.lock:
            ready = self._ready()
            batch = self.pool.place(ready, self.sessions.values(), self._is_ready,
                                    self._counts["steps"])
            if len(batch) < len(ready):     # a swap failed: its session's reader wakes
                self.ready.notify_all()
            if not batch:
                return 0
            B = min(b for b in self.batch_sizes if b >= len(batch))
            rows = [s.sequence for s in batch] + self._scratch[:B - len(batch)]
            noise = torch.stack([chunk_noise(s.seed, s.chunks, self.chunk_shape) for s in batch]
                                + [torch.zeros(self.chunk_shape)] * (B - len(batch)))
            frame0 = torch.tensor([s.frames for s in batch] + [0] * (B - len(batch)))
            t0 = time.perf_counter()
            try:
                self._restart_stale(rows[len(batch):])
                out = self.runner.step_rows(rows, noise, frame0)      # [B, C, F, H, W]
                video = self._decode(batch, out[:len(batch)])
                out = out.cpu()
            except Exception as exc:  # the sessions of this step fail, the others go on
                self._fail(batch, f"{type(exc).__name__}: {exc}")
                return 0
            seconds, now = time.perf_counter() - t0, time.monotonic()
            for r, s in enumerate(batch):
                self._queue(s, SessionChunk(
                    s.chunks, s.frames, out[r], seconds, B, s.prompt_version,
                    self.frames_per_chunk, video[r], s.video_frames,
                    s.waiting_since if s.waiting_since is not None else now, now))
            self._counts["steps"] += 1
            self._counts["chunks"] += len(batch)
            for s in batch:
                s.last_stepped = self._counts["steps"]
            self._step_seconds.observe(seconds)
            self.ready.notify_all()
            return len(batch)

    def _queue(self, s: Session, chunk: SessionChunk) -> None:
        s.queue.append(chunk)
        s.chunks += 1
        s.frames += chunk.frames
        if chunk.video is not None:
            s.video_frames += chunk.video.shape[0]
            self._counts["video_frames"] += chunk.video.shape[0]
        if s.budget is not None and s.chunks >= s.budget:
            s.state = "done"
        self._chunk_seconds.observe(chunk.queued - chunk.requested)
        s.waiting_since = None
        self._mark_waiting(s)

    def _decode(self, batch: list[Session], latents: torch.Tensor) -> list:
        """Each session's frames of this step (host uint8 [F', H, W, 3], or None without
        a decoder): one batched decode per stage, those on their first chunk and those
        going on (the decoder takes one stage per call)."""
        video = [None] * len(batch)
        for first in ((True, False) if self.decoder is not None else ()):
            idx = [i for i, s in enumerate(batch) if (s.chunks == 0) == first]
            if idx:
                frames = self.decoder.decode(latents[idx], rows=[batch[i].sequence for i in idx])
                frames = video_uint8(frames).cpu()                # [b, F', H, W, 3]
                for j, i in enumerate(idx):
                    video[i] = frames[j]
        return video

    def metrics(self) -> dict:
        """A snapshot for a server's metrics: sessions open and allowed, slots, sessions
        on the pool (``sessions_resident``) and off it (``sessions_swapped``), the host
        bytes the swapped-out streams hold (``swapped_bytes``), swaps out and in, their
        host bytes (``swap_bytes``) and failures (``failed_swaps``), steps, chunks,
        failed steps and failed start-overs (``failed_resets``), video frames decoded
        (``decoding``: whether any are), sessions closed by reason (``ended``),
        histograms (`Histogram.snapshot`) of step seconds, chunk latency and swap
        seconds (``step_seconds``, ``chunk_seconds``, ``swap_seconds``), the device and
        `ChunkRunner.stats` (graphs, pool bytes)."""
        with self.lock:
            resident = sum(s.sequence is not None for s in self.sessions.values())
            return {"sessions": len(self.sessions), "max_sessions": self.max_sessions,
                    "slots": self.slots, "sessions_resident": resident,
                    "sessions_swapped": len(self.sessions) - resident,
                    "swapped_bytes": self.pool.parked_bytes, **self.pool.counts,
                    "device": str(self.runner.device), "decoding": self.decoding,
                    "ended": dict(self.ended.by_reason),
                    **self._counts, "step_seconds": self._step_seconds.snapshot(),
                    "chunk_seconds": self._chunk_seconds.snapshot(),
                    "swap_seconds": self.pool.seconds.snapshot(), **self.runner.stats()}

    def _fail(self, batch: list[Session], message: str) -> None:
        """Fail the sessions of a step that raised (each keeps ``message``) and start
        their rows and the scratch rows over (a step that failed part way may have moved
        them). Never raises: a failing restart is logged and counted (``failed_resets``);
        the scratch rows then stay stale until `_restart_stale` starts them over, and a
        session's row is started over anyway when a new session takes it."""
        self._counts["failed_steps"] += 1
        for s in batch:
            s.state, s.error, s.waiting_since = "failed", message, None
        rows = [s.sequence for s in batch] + self._scratch
        try:
            self.runner.prefill_rows(rows)
            self._stale.clear()
        except Exception:
            self._counts["failed_resets"] += 1
            self._stale.update(self._scratch)
            log.exception("starting rows %s over after a failed step (%s) raised too; the "
                          "scratch rows are retried before their next step", rows, message)
        self.ready.notify_all()

    def _restart_stale(self, scratch: list[int]) -> None:
        """Start over those of a step's ``scratch`` rows a failed restart left stale
        (`_fail`); raises as `ChunkRunner.prefill_rows` does, failing that step."""
        stale = [r for r in scratch if r in self._stale]
        if stale:
            self.runner.prefill_rows(stale)
            self._stale.difference_update(stale)

    def next_chunk(self, session_id: str, timeout: float | None = None) -> SessionChunk | None:
        """The session's oldest undelivered chunk, waiting up to ``timeout`` seconds for
        one; None when none came (then see the session's state) or the session is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.ready:
            s = self.sessions.get(session_id)
            if s is None:  # closed meanwhile
                return None
            while not s.queue and not s.finished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.ready.wait(left)
            if not s.queue:
                return None
            chunk = s.queue.popleft()
            s.delivered += 1
            self._mark_waiting(s)
            self.ready.notify_all()  # its session may be ready again
            return chunk

    # ------------------------------------------------------------------ restarts
    def save_sessions(self, directory) -> list[str]:
        """Write each open session that has not failed to ``directory`` (an existing
        folder), one file each (`framekv.engine.session_files`): its record, its
        undelivered chunks and its stream, snapshot from its slot where it holds one,
        else the one swapped out. The sessions stay open; call it when no step is to
        come (`hold`, or the loop stopped). A session that cannot be written (or has
        failed) is logged and left out. Returns the ids written."""
        with self.lock:
            model, saved = self.runner.describe(), []
            for s in list(self.sessions.values()):
                if s.state == "failed":
                    log.warning("session %s is not saved: it failed (%s)", s.id, s.error)
                    continue
                try:
                    save_session(directory, s, self.pool.capture(s), model, self.decoding)
                except Exception:
                    log.exception("saving session %s to %s raised: it is not saved", s.id,
                                  directory)
                    continue
                saved.append(s.id)
            return saved

    def restore_sessions(self, directory) -> list[str]:
        """Open again the sessions `save_sessions` wrote to ``directory``, under their
        ids and swapped out (each takes a slot at its turn), as many as
        ``max_sessions`` leaves room for: each goes on from its next chunk, its
        undelivered chunks first, its pause kept. A file read is removed; a corrupt one
        is logged and renamed ``*.corrupt``; one of another runner (model, shapes, pool
        geometry) or decoding is logged and left (`framekv.engine.session_files`).
        Returns the ids opened."""
        with self.lock:
            loaded = read_sessions(directory, self.runner.describe(), self.decoding,
                                   room=self.max_sessions - len(self.sessions),
                                   taken=set(self.sessions),
                                   pin_memory=torch.device(self.runner.device).type == "cuda")
            for s, parked in loaded:
                if parked is not None:
                    self.pool.parked[s.id] = parked
                s.last_stepped = self._counts["steps"]
                self.sessions[s.id] = s
                self._mark_waiting(s)
            self.ready.notify_all()
            return [s.id for s, _ in loaded]

    # ------------------------------------------------------------------ loop
    def run(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """Step until ``stop`` is set (the GPU loop of a server, in its own thread). A
        failing step fails its sessions and the loop goes on (`step`); should the loop
        itself raise, `loop_error` keeps why, every session still going fails with it,
        `open_session` raises `LoopStopped` from then on, and the exception propagates."""
        try:
            while not stop.is_set():
                if self.step() == 0:
                    with self.ready:
                        if not self._ready() and not stop.is_set():
                            self.ready.wait(idle_wait)
        except BaseException as exc:
            self._stopped(f"{type(exc).__name__}: {exc}")
            raise

    def _stopped(self, reason: str) -> None:
        """Record that the loop ended by an exception (`run`) and fail the sessions."""
        with self.lock:
            self.loop_error = reason
            for s in self.sessions.values():
                if not s.finished:
                    s.state, s.waiting_since = "failed", None
                    s.error = f"the GPU loop stopped: {reason}"
            self.ready.notify_all()

    def close(self) -> None:
        """Free the pool, the graphs and the decoder."""
        with self.lock:
            self.runner.close()
            if self.decoder is not None:
                self.decoder.close()


def _check_counts(max_sessions, slots, queue_chunks, ended_records) -> int:
    """The slots S (``slots``, None: ``max_sessions``) once every count is an integer
    >= 1 and S <= ``max_sessions``; else a ValueError naming the argument."""
    for name, v in (("max_sessions", max_sessions), ("queue_chunks", queue_chunks),
                    ("ended_records", ended_records)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if slots is None:
        return max_sessions
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= max_sessions:
        raise ValueError(f"slots must be None or an integer in [1, max_sessions="
                         f"{max_sessions}], got {slots!r}")
    return slots
