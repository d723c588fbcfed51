"""`StreamScheduler`: streaming sessions on one batched pool, stepped together.

A server keeps one session per client and one GPU for all of them. Here a session owns
one sequence of a `ChunkRunner`'s pool (a `Rollout(preset, sequences=N, batch_sizes=...)`
by default, or any runner ``runner_factory`` builds: a `WanRollout`), and one loop
steps every ready session at once::

    ready = active, not paused, budget left, fewer than queue_chunks chunks undelivered
    B     = the smallest captured batch size >= len(ready)   (1, 2, 4, ... max_sessions)
    rows  = the ready sessions' sequences, then B - len(ready) scratch sequences (idle
            rows: computed, dropped; they belong to no session)
    one `ChunkRunner.step_rows` = one whole-chunk graph replay for all B rows

The scheduler uses the runner through its interface alone: ``capture``,
``prefill_rows`` (a sequence started over under a prompt, or its prompt changed under
way), ``step_rows``, ``stats``, ``close`` and the shapes. Every graph is captured when
the scheduler is built (the warm-up path, ``cache_dir`` honoured); sessions join (a
free sequence started over) and leave between steps without a capture. A consumer that
does not fetch its chunks fills its bounded queue and only its session pauses. A step
that raises fails the sessions in it (each keeps the error message; their sequences
and the scratch rows start over) and the loop goes on with the others.

Chunk i of a session starts from `chunk_noise(seed, i)`, so a session's stream is a
function of its seed and prompt alone: the same seed run alone gives the same latents.
No web imports here: `framekv.tools.serve` puts HTTP and WebSockets around it, and
reads the server's metrics through `StreamScheduler.metrics`.
"""
from __future__ import annotations

import collections
import functools
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from .rollout import Rollout
from .runner import ChunkRunner, chunk_noise


class SchedulerFull(Exception):
    """Every session sequence is taken."""


@dataclass
class SessionChunk:
    """One finished chunk of a session: index, first frame, latents fp32 [C, F, H, W]
    (host memory), seconds of the batched step that made it, its batch size, how many
    prompt changes the session had had when it was made, and its frames."""

    index: int
    frame0: int
    latents: torch.Tensor
    seconds: float
    batch: int
    prompt_version: int = 0
    frames: int = 0


@dataclass
class Session:
    """A client's stream: its sequence of the pool, its position, its undelivered chunks.

    ``state``: "active", "done" (its chunk budget is spent), "failed" (``error`` says
    why) or "closed". ``paused``: the client asked for a pause.
    """

    id: str
    sequence: int
    seed: int
    budget: int | None
    chunks: int = 0
    frames: int = 0
    paused: bool = False
    prompt_version: int = 0
    state: str = "active"
    error: str | None = None
    queue: collections.deque = field(default_factory=collections.deque)

    @property
    def finished(self) -> bool:
        """No chunk will come any more (done, failed or closed)."""
        return self.state != "active"


def default_batch_sizes(max_sessions: int) -> tuple[int, ...]:
    """Powers of two below ``max_sessions``, and ``max_sessions``."""
    sizes, b = [], 1
    while b < max_sessions:
        sizes.append(b)
        b *= 2
    return tuple(sizes) + (max_sessions,)


