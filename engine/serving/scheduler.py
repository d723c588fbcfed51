"""`StreamScheduler`: streams on one batched pool, stepped together.

A server keeps one stream per client session and one GPU for all of them. Up to
``max_sessions`` N streams are open, and up to ``slots`` S <= N of them hold a slot, one
sequence of a `ChunkRunner`'s pool (a `Rollout(preset, sequences=S + scratch,
batch_sizes=...)` by default, or what ``runner_factory`` builds: a `WanRollout`). One
loop steps the ready streams together (`steps`: plan, run, commit)::

    ready = active, not paused, budget left, fewer than queue_chunks chunks
            unacknowledged (sent to a socket or not: a client that stops reading
            stops its stream); a video stream: its next chunk's frames in (`VideoIn`)
    batch = the ready streams on the pool, then the longest waiting in slots free, idle
            or rotated (`steps`: turns); one without a slot takes a free one or a victim's
    one `ChunkRunner.execute` of the `StepPlan` (swaps, prompt rewrites, one chunk of
            the batch padded with scratch rows to a captured batch size)
    with an encoder: first the video streams' frames into input latents (`EncodeStage`)
    with a decoder: the decode of the step's chunks into uint8 frames (`DecodeStage`)

Every record of a stream is its `Stream` (position, seed, prompt, what it holds off the
pool, its chunks); the runner and the decoder hold its device state while it has a
slot. ``lock`` guards the records and is held for host work only: no GPU work runs
under it, so readers (`session_info`, `metrics`) never wait on a step. GPU work runs in
the loop's thread (`run`), or in the caller's when no loop runs; requests that need it
(`export_session`, `save_sessions`) are handed to the loop and run between steps.

A stream's chunk i starts from `chunk_noise(seed, i)`, its sampler's inputs drawn from
(seed, i) too: a stream is a function of its seed and prompts, alone or batched, moved,
swapped or restarted. Its chunks stay queued until acknowledged, and it leaves and
enters as one `StreamState` (`moves`: swaps, restarts, checkpoints, moves).

A step (or its decode) that raises fails the streams in it and the loop goes on; a
swap that raises fails its stream alone; a prompt change whose re-cache raises leaves
its stream under the old prompt (`PromptChange.result` raises it). A loop that ends by
an exception fails every stream and refuses new ones (`loop_error`, `LoopStopped`).
No web imports here: `framekv.tools.serve` puts HTTP and WebSockets around it.
"""
from __future__ import annotations

import functools
import logging
import queue
import secrets
import threading

import torch

from framekv.specs.checks import check_prompt, check_text

from ..decode_stage import DecodeStage
from ..rollout import Rollout
from ..runner import ChunkRunner
from .records import EndedSessions, Histogram, LoopStopped, PromptChange, SchedulerFull
from .delivery import Deliveries
from .loop import GpuLoop
from .moves import Moves
from .sizes import check_args, check_host_latents, default_batch_sizes, scratch_rows
from .slots import SlotPool
from .step_record import Overlap
from .steps import Steps
from .stream import Phase, Stream
from .turns import Turns
from .video_in import VideoIn

__all__ = ["LoopStopped", "SchedulerFull", "StreamScheduler"]
log = logging.getLogger("framekv.scheduler")


class StreamScheduler(Steps, Turns, Deliveries, Moves, VideoIn, GpuLoop):
    """Streams on one batched pool (module doc).

    Args:
        preset: the rollout preset of the reference model (a name, path or `Preset`).
        max_sessions: streams open at once (beyond: `open_session` raises `SchedulerFull`).
        slots: streams on the pool at once (the runner's sequences, besides scratch
            rows), in [1, max_sessions]; None: max_sessions (no stream swaps).
        swap_quantum: steps a ready stream keeps a slot it took before a waiting one
            may take it, and steps between two rotations (`steps`: turns).
        device, backend, cache_dir, use_graphs: as for `Rollout`.
        queue_chunks: unacknowledged chunks a stream may hold before it pauses.
        batch_sizes: the batch sizes captured (default `default_batch_sizes`).
        runner_factory: instead of the preset's `Rollout`, a callable
            ``(sequences=N, batch_sizes=sizes) -> ChunkRunner`` (a `WanRollout` partial).
        kv_dtype, gemm_dtype, steps: the preset `Rollout`'s K/V pool and block GEMMs (None,
            "bf16", "fp8"), N of its denoising steps (None: all); None with a factory.
        decoder_factory: None (latents only), or ``(slots) ->`` a streaming video
            decoder (``decode(latents, rows=)``, ``reset(rows=)``, ``snapshot(row)``,
            ``restore(row, state)``, ``close()``: `framekv.engine.wan.StreamingVAEDecoder`).
        ended_records: the ended streams' infos `ended` keeps (the latest).
        checkpoints: None, or a `Checkpoints` writer: every stream written every N chunks.
        overlap: a step's decode beside the next step's transformer (`Overlap`): None: on
            CUDA; True: also on a CPU (chunks queued a step late); False: never. Steps
            run plainly while checkpoints are kept.
        host_latents: whether each chunk's latents are copied to the host as it is made
            (`SessionChunk.latents`): None: where there is no decoder; False (a decoder
            only): they stay on the runner's device, its frames are what a client gets
            (copied to the host for an export or a checkpoint); True: always.
        encoder_factory: None (text streams only), or ``(slots) ->`` a streaming video
            encoder (``encode(frames, rows=)``, ``reset``, ``snapshot``, ``restore``,
            ``close``, ``SPACE``, ``video_frames``: `framekv.engine.wan.StreamingVAEEncoder`):
            video streams (`VideoIn`), their frames fed in (`feed`).
    """

    def __init__(self, preset="tiny", *, max_sessions: int = 8, slots: int | None = None,
                 device=None, backend=None, cache_dir=None, use_graphs: bool = True,
                 queue_chunks: int = 4, batch_sizes=None, progress: bool = False,
                 runner_factory=None, decoder_factory=None, ended_records: int = 1024,
                 swap_quantum: int = 16, kv_dtype=None, checkpoints=None,
                 overlap: bool | None = None, steps: int | None = None, gemm_dtype=None,
                 host_latents: bool | None = None, encoder_factory=None):
        S = check_args(max_sessions, slots, queue_chunks, ended_records, swap_quantum, {
            "kv_dtype": kv_dtype, "steps": steps, "gemm_dtype": gemm_dtype}, runner_factory,
            decoder_factory)
        self.host_latents = check_host_latents(host_latents, decoder_factory is not None)
        sizes = tuple(sorted(set(batch_sizes or default_batch_sizes(S))))
        if sizes[-1] < S or sizes[0] < 1:
            raise ValueError(f"batch_sizes must reach slots={S}, got {sizes}")
        scratch = scratch_rows(sizes, S)
        self.max_sessions, self.slots, self.queue_chunks = max_sessions, S, queue_chunks
        self.swap_quantum, self.batch_sizes, self.checkpoints = swap_quantum, sizes, checkpoints
        make = runner_factory or functools.partial(
            Rollout, preset, device, backend=backend, cache_dir=cache_dir, use_graphs=use_graphs,
            kv_dtype=kv_dtype, steps=steps, gemm_dtype=gemm_dtype)
        self.runner: ChunkRunner = make(sequences=S + scratch, batch_sizes=sizes)
        if not isinstance(self.runner, ChunkRunner):
            raise ValueError(f"runner_factory must build a ChunkRunner, got "
                             f"{type(self.runner).__name__}")
        self.report, self.decoder = self._start(S + scratch, max_sessions - S, progress,
                                                decoder_factory)
        self._scratch = list(range(S, S + scratch))
        self.pool = SlotPool(S)
        self._held = False                  # `hold`: no stream is stepped
        self.sessions: dict[str, Stream] = {}
        self.ended = EndedSessions(ended_records)
        self.lock = threading.RLock()       # the records: streams, slots, counters
        self.ready = threading.Condition(self.lock)
        self._gpu = threading.Lock()        # the runner and the decoder: one user at a time
        self._text_lock = threading.Lock()
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: threading.Thread | None = None
        self._counts = {"steps": 0, "chunks": 0, "failed_steps": 0, "failed_resets": 0,
                        "video_frames": 0, "rows": 0, "scratch_rows": 0}
        self._batch_sizes: dict[int, int] = {}   # rows -> steps that ran as many
        self._stale: set[int] = set()       # scratch rows to start over before a step
        self._device: dict = {}             # gpu_allocated_bytes, as of the last step
        self._due: list[str] = []           # streams whose checkpoint is due
        #: why the GPU loop ended by an exception (`run`); None while it has not
        self.loop_error: str | None = None
        self._step_seconds, self._chunk_seconds = Histogram(), Histogram()
        #: one chunk of a stream, [C, F, H, W]; prompt: [L, text_dim]
        self.chunk_shape = tuple(self.runner.chunk_shape)
        self.frames_per_chunk = self.runner.frames_per_chunk
        self.prompt_shape = tuple(self.runner.prompt_shape)
        self.decoding = self.decoder is not None
        # the decode of a step beside the next step's transformer (`Overlap`)
        on = self.decoding and (overlap or (overlap is None and self.runner.device.type == "cuda"))
        self.decode_stage = None if not self.decoding else DecodeStage(
            self.decoder, device=self.runner.device, overlap=None if on else False)
        self.overlap = Overlap(self.decode_stage) if on else None
        self.text_prompts = getattr(self.runner, "text_encoder", None) is not None
        self.model = self.runner.describe()
        self._input_seconds = Histogram()
        try:
            self._start_video(encoder_factory)
        except BaseException:
            self.close()
            raise

    def _start(self, rows: int, parked: int, progress, decoder_factory):
        """Capture the graphs, start every row, reserve host memory for the parked streams
        and a rotation's swap outs, build the decoder; (capture report, decoder)."""
        try:
            report = self.runner.capture(progress=progress) if self.runner.use_graphs else None
            self.runner.prefill_rows(range(rows))
            cache = self.runner.cache
            if cache is not None and parked > 0:
                branches = 1 if getattr(self.runner, "guidance", None) is None else 2
                cache.reserve_exports(branches * (parked + min(parked, self.slots)))
            return report, None if decoder_factory is None else decoder_factory(self.slots)
        except BaseException:
            self.runner.close()
            raise

    # ------------------------------------------------------------------ streams
    def _prompt(self, prompt):
        """``prompt`` as a host [L, text_dim] tensor (text encoded here: ValueError where
        the runner has no text encoder), or None: the runner's default."""
        if prompt is None:
            return None
        if isinstance(prompt, str):
            if not self.text_prompts:
                raise ValueError(f"prompt text needs a runner with a text encoder; "
                                 f"{type(self.runner).__name__} has none: give a "
                                 f"{list(self.prompt_shape)} tensor, got {prompt!r}")
            with self._text_lock:  # the encoder's prompt cache is not thread safe
                prompt = self.runner.encode_prompt(check_text("prompt", prompt))  # [1, L, D]
        return check_prompt("prompt", prompt, self.prompt_shape).detach().to("cpu")

    def open_session(self, *, seed: int, prompt: torch.Tensor | str | None = None,
                     chunks: int | None = None, paused: bool = False,
                     video: float | None = None) -> Stream:
        """A new stream at position 0 (``prompt``: `prompt_shape` or text, default the
        runner's; ``chunks``: a budget, None for open-ended; ``paused``: no chunk until
        `pause` (..., False); ``video``: None for a text stream, else a video stream's
        strength, the scheduler's ``video_strength``: its frames come by `feed`). It
        takes a slot at its first step. Raises `SchedulerFull`
        when ``max_sessions`` are open, ValueError for a bad argument, `LoopStopped`
        once the GPU loop has ended by an exception."""
        self._check_running()
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise ValueError(f"seed must be an integer in [0, 2**31), got {seed!r}")
        if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int)
                                   or chunks < 1):
            raise ValueError(f"chunks must be None or an integer >= 1, got {chunks!r}")
        intake = self._video_record(video)
        prompt = self._prompt(prompt)
        with self.lock:
            if len(self.sessions) >= self.max_sessions:
                raise SchedulerFull(f"all {self.max_sessions} sessions are open")
            steps = self._counts["steps"]
            s = Stream(secrets.token_urlsafe(18), seed, chunks, prompt=prompt,
                       paused=bool(paused), last_stepped=steps, slot_since=steps,
                       intake=intake)
            self.sessions[s.id] = s
            self._mark_waiting(s)
            self.ready.notify_all()
            return s

    def close_session(self, session_id: str, reason: str = "closed") -> None:
        """End a stream ("closed" unless done or failed): its chunks dropped, its slot
        freed (its next user starts it over), its info to `ended` with ``end_reason`` =
        ``reason``, its checkpoint removed. KeyError for an id that is not open, so of
        two racing closes exactly one succeeds. Host work only."""
        with self.lock:
            s = self.sessions.pop(session_id)
            if s.slot is not None:
                self.pool.give(s.slot)
            if s.state == Phase.ACTIVE:
                s.state = Phase.CLOSED
            s.end_reason, s.waiting_since, s.parked, s.decoder = reason, None, None, None
            s.encoder = None
            s.delivery.clear()
            for c in s.pending:
                c.settle(error=KeyError(session_id))
            self.ended.add(s.info())
            if s.intake is not None:
                s.intake.frames.clear()
            self.ready.notify_all()
        if self.checkpoints is not None:
            self.checkpoints.drop(session_id)

    def session_info(self, session_id: str) -> dict | None:
        """`Stream.info` of an open stream, else the one `ended` keeps, else None."""
        with self.lock:
            s = self.sessions.get(session_id)
            return s.info() if s is not None else self.ended.get(session_id)

    def set_prompt(self, session_id: str, prompt: torch.Tensor | str) -> PromptChange:
        """A new prompt for a stream from its next chunk on (a tensor, or text). Its
        history is re-cached under it before that chunk, at the next step boundary (a
        stream off the pool: as it takes a slot; one not started: at once); the video
        goes on. Returns the `PromptChange` (``result()`` waits for the re-cache and
        raises what it raised: the stream then stays under its old prompt). KeyError for
        an id not open; ValueError for a bad prompt, `PromptTooLate` for a stream done."""
        if session_id not in self.sessions:
            raise KeyError(session_id)
        prompt = self._prompt(prompt)
        with self.lock:
            s = self.sessions[session_id]
            if (late := s.late_prompt()) is not None:
                raise late
            version = max([s.prompt_version] + [c.version for c in s.pending]) + 1
            change = PromptChange(version, s.chunks)
            if not s.started:                # nothing to re-cache: it starts under it
                s.prompt, s.prompt_version = prompt, version
                change.settle(s.chunks)
            else:
                s.pending.append(change)
                s.pending_prompt = prompt
            self.ready.notify_all()
            return change

    def pause(self, session_id: str, paused: bool = True) -> None:
        """Stop (or, ``paused=False``, restart) stepping a stream, from the next step on
        (a step under way finishes its chunk)."""
        with self.lock:
            s = self.sessions[session_id]
            s.paused = paused
            self._mark_waiting(s)
            self.ready.notify_all()

    def hold(self, held: bool = True) -> None:
        """Step no stream (or, ``held=False``, step them again), their own pause
        untouched: a server's drain, before `save_sessions`. Returns once a step under
        way has ended."""
        with self.lock:
            self._held = bool(held)
            self.ready.notify_all()
        with self._gpu:
            self._flush()

    # ------------------------------------------------------------------ steps
    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict:
        """A snapshot for a server's metrics (host work only): streams open and allowed,
        slots, streams on (``sessions_resident``) and off the pool (``sessions_swapped``),
        the host bytes those hold (``swapped_bytes``), swaps, their bytes and failures,
        rotations, steps (``rows``, ``scratch_rows``, ``batch_sizes``), chunks, failed
        steps, video frames, streams ended by reason (``ended``), histograms of step and
        swap seconds and chunk latency, input frames in and dropped (``frames_in``,
        ``frames_dropped``) and a histogram of input latency (``input_seconds``: a
        chunk's newest input frame in to the chunk handed out), the device and `ChunkRunner.stats`; on CUDA
        torch's allocated bytes as of the last step (``gpu_allocated_bytes``)."""
        with self.lock:
            streams = list(self.sessions.values())
            resident = sum(s.slot is not None for s in streams)
            return {"sessions": len(streams), "max_sessions": self.max_sessions,
                    "slots": self.slots, "sessions_resident": resident,
                    "sessions_swapped": len(streams) - resident,
                    "swapped_bytes": sum(s.held_bytes for s in streams), **self.pool.counts,
                    "device": str(self.runner.device), "decoding": self.decoding,
                    "ended": dict(self.ended.by_reason), **self._counts, **self._device,
                    "batch_sizes": dict(sorted(self._batch_sizes.items())),
                    "step_seconds": self._step_seconds.snapshot(),
                    "chunk_seconds": self._chunk_seconds.snapshot(),
                    "swap_seconds": self.pool.seconds.snapshot(),
                    "input_seconds": self._input_seconds.snapshot(), **self.runner.stats()}

    def close(self) -> None:
        """Free the pool, the graphs and the decoder; flush the checkpoints."""
        if self.checkpoints is not None:
            self.checkpoints.flush()
        with self._gpu:
            self._flush()
            self.runner.close()
            if self.decode_stage is not None:
                self.decode_stage.close()
            if getattr(self, "encode_stage", None) is not None:
                self.encode_stage.close()