class StreamScheduler:
    """Sessions on one batched pool (module doc).

    Args:
        preset: the rollout preset of the reference model (a name, path or `Preset`).
        max_sessions: sessions at once; beyond them `open_session` raises `SchedulerFull`.
        device, backend, cache_dir, use_graphs: as for `Rollout`.
        queue_chunks: undelivered chunks a session may hold before it pauses.
        batch_sizes: the batch sizes captured (default `default_batch_sizes`).
        runner_factory: instead of the preset's `Rollout`, a callable
            ``(sequences=N, batch_sizes=sizes) -> ChunkRunner`` (e.g. a `WanRollout`
            partial).
    """

    def __init__(self, preset="tiny", *, max_sessions: int = 8, device=None, backend=None,
                 cache_dir=None, use_graphs: bool = True, queue_chunks: int = 4,
                 batch_sizes=None, progress: bool = False, runner_factory=None):
        for name, v in (("max_sessions", max_sessions), ("queue_chunks", queue_chunks)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        sizes = tuple(sorted(set(batch_sizes or default_batch_sizes(max_sessions))))
        if sizes[-1] < max_sessions or sizes[0] < 1:
            raise ValueError(f"batch_sizes must reach max_sessions={max_sessions}, got {sizes}")
        scratch = max(min(b for b in sizes if b >= k) - k for k in range(1, max_sessions + 1))
        self.max_sessions, self.queue_chunks, self.batch_sizes = max_sessions, queue_chunks, sizes
        make = runner_factory or functools.partial(
            Rollout, preset, device, backend=backend, cache_dir=cache_dir, use_graphs=use_graphs)
        self.runner: ChunkRunner = make(sequences=max_sessions + scratch, batch_sizes=sizes)
        if not isinstance(self.runner, ChunkRunner):
            raise ValueError(f"runner_factory must build a ChunkRunner, got "
                             f"{type(self.runner).__name__}")
        self.report = self.runner.capture(progress=progress) if self.runner.use_graphs else None
        self.runner.prefill_rows(range(max_sessions + scratch))
        self._scratch = list(range(max_sessions, max_sessions + scratch))
        self._free = list(range(max_sessions))
        self.sessions: dict[str, Session] = {}
        self.lock = threading.RLock()       # sessions and the runner
        self.ready = threading.Condition(self.lock)
        self._counts = {"steps": 0, "chunks": 0, "failed_steps": 0}
        self._step_seconds: list[float] = []
        #: one chunk of a session, [C, F, H, W]; prompt: [L, text_dim]
        self.chunk_shape = tuple(self.runner.chunk_shape)
        self.frames_per_chunk = self.runner.frames_per_chunk
        self.prompt_shape = tuple(self.runner.prompt_shape)

    # ------------------------------------------------------------------ sessions
    def open_session(self, *, seed: int, prompt: torch.Tensor | None = None,
                     chunks: int | None = None) -> Session:
        """A new session at position 0 (``prompt``: `prompt_shape`, default the
        runner's; ``chunks``: a budget, None for open-ended). Raises `SchedulerFull`
        when every sequence is taken, ValueError for a bad argument."""
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise ValueError(f"seed must be an integer in [0, 2**31), got {seed!r}")
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                                   or chunks < 1):
            raise ValueError(f"chunks must be None or an integer >= 1, got {chunks!r}")
        with self.lock:
            if not self._free:
                raise SchedulerFull(f"all {self.max_sessions} session sequences are taken")
            seq = self._free.pop(0)
            try:
                self.runner.prefill_rows([seq], prompt)
            except BaseException:
                self._free.insert(0, seq)
                raise
            s = Session(secrets.token_urlsafe(18), seq, seed, chunks)
            self.sessions[s.id] = s
            self.ready.notify_all()
            return s

    def close_session(self, session_id: str) -> None:
        """End a session and free its sequence (unknown ids: KeyError)."""
        with self.lock:
            s = self.sessions.pop(session_id)
            if s.state == "active":
                s.state = "closed"
            self._free.append(s.sequence)
            self.ready.notify_all()

    def set_prompt(self, session_id: str, prompt: torch.Tensor) -> None:
        """Re-cache a session's history under a new prompt before its next chunk (the
        reference model: its pinned prompt region rewritten, the window's K/V stay;
        Wan: the visible frames' K/V recomputed by clean passes)."""
        with self.lock:
            s = self.sessions[session_id]
            self.runner.prefill_rows([s.sequence], prompt, rewrite=True)
            s.prompt_version += 1

    def pause(self, session_id: str, paused: bool = True) -> None:
        """Stop (or, ``paused=False``, restart) stepping a session."""
        with self.lock:
            self.sessions[session_id].paused = paused
            self.ready.notify_all()

    # ------------------------------------------------------------------ steps
    def _ready(self) -> list[Session]:
        out = [s for s in self.sessions.values()
               if s.state == "active" and not s.paused and len(s.queue) < self.queue_chunks]
        return out[:self.max_sessions]

    def step(self) -> int:
        """One batched chunk of every ready session; returns how many sessions got one."""
        with self.lock:
            batch = self._ready()
            if not batch:
                return 0
            B = min(b for b in self.batch_sizes if b >= len(batch))
            rows = [s.sequence for s in batch] + self._scratch[:B - len(batch)]
            noise = torch.stack([chunk_noise(s.seed, s.chunks, self.chunk_shape) for s in batch]
                                + [torch.zeros(self.chunk_shape)] * (B - len(batch)))
            frame0 = torch.tensor([s.frames for s in batch] + [0] * (B - len(batch)))
            t0 = time.perf_counter()
            try:
                out = self.runner.step_rows(rows, noise, frame0).cpu()
            except Exception as exc:  # the sessions of this step fail, the others go on
                self._fail(batch, f"{type(exc).__name__}: {exc}")
                return 0
            seconds = time.perf_counter() - t0
            for r, s in enumerate(batch):
                s.queue.append(SessionChunk(s.chunks, s.frames, out[r], seconds, B,
                                            s.prompt_version, self.frames_per_chunk))
                s.chunks += 1
                s.frames += self.frames_per_chunk
                if s.budget is not None and s.chunks >= s.budget:
                    s.state = "done"
            self._counts["steps"] += 1
            self._counts["chunks"] += len(batch)
            self._step_seconds.append(seconds)
            self.ready.notify_all()
            return len(batch)

    def metrics(self) -> dict:
        """A snapshot for a server's metrics: sessions open and allowed, steps, chunks,
        failed steps, the seconds of every step, the runner's device and its
        `ChunkRunner.stats` (graph replays and captures, pool bytes)."""
        with self.lock:
            return {"sessions": len(self.sessions), "max_sessions": self.max_sessions,
                    "device": str(self.runner.device),
                    **self._counts, "step_seconds": list(self._step_seconds),
                    **self.runner.stats()}

    def _fail(self, batch: list[Session], message: str) -> None:
        self._counts["failed_steps"] += 1
        for s in batch:
            s.state, s.error = "failed", message
        # A step that failed part way may have moved these sequences: start them over.
        self.runner.prefill_rows([s.sequence for s in batch] + self._scratch)
        self.ready.notify_all()

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
            self.ready.notify_all()  # its session may be ready again
            return chunk

    # ------------------------------------------------------------------ loop
    def run(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """Step until ``stop`` is set (the GPU loop of a server, in its own thread)."""
        while not stop.is_set():
            if self.step() == 0:
                with self.ready:
                    if not self._ready() and not stop.is_set():
                        self.ready.wait(idle_wait)

    def close(self) -> None:
        """Free the pool and the graphs."""
        with self.lock:
            self.runner.close()
