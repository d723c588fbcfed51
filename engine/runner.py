"""`ChunkRunner`: the one chunk cycle of an autoregressive video model over a K/V store.

A chunk of B sequences, from noise x [B, C, F, H, W] at rope frames frame0 [B], is one
callable over static inputs, so on a GPU it is ONE graph replay::

    x = sampler.start(noise, inputs)
    for i, t_i in enumerate(sampler.timesteps):      # the chunk is one causal block
        v = model.forward(x, t_i, ctx(T, T))         # guidance: both branches, one batch
        x = sampler.update(x, v, i)
        x = sampler.renoise(x, i, inputs)            # between calls (not after the last)
    model.forward(x, 0, ctx(T, clean, output=False))  # the clean pass, kept for its K/V
    kv.commit(T)                                     # the chunk becomes history

The sampler is the registry's (`framekv.engine.samplers`: its name and options, over
the runner's ``timesteps``); its static inputs beyond noise and frame0 (``inputs``,
e.g. the self_forcing sampler's fresh noise) are each row's own, drawn from the row's
(seed, chunk index), so a stream replays wherever it runs. The runner knows no
sampler by name.

The clean pass is one block of the chunk (``clean_block="chunk"``) or one-frame
blocks; with ``trim_clean_pass`` (default) its last layer stops once its K/V are staged
(nothing reads its output). Models plug in through `ChunkModel` and reach the store
only through the `ForwardContext` each forward gets; they know nothing of graphs.

Graphs: `capture_requests` lists one whole-chunk graph per chunk length and batch
size, keyed by `framekv.graphs.GraphKey`; `capture` runs them through the warm-up path
(`framekv.graphs.run_warmup`, as ``framekv warmup`` does), then resets. `step` and
`step_rows` replay them (a chunk runs eagerly on CPU, before a capture, or while the
store cannot replay); after a replay the runner advances the store's host half itself
(`KVStore.after_replay`: the replay ran no Python), so a replayed chunk's data flows one
way, the graph never calling back into the store.

Sequences: the pool holds ``sequences`` of them (one by default), twice as many with
guidance (sequence s and its unconditional branch S + s, rows of one batch: v = v_u +
g (v_c - v_u)). `step` runs all of them, positions kept here; `step_rows` any B (one of
``batch_sizes``), positions kept by the caller (a scheduler), which hands a whole
step over as a `framekv.engine.step.StepPlan` (`execute`: swaps, prompt rewrites, the
chunk). Each pool sequence has a
prompt: the first one written after a reset starts it (`ChunkModel.write_prompt`), a
later one changes it; a model whose finished frames' K/V depend on the prompt
(``keeps_history``) has the clean latents of its visible frames kept, so that a
change can re-cache them (clean passes over them under the new prompt). A prompt write
is all or nothing: if it fails part way, every sequence it reached is put back (a
sequence it started starts over without a prompt, a rewritten one has its old prompt
back, a re-cached one is re-cached under it). A sequence reset leaves nothing of its
past to read, in the store or the model.

Streams leave and come back (`snapshot`, `restore`; `framekv.engine.stream_state`):
sequence s between chunks, its pool rows' K/V, prompts, history, position and noise
stream, as a `StreamState` a runner of the same model and pool shape takes into any
sequence, all or nothing.

Inputs are checked before anything runs: NaN or inf in a prompt or in noise is a
ValueError naming it, as are noise of another chunk shape, a frame0 that is not
integers >= 0 and rows that are not distinct host ints.

One file: the chunk cycle is one object (prompts, sequences, chunks, capture, steps)
that both rollouts adapt; its argument checks, the history and the stores live in the
modules beside it.
"""
from __future__ import annotations

import time
from typing import Protocol

import torch

from framekv.graphs import CaptureRequest, GraphCache, WarmupReport, chunk_key, owner_token, run_warmup
from framekv.specs.checks import (check_batch_sizes, check_choice, check_count, check_finite,
                                  check_flag, check_frames, check_guidance, check_prompt,
                                  check_shape)

from .cache.sequences import check_rows
from .history import History, pieces
from .kv import ForwardContext, KVStore, Recorder
from .samplers import DEFAULT_SAMPLER, build_sampler, sampler_description, sampler_label
from .step import StepPlan, StepResult, chunk_noise, sampler_inputs
from .stream_state import StreamState

CLEAN_BLOCKS = ("chunk", "frame")


class ChunkModel(Protocol):
    """What a model gives the runner (`framekv.engine.model.DiTChunks`,
    `framekv.engine.wan.WanChunks`)."""

    device: torch.device
    dtype: torch.dtype
    tokens_per_frame: int
    latent_shape: tuple[int, int, int]        # (C, H, W) of one latent frame
    prompt_shape: tuple[int, int] | None      # (L, text_dim) of one prompt (None: L unknown)
    text_dim: int                             # a prompt token's width
    keeps_history: bool                       # finished frames' K/V depend on the prompt
    prompt_in_store: bool                     # its K/V are the store's (a snapshot's); default False
    timestep_scale: float                     # the model timestep at sigma = 1
    attention: torch.nn.Module                # a layer's CachedAttention (every layer plans alike)

    def forward(self, x: torch.Tensor, t: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor | None:
        """Velocity [B, C, F, H, W] of latents x [B, C, F, H, W] (model dtype) at model
        timestep t (fp32 [1]); None when ``ctx.output`` is False."""

    def write_prompt(self, kv: KVStore, rows: tuple[int, ...], prompt: torch.Tensor, *,
                     rewrite: bool = False, recorder: Recorder | None = None) -> None:
        """``prompt`` [L, text_dim] for pool sequences ``rows`` (in use on ``kv``):
        starting them (at position 0), or ``rewrite`` for sequences under way. A rewrite
        is all or nothing: if it fails, the old prompt's K/V are back, store and model
        alike. A start that fails may leave part of it (the runner resets the rows)."""

    def clear_prompt(self, rows: tuple[int, ...]) -> None:
        """Forget the prompt of pool sequences ``rows`` (host ints) where the model
        keeps it: nothing of it is left for a later forward to read (the store's K/V
        of them are reset by the runner)."""

    def default_prompt(self) -> torch.Tensor:
        """The prompt a sequence gets when none is given: [L, text_dim]."""

    def q_bounds(self) -> list[float] | None:
        """A bound on |q| per layer where the fused QK prologue produces q (an fp8 pool
        then has Q quantized in that pass, `CudnnBackend.set_q_bounds`), else None."""


def _why(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class ChunkRunner:
    """The chunk cycle of one model over one K/V store (module doc).

    Args:
        model: the `ChunkModel`.
        kv: the `KVStore` (its geometry the runner's).
        frames_per_chunk: latent frames of a chunk.
        timesteps: the model timesteps of the denoising steps, decreasing in
            (0, timestep_scale]: the schedule the sampler is built over.
        sampler: a registered sampler's name (`framekv.engine.samplers.samplers`),
            default euler; sampler_options: its options (a mapping, default none).
        clean_block: "chunk" or "frame".
        sink_frames: frames pinned at the start of each sequence (the history's sink).
        use_graphs: replay whole-chunk graphs (eager calls on CPU); debug: the graph
            cache's address checks at every replay.
        sequences: None (one) or N >= 1 sequences stepped together by `step`.
        batch_sizes: the batch sizes `step_rows` may run (each in [1, N], default (N,)).
        guidance_scale: None, or g: classifier-free guidance (module doc).
        trim_clean_pass: the clean pass stops once its last layer's K/V are staged.
        seed: the noise seed of `step` (sequence s draws ``chunk_noise(seed, i, shape, s)``).
        last_chunk: None, or (index, frames): chunk ``index`` of each sequence is
            shorter (the others full).
    """

    def __init__(self, model: ChunkModel, kv: KVStore, *, frames_per_chunk: int, timesteps,
                 sampler: str = DEFAULT_SAMPLER, clean_block: str = "chunk",
                 sink_frames: int = 0, use_graphs: bool = True, debug: bool = False,
                 sequences: int | None = None, batch_sizes=None,
                 guidance_scale: float | None = None, trim_clean_pass: bool = True,
                 seed: int = 0, last_chunk=None, sampler_options=None):
        self.chunk_model, self.kv, self.geometry = model, kv, kv.geometry
        self.device, self.dtype = model.device, model.dtype
        #: the sampler's name and the `Sampler` it built over ``timesteps``
        self.sampling = build_sampler(sampler, timesteps, model.timestep_scale, sampler_options)
        self.sampler: str = sampler
        self.clean_block = check_choice("clean_block", clean_block, CLEAN_BLOCKS)
        self.trim_clean_pass = check_flag("trim_clean_pass", trim_clean_pass)
        self.guidance = check_guidance(guidance_scale)
        self.sequences = check_count("sequences", sequences) or 1
        self.pool = self.sequences * (1 if self.guidance is None else 2)
        self.batch_sizes = check_batch_sizes(batch_sizes, self.sequences)
        self.frames_per_chunk, self.sink_frames, self.last_chunk = frames_per_chunk, sink_frames, last_chunk
        self.tokens_per_frame = model.tokens_per_frame
        self.sigmas = list(self.sampling.sigmas)           # of the steps a chunk runs, then 0
        self._t = [torch.full((1,), t, device=self.device) for t in self.sampling.timesteps]
        self._check_sampler_inputs()
        self._t0 = torch.zeros(1, device=self.device)
        if use_graphs and not kv.graph_safe:
            raise ValueError(f"kv={type(kv).__name__} cannot be captured in graphs: "
                             "pass use_graphs=False")
        self.use_graphs, self.seed = use_graphs, seed
        self.graphs = GraphCache(self.device, debug=debug)
        self._keys: dict[tuple[int, int], object] = {}  # (tokens, batch) -> GraphKey
        self.history = History(self.pool, sink_frames, kv.geometry.window_tokens
                               // self.tokens_per_frame) if model.keeps_history else None
        self._prompts: list[torch.Tensor | None] = [None] * self.pool  # written since reset
        self._in_use: tuple[int, ...] = tuple(range(self.pool))          # the store's rows
        self.sequence_chunks, self.sequence_frames = [0] * self.sequences, [0] * self.sequences
        self._noise: dict[int, tuple[int, int]] = {}   # restored streams' noise
        #: None, or recorder(label, velocity) after every forward of an eager chunk
        #: ("step 0", ..., "clean"; a clean pass kept for its K/V passes None)
        self.recorder = None
        #: None, or a `Recorder` after every attention of eager forwards and prompts
        self.attention_recorder: Recorder | None = None
        #: chunks run per path ("graphs", "eager"); ``path``: the last chunk's
        self.paths, self.path = {"eager": 0, "graphs": 0}, None
        self.closed = False
        self._declare_q_bounds()

    def _declare_q_bounds(self) -> None:
        """An fp8 pool on a backend that takes Q from the staging pass: every layer's
        bound on |q| (`ChunkModel.q_bounds`), so Q is quantized as it is staged."""
        cache = getattr(self.kv, "cache", None)
        declare = getattr(self.chunk_model.attention.backend, "set_q_bounds", None)
        if declare is None or cache is None or cache.dtype != torch.float8_e4m3fn:
            return
        bounds = self.chunk_model.q_bounds()
        if bounds is not None:
            declare(cache, bounds)

    # ------------------------------------------------------------------ shapes
    def chunk_frames(self, index: int) -> int:
        """Frames of chunk ``index`` of a sequence (the open-ended rollout goes on with
        full chunks past a short one)."""
        last = self.last_chunk
        return last[1] if last is not None and index == last[0] else self.frames_per_chunk

    @property
    def chunk_shape(self) -> tuple[int, int, int, int]:
        """(C, F, H, W) of one sequence's full chunk of latents."""
        C, H, W = self.chunk_model.latent_shape
        return (C, self.frames_per_chunk, H, W)

    @property
    def prompt_shape(self) -> tuple[int, int] | None:
        """(L, text_dim) of a prompt."""
        return self.chunk_model.prompt_shape

    @property
    def cache(self):
        """The store's paged `CausalKVCache`, or None for a store without one."""
        return getattr(self.kv, "cache", None)

    @property
    def chunk_index(self) -> int:
        """Chunks generated by sequence 0 since its start."""
        return self.sequence_chunks[0]

    @property
    def frames_done(self) -> int:
        """Frames generated by sequence 0 since its start."""
        return self.sequence_frames[0]

    def default_prompt(self) -> torch.Tensor:
        """The prompt a sequence gets when none is given ([L, text_dim])."""
        return self.chunk_model.default_prompt()

    # ------------------------------------------------------------------ prompts
    #: what `set_prompt`'s errors call its two arguments
    _prompt_names = ("prompt", "negative")

    @torch.no_grad()
    def set_prompt(self, prompt: torch.Tensor, negative: torch.Tensor | None = None, *,
                   recache: bool = False) -> None:
        """The prompt of every sequence from the next chunk on: ``prompt`` [L, text_dim]
        (or [1, L, text_dim]); ``negative``: the unconditional branch's (guidance only;
        default zeros). A sequence under way keeps its history's K/V unless
        ``recache`` (a model with ``keeps_history``: recomputed under the new prompt).
        All or nothing (`_write_prompts`); NaN or inf in a prompt is a ValueError."""
        self._check_open()
        name, neg_name = self._prompt_names
        prompt = self._check_prompt(name, prompt)
        check_flag("recache", recache)
        S = self.sequences
        writes = [(range(S), prompt)]
        if self.guidance is None:
            if negative is not None:
                raise ValueError(f"{neg_name} needs guidance_scale (classifier-free "
                                 "guidance); this runner has none")
        else:
            negative = (torch.zeros_like(prompt) if negative is None
                        else self._check_prompt(neg_name, negative))
            if negative.shape != prompt.shape:
                raise ValueError(f"{neg_name} must have the shape of {name} "
                                 f"{list(prompt.shape)}, got {list(negative.shape)}")
            writes.insert(0, (range(S, 2 * S), negative))
        self._write_prompts(writes, recache=recache)

    @torch.no_grad()
    def prefill_rows(self, rows, prompt: torch.Tensor | None = None, *,
                     rewrite: bool = False) -> None:
        """The prompt of pool sequences ``rows`` (host ints): ``prompt`` [L, text_dim],
        default `default_prompt`. Without ``rewrite`` they start over at position 0
        (the others keep theirs); with it the prompt changes under way (their history
        re-cached where the model keeps one), all or nothing (`_write_prompts`). NaN or
        inf in the prompt is a ValueError."""
        self._check_open()
        prompt = self._check_prompt("prompt", self.default_prompt() if prompt is None else prompt)
        rows = check_rows(rows, self.pool, name="rows")
        check_flag("rewrite", rewrite)
        if not rewrite:
            self._reset_rows(rows)
        self._write_prompts([(rows, prompt)], recache=rewrite)

    def _write_prompts(self, writes, *, recache: bool) -> None:
        """Each (rows, prompt) of ``writes``: a sequence without a prompt starts with it,
        one with a prompt has it rewritten (and, with ``recache``, its history
        re-cached). All or nothing: if any part fails, every sequence of ``writes`` is
        put back as it was (`_put_back`) and the error raised again."""
        before, recached = list(self._prompts), []
        try:
            for rows, prompt in writes:
                self._write_prompt(rows, prompt, recache=recache, recached=recached)
        except BaseException:
            self._put_back(before, [r for rows, _ in writes for r in rows], recached)
            raise

    def _write_prompt(self, rows, prompt: torch.Tensor, *, recache: bool, recached: list) -> None:
        fresh = [r for r in rows if self._prompts[r] is None]
        going = [r for r in rows if self._prompts[r] is not None]
        for group, rewrite in ((fresh, False), (going, True)):
            if not group:
                continue
            self._use(group)
            self.chunk_model.write_prompt(self.kv, tuple(group), prompt, rewrite=rewrite,
                                          recorder=self.attention_recorder)
            for r in group:
                self._prompts[r] = prompt
        if recache and self.history is not None:
            for r in going:
                recached.append(r)
                self._recache(r)

    def _put_back(self, before: list, rows, recached: list) -> None:
        """After a failed prompt write: pool sequences ``rows`` back to their prompts
        ``before``. One that had none starts over (position 0, no prompt); one whose
        prompt was rewritten gets its old one written back (a rewrite that failed put
        itself back), and one whose re-cache ran is re-cached under its old prompt. If
        that fails too, those sequences start over without a prompt (a step refuses
        them until they get one)."""
        fresh = [r for r in rows if before[r] is None]
        moved = [r for r in rows if before[r] is not None and self._prompts[r] is not before[r]]
        if fresh:
            self._reset_rows(fresh)
        again = list(dict.fromkeys(r for r in recached if before[r] is not None))
        try:
            for r in moved:
                self._prompts[r] = before[r]
            for prompt in {id(before[r]): before[r] for r in moved if r not in again}.values():
                group = [r for r in moved if before[r] is prompt and r not in again]
                self._use(group)
                self.chunk_model.write_prompt(self.kv, tuple(group), prompt, rewrite=True)
            for r in again:
                self._recache(r)
        except Exception:
            self._reset_rows(list(dict.fromkeys(moved + again)))

    def _check_prompt(self, name: str, x) -> torch.Tensor:
        """``x`` as [L, text_dim] of the model's prompt shape (`check_prompt`)."""
        want = self.prompt_shape
        return check_prompt(name, x, (None if want is None else want[0],
                                      self.chunk_model.text_dim))

    def _require_prompt(self, rows) -> None:
        missing = [r for r in rows if self._prompts[r] is None]
        if missing:
            raise ValueError(f"no prompt: call set_prompt(prompt) (Rollout: prefill()) before "
                             f"a step; sequences without one: {missing}")

    # ------------------------------------------------------------------ history
    def recache(self, rows) -> None:
        """Recompute the K/V of the visible history of pool sequences ``rows`` (host
        ints) under their current prompts (a model that ``keeps_history``)."""
        self._check_open()
        if self.history is None:
            raise ValueError(f"{type(self).__name__}'s model keeps no history to re-cache: "
                             "its finished frames' K/V do not depend on the prompt")
        for r in check_rows(rows, self.pool, name="rows"):
            self._require_prompt((r,))
            self._recache(r)

    def _recache(self, seq: int) -> None:
        """Sequence ``seq`` again at position 0 under its prompt, then clean passes over
        its visible frames at their own rope frames, in runs cut at the sink and the
        chunk grid (a whole chunk in the clean block, a shorter run in one-frame
        blocks): it holds exactly the visible frames again, with K/V of its prompt."""
        visible = dict(self.history.visible(seq))
        self.kv.reset_sequences([seq])
        self._use([seq])
        self.chunk_model.write_prompt(self.kv, (seq,), self._prompts[seq], rewrite=False)
        for run in pieces(sorted(visible), self.sink_frames, self.frames_per_chunk):
            x = torch.cat([visible[f] for f in run], dim=1)[None].to(self.device)  # [1, C, F', H, W]
            self._clean_pass(x, torch.tensor([run[0]], dtype=torch.int64, device=self.device))

    # ------------------------------------------------------------------ one chunk
    def _forward(self, x: torch.Tensor, t: torch.Tensor, frame0: torch.Tensor, block: int, *,
                 output: bool = True) -> torch.Tensor | None:
        """One model forward over pool rows x [R, C, F, H, W] (fp32) at frame0 [R]."""
        ctx = ForwardContext(self.kv, seq_len=x.shape[2] * self.tokens_per_frame,
                             block_size=block, frame0=frame0, output=output,
                             rows=self._prompt_rows(), recorder=self.attention_recorder)
        v = self.chunk_model.forward(x.to(self.dtype), t, ctx)
        return None if v is None else v.float()

    def _velocity(self, x: torch.Tensor, i: int, frame0: torch.Tensor) -> torch.Tensor:
        """v(x, t_i) of B sequences (frame0: of every pool row); with guidance both
        branches as 2B rows, combined."""
        T = x.shape[2] * self.tokens_per_frame
        if self.guidance is None:
            v = self._forward(x, self._t[i], frame0, T)
        else:
            B = x.shape[0]
            both = self._forward(torch.cat([x, x]), self._t[i], frame0, T)
            v = both[B:] + self.guidance * (both[:B] - both[B:])
        if self.recorder is not None:
            self.recorder(f"step {i}", v)
        return v

    def _clean_pass(self, x: torch.Tensor, frame0: torch.Tensor) -> None:
        """The forward at timestep 0 over clean latents x [R, C, F', H, W] (pool rows) and
        the commit of its K/V: one block for a whole chunk with ``clean_block="chunk"``,
        one-frame blocks otherwise."""
        tpf, frames = self.tokens_per_frame, x.shape[2]
        whole = self.clean_block == "chunk" and frames == self.frames_per_chunk
        v = self._forward(x, self._t0, frame0, frames * tpf if whole else tpf,
                          output=not self.trim_clean_pass)
        if self.recorder is not None:
            self.recorder("clean", v)
        self.kv.commit(frames * tpf)

    def chunk(self, noise: torch.Tensor, frame0: torch.Tensor, **inputs) -> torch.Tensor:
        """One whole chunk over static inputs, of the pool rows in use: the sampler's
        steps, the clean pass, the commit. noise fp32 [B, C, F, H, W] (B: the sequences
        in use, per branch); frame0 int64 [B]; ``inputs``: the sampler's static inputs,
        fp32 [B, *shape] each (`Sampler.input_shapes`) -> clean latents fp32
        [B, C, F, H, W]. Shapes and dtypes are checked (host metadata only: a capture
        runs it)."""
        B = len(self._in_use) // (1 if self.guidance is None else 2)
        self._check_noise(noise, B)
        inputs = self._check_inputs(inputs, noise.shape)
        if (not isinstance(frame0, torch.Tensor) or frame0.dtype != torch.int64
                or tuple(frame0.shape) != (B,)):
            got = (f"{frame0.dtype} {list(frame0.shape)}" if isinstance(frame0, torch.Tensor)
                   else type(frame0).__name__)
            raise ValueError(f"frame0 must be an int64 [{B}] tensor (each row's first rope "
                             f"frame), got {got}")
        sampler, x = self.sampling, self.sampling.start(noise, inputs)    # [B, C, F, H, W]
        both = self.guidance is not None
        frame0 = torch.cat([frame0, frame0]) if both else frame0           # [R] pool rows
        for i in range(len(self._t)):
            x = sampler.update(x, self._velocity(x, i, frame0), i)
            if i + 1 < len(self._t):
                x = sampler.renoise(x, i, inputs)
        self._clean_pass(torch.cat([x, x]) if both else x, frame0)
        return x

    def _use(self, rows) -> None:
        """Put pool sequences ``rows`` in use on the store for the next forwards."""
        self.kv.use_sequences(rows)
        self._in_use = tuple(rows)

    def _prompt_rows(self) -> torch.Tensor | None:
        """What a forward passes as ``ForwardContext.rows``: the store's ids, or None
        where the rows in use are 0 .. R-1, always, for every chunk (one sequence and its
        branch): a slice of the prompt buffers, no gather. A chunk graph bakes this in,
        so it is decided by the runner's shape and the rows in use alone."""
        identity = self._in_use == tuple(range(len(self._in_use)))
        return None if self.sequences == 1 and identity else self.kv.ids

    def _pool_rows(self, rows) -> tuple[int, ...]:
        """The pool sequences of sequences ``rows``: themselves, then with guidance their
        unconditional branches."""
        rows = tuple(rows)
        return rows if self.guidance is None else rows + tuple(r + self.sequences for r in rows)

    # ------------------------------------------------------------------ capture
    def capture_request(self, tokens: int, batch: int | None = None) -> CaptureRequest:
        """What to capture for chunks of ``tokens`` real tokens over ``batch`` sequences
        (one of ``batch_sizes``; default all): the whole chunk over the first ``batch``
        as one graph (no replay hook: `step_rows` advances the store's host half after
        each replay)."""
        batch = self.sequences if batch is None else batch
        if batch not in self.batch_sizes and batch != self.sequences:
            raise ValueError(f"batch must be one of the batch sizes {self.batch_sizes}, "
                             f"got {batch!r}")
        counts = self._chunk_tokens()
        if tokens not in counts:
            raise ValueError(f"tokens must be one of the chunk lengths {counts}, got {tokens}")
        C, H, W = self.chunk_model.latent_shape
        F = tokens // self.tokens_per_frame
        inputs = {"noise": torch.zeros(batch, C, F, H, W, device=self.device),
                  "frame0": torch.zeros(batch, dtype=torch.int64, device=self.device)}
        for name, shape in self.sampling.input_shapes((C, F, H, W)).items():
            inputs[name] = torch.zeros(batch, *shape, device=self.device)
        rows = self._pool_rows(range(batch))
        whole = self.clean_block == "chunk" and tokens == self.frames_per_chunk * self.tokens_per_frame
        clean = tokens if whole else self.tokens_per_frame
        blocks = (tokens,) * len(self._t) + (clean,)
        splits, packed = self.kv.key_layout(self.chunk_model.attention, tokens, blocks, len(rows))
        key = chunk_key(owner_token(self), self.geometry, tokens, denoise_steps=len(self._t),
                        clean_block=clean, inputs=inputs, splits=splits, batch=len(rows),
                        packed=packed, sampler=sampler_label(self.sampler, self.sampling))
        return CaptureRequest(key, self.chunk, inputs)

    def _chunk_tokens(self) -> tuple[int, ...]:
        frames = [self.frames_per_chunk] + ([self.last_chunk[1]] if self.last_chunk else [])
        return tuple(sorted({f * self.tokens_per_frame for f in frames}, reverse=True))

    def capture_requests(self) -> list[CaptureRequest]:
        """Every graph this runner replays: one whole chunk per chunk length and batch
        size (each captured with the first ``batch`` sequences in use)."""
        return [self.capture_request(t, b) for t, b in self._captured_shapes()]

    def _captured_shapes(self) -> list[tuple[int, int]]:
        sizes = sorted(set(self.batch_sizes) | {self.sequences})
        return [(t, b) for t in self._chunk_tokens() for b in sizes]

    def capture(self, *, progress: bool = False, stream=None) -> WarmupReport:
        """Capture every graph of `capture_requests` not captured yet (``progress``: a
        bar on ``stream``, default stderr), then `reset`; returns the warm-up report. Runs
        before the first chunk (capturing moves the store)."""
        self._check_open()
        if not self.use_graphs:
            raise ValueError("capture() needs use_graphs=True")
        if any(self.sequence_chunks) or self.paths["graphs"] + self.paths["eager"]:
            raise ValueError("capture() runs before the first chunk: it resets every sequence")
        keys = []

        def request(tokens: int, batch: int) -> CaptureRequest:
            # Built right before its capture, its sequences in use (the graph reads the
            # store's fixed ids buffer; a replay sets the rows it runs).
            self._use(self._pool_rows(range(batch)))
            keys.append(self.capture_request(tokens, batch))
            return keys[-1]

        try:
            with self.kv.capture_scope():
                report = run_warmup(self.graphs, self._captured_shapes(), request,
                                    progress=progress, stream=stream)
            self._keys.update(((r.key.tokens, r.key.batch), r.key) for r in keys)
        finally:
            self.reset()
        return report

    # ------------------------------------------------------------------ steps
    @torch.no_grad()
    def step(self, noise: torch.Tensor | None = None, inputs: dict | None = None) -> torch.Tensor:
        """The next chunk of every sequence; returns the clean latents, fp32
        [N, C, F, H, W] (a copy). ``noise``: the chunks' starting noise in that shape,
        default each sequence's own (`chunk_noise`); ``inputs``: the sampler's static
        inputs, name -> [N, *shape] (`Sampler.input_shapes`), default each sequence's
        own (`Sampler.row_inputs` of its seed and chunk index)."""
        self._check_open()
        S = self.sequences
        self._require_prompt(range(self.pool))
        frames = {self.chunk_frames(i) for i in self.sequence_chunks}
        if len(frames) > 1:
            raise ValueError(f"the sequences' next chunks differ in length ({sorted(frames)} "
                             f"frames at chunk indices {self.sequence_chunks}): a batched step "
                             "needs one chunk length")
        C, F, H, W = (self.chunk_shape[0], frames.pop(), *self.chunk_shape[2:])
        streams = list(zip(self.noise_streams, self.sequence_chunks))
        if noise is None:
            noise = torch.stack([chunk_noise(seed, i, (C, F, H, W), n) for (seed, n), i in streams])
        self._check_noise(noise, S, frames=F)
        check_finite("noise", noise)
        if inputs is None:
            inputs = sampler_inputs(self.sampling, [(seed, i) for (seed, _), i in streams],
                                    (C, F, H, W), sequences=[n for (_, n), _ in streams])
        inputs = self._check_inputs(inputs, noise.shape, finite=True)
        if self.use_graphs and not self._keys:
            self.capture()  # every sequence at 0, and back at 0 after
        out = self._run(tuple(range(S)), noise, self.sequence_frames, inputs)
        self.sequence_chunks = [i + 1 for i in self.sequence_chunks]
        self.sequence_frames = [f + F for f in self.sequence_frames]
        return out

    @torch.no_grad()
    def step_rows(self, rows, noise: torch.Tensor, frame0,
                  inputs: dict | None = None) -> torch.Tensor:
        """One chunk of sequences ``rows`` (distinct host ints in [0, sequences), as many
        as one of ``batch_sizes``): batch row r is sequence rows[r], from noise[r]
        [C, F, H, W] (F: a chunk's frames; finite values only) at rope frame frame0[r]
        (integers >= 0: host ints or an integer tensor); ``inputs``: the sampler's
        static inputs, name -> [B, *shape] with row r sequence rows[r]'s (none for a
        sampler without any; `framekv.engine.step.sampler_inputs`); returns the clean
        latents [B, C, F, H, W] (a copy). One graph replay (captured for that batch
        size); the caller keeps the positions. Every argument is checked before
        anything runs."""
        self._check_open()
        if not isinstance(rows, (list, tuple, range)) or len(rows) not in self.batch_sizes:
            got = len(rows) if isinstance(rows, (list, tuple, range)) else repr(rows)
            raise ValueError(f"rows must name as many sequences as one of the batch sizes "
                             f"{self.batch_sizes}, got {got}")
        rows = check_rows(rows, self.sequences, name="rows")
        self._check_noise(noise, len(rows))
        check_finite("noise", noise)
        inputs = self._check_inputs(inputs, noise.shape, finite=True)
        frames = check_frames("frame0", frame0, len(rows))  # read once, host ints
        self._require_prompt(self._pool_rows(rows))
        return self._run(rows, noise, frames, inputs)

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step's GPU work (`framekv.engine.step`): the plan's swaps out, then
        in, its prompt rewrites and restarts, then (when it has rows) one chunk of its
        rows. A failed swap fails its stream alone: its slot is started over under the
        default prompt and its row still runs (its chunk is the caller's to drop); a
        failed rewrite leaves its stream under the old prompt. A failing chunk (or
        restart) is the result's ``error``. The latents stay on the device (the result
        stage reads them)."""
        self._check_open()
        res = StepResult()
        for sw in plan.swap_outs:
            t0 = time.perf_counter()
            try:
                # Its copy runs on a side stream; whatever writes the slot next (the swap
                # in) waits for it on the device (the cache's fence), the host does not.
                res.parked[sw.stream] = self.snapshot(sw.slot)
            except Exception as exc:
                res.failed[sw.stream] = f"swapping the session out failed: {_why(exc)}"
            res.swap_seconds[sw.stream] = time.perf_counter() - t0
        for sw in plan.swap_ins:
            t0 = time.perf_counter()
            self._swap_in(sw, res)
            res.swap_seconds[sw.stream] = time.perf_counter() - t0
        for sw in plan.rewrites:
            try:
                self.prefill_rows([sw.slot], sw.prompt, rewrite=True)
            except Exception as exc:        # all or nothing: the old prompt is back
                res.rewrite_errors[sw.stream] = exc
        try:
            if plan.restarts:
                self.prefill_rows(plan.restarts)
            if plan.rows:
                res.latents = self.step_rows(plan.rows, plan.noise, plan.frame0, plan.inputs)
        except Exception as exc:            # the swaps above stand: the caller keeps them
            res.error = exc
        return res

    def _swap_in(self, sw, res: StepResult) -> None:
        """One swap in of `execute`: restored or started, then its pending rewrite."""
        try:
            if sw.state is None:
                self.prefill_rows([sw.slot], sw.prompt)
                return
            self.restore(sw.slot, sw.state)
        except Exception as exc:
            res.failed[sw.stream] = f"swapping the session in failed: {_why(exc)}"
            self.prefill_rows([sw.slot])    # a row the batch can run; its chunk is dropped
            return
        if sw.prompt is not None:
            try:
                self.prefill_rows([sw.slot], sw.prompt, rewrite=True)
            except Exception as exc:
                res.rewrite_errors[sw.stream] = exc

    def _check_noise(self, noise, batch: int, frames: int | None = None) -> None:
        """ValueError naming ``noise`` (the shape wanted and the one given) unless it is
        a floating [batch, C, F, H, W] tensor of the chunk shape, F ``frames`` or (None)
        the frames of a full chunk or of the short last one."""
        C, F, H, W = self.chunk_shape
        lengths = [t // self.tokens_per_frame for t in self._chunk_tokens()]
        if frames is not None:
            F = frames
        elif isinstance(noise, torch.Tensor) and noise.dim() == 5 and noise.shape[2] in lengths:
            F = noise.shape[2]
        check_shape("noise", noise, (batch, C, F, H, W))
        if not noise.is_floating_point():
            raise ValueError(f"noise must be a floating-point tensor, got {noise.dtype}")

    def _check_sampler_inputs(self) -> None:
        """ValueError for a sampler whose static inputs take the names of the chunk's
        own (noise, frame0)."""
        names = set(self.sampling.input_shapes(self.chunk_shape))
        if names & {"noise", "frame0"}:
            raise ValueError(f"the {self.sampler} sampler's static inputs must not be named "
                             f"noise or frame0 (the chunk's own), got {sorted(names)}")

    def _check_inputs(self, inputs, shape, *, finite: bool = False) -> dict:
        """``inputs`` (None: none) as a dict, after a ValueError naming what is wrong
        unless it holds exactly the sampler's static inputs, each a floating
        [B, *row shape] tensor (`Sampler.input_shapes` of ``shape``, the noise's
        [B, C, F, H, W]) and, with ``finite``, of finite values only."""
        want = self.sampling.input_shapes(tuple(shape[1:]))
        inputs = {} if inputs is None else inputs
        if not isinstance(inputs, dict) or set(inputs) != set(want):
            got = sorted(inputs) if isinstance(inputs, dict) else type(inputs).__name__
            raise ValueError(f"inputs must hold the {self.sampler} sampler's static inputs "
                             f"{sorted(want)} (each row's own: Sampler.row_inputs), got {got}")
        for name, row in want.items():
            x = inputs[name]
            check_shape(f"inputs[{name!r}]", x, (shape[0], *row))
            if not x.is_floating_point():
                raise ValueError(f"inputs[{name!r}] must be a floating-point tensor, got {x.dtype}")
            if finite:
                check_finite(f"inputs[{name!r}]", x)
        return dict(inputs)

    def _run(self, rows: tuple[int, ...], noise: torch.Tensor, frames: list[int],
             extra: dict) -> torch.Tensor:
        pool = self._pool_rows(rows)
        self._use(pool)
        inputs = {"noise": noise.to(self.device, torch.float32),
                  "frame0": torch.tensor(frames, dtype=torch.int64, device=self.device)}
        inputs.update((k, x.to(self.device, torch.float32)) for k, x in extra.items())
        tokens = noise.shape[2] * self.tokens_per_frame
        key = self._keys.get((tokens, len(pool)))
        if self.use_graphs and key is not None and self.kv.replayable:
            # Replay only: a capture here would run warm-up calls on the live store.
            out = self.graphs.replay(key, inputs)
            if not self.graphs.eager:           # a replay ran no Python: the host half
                self.kv.after_replay(tokens)
            out, self.path = out.clone(), "graphs"
        else:
            out, self.path = self.chunk(**inputs).clone(), "eager"
        self.paths[self.path] += 1
        if self.history is not None:
            for r, seq in enumerate(pool):
                self.history.add(seq, frames[r % len(rows)], out[r % len(rows)])
        return out

    # ------------------------------------------------------------------ streams
    @property
    def noise_streams(self) -> list[tuple[int, int]]:
        """(seed, sequence) of each sequence's chunk noise in `step` (`chunk_noise`):
        (``seed``, s), or a restored stream's own."""
        return [self._noise.get(s, (self.seed, s)) for s in range(self.sequences)]

    def describe(self) -> dict:
        """What a `StreamState` must match to be restored here (JSON-able): the model
        type and shapes, the chunk cycle (the sigmas of the steps a chunk runs, the
        sampler with its options) and the pool's geometry, K/V shape and dtype."""
        cache = self._paged_cache()
        m = self.chunk_model
        return {"model": type(m).__name__, "latent_shape": list(m.latent_shape),
                "prompt_shape": None if m.prompt_shape is None else list(m.prompt_shape),
                "frames_per_chunk": self.frames_per_chunk, "sigmas": list(self.sigmas),
                "sampler": sampler_description(self.sampler, self.sampling),
                "clean_block": self.clean_block,
                "sink_frames": self.sink_frames, "guidance": self.guidance,
                "last_chunk": None if self.last_chunk is None else list(self.last_chunk),
                "pool": cache.describe()}

    def snapshot(self, row: int) -> StreamState:
        """Sequence ``row`` (a host int in [0, sequences)) between chunks as a
        `StreamState` (module doc of `framekv.engine.stream_state`); its K/V copied
        out asynchronously on a CUDA device (the state's tensors wait). Reads only.
        ValueError for a row without a prompt or a store without a paged pool."""
        self._check_open()
        rows = self._pool_rows(check_rows([row], self.sequences, name="row"))
        self._require_prompt(rows)
        cache = self._paged_cache()
        snaps = [cache.export_sequence(r) for r in rows]
        # host copies: a stream off its pool holds no device memory
        history = None if self.history is None else [
            [(f, t.to("cpu")) for f, t in self.history.visible(r)] for r in rows]
        prompts = [self._prompts[r].to("cpu") for r in rows]
        return StreamState(self.describe(), snaps, prompts, history,
                           self.sequence_chunks[row], self.sequence_frames[row],
                           tuple(self.noise_streams[row]))

    @torch.no_grad()
    def restore(self, row: int, state: StreamState) -> None:
        """Sequence ``row`` becomes the stream ``state`` holds, going on from its next
        chunk; the other sequences are untouched. ValueError naming every difference
        for a state of another model or pool shape (nothing changed). All or nothing: if
        it fails part way, ``row`` is put back as it was (a row under way is snapshot
        first) and the error raised again. No graph is captured."""
        self._check_open()
        check_rows([row], self.sequences, name="row")
        if not isinstance(state, StreamState):
            raise ValueError(f"state must be a StreamState, got {type(state).__name__}")
        state.check_fits(self.describe())
        rows = self._pool_rows([row])
        live = all(self._prompts[r] is not None for r in rows) and self.sequence_chunks[row]
        backup = self.snapshot(row) if live else None
        try:
            self._put_state(row, state)
        except BaseException:
            try:
                if backup is None:
                    raise
                self._put_state(row, backup)
            except BaseException:
                self._reset_rows(rows)
            raise

    def _put_state(self, row: int, state: StreamState) -> None:
        rows = self._pool_rows([row])
        self._reset_rows(rows)
        cache = self._paged_cache()
        for r, snap, prompt in zip(rows, state.sequences, state.prompts):
            self._use([r])
            # A prompt that lives in the store is in the snapshot's K/V: the import
            # brings it, no prompt forward. One that lives in the model (Wan's
            # cross-attention K/V) is recomputed from the embeddings.
            if not getattr(self.chunk_model, "prompt_in_store", False):
                self.chunk_model.write_prompt(self.kv, (r,), prompt, rewrite=False)
            self._prompts[r] = prompt
            cache.reset_sequences([r])
            cache.import_sequence(r, snap)
            if self.history is not None:
                self.history.put(r, state.history[rows.index(r)])
        self.sequence_chunks[row], self.sequence_frames[row] = state.chunks, state.frames
        self._noise[row] = tuple(state.noise)

    def _paged_cache(self):
        cache = self.cache
        if cache is None:
            raise ValueError(f"streams leave and come back through a paged pool; this "
                             f"runner's store is a {type(self.kv).__name__}")
        return cache

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Every sequence back to position 0 under its prompt (graphs stay valid)."""
        self._check_open()
        self.kv.reset()
        self.chunk_model.clear_prompt(tuple(range(self.pool)))
        prompts, self._prompts = self._prompts, [None] * self.pool
        if self.history is not None:
            self.history.clear()
        self.sequence_chunks, self.sequence_frames = [0] * self.sequences, [0] * self.sequences
        self._noise.clear()
        self.paths, self.path = {"eager": 0, "graphs": 0}, None
        distinct = {id(p): p for p in prompts if p is not None}.values()
        self._write_prompts([([r for r, q in enumerate(prompts) if q is p], p) for p in distinct],
                            recache=False)

    def _reset_rows(self, rows) -> None:
        """Pool sequences ``rows`` back to position 0 with no prompt, nothing of their
        past left in the store or the model; the others go on."""
        self.kv.reset_sequences(list(rows))
        self.chunk_model.clear_prompt(tuple(rows))
        for r in rows:
            self._prompts[r] = None
            if self.history is not None:
                self.history.clear(r)
            if r < self.sequences:
                self.sequence_chunks[r] = self.sequence_frames[r] = 0
                self._noise.pop(r, None)

    def stats(self) -> dict:
        """Counters for metrics: graph replays and captures, chunks per path, the K/V
        pool's mapped bytes (0 for a store without a pool)."""
        g = self.graphs.stats()
        cache = self.cache
        return {"graph_replays": g.hits, "graph_captures": g.captures,
                "graphs": g.graphs, "chunks_graphs": self.paths["graphs"],
                "chunks_eager": self.paths["eager"],
                "pool_bytes": 0 if cache is None else cache.pool_bytes}

    def close(self) -> None:
        """Free the store and the graphs; the runner is unusable after (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.graphs.clear()
        self.kv.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} was closed: its cache and graphs "
                               "are freed; build a new one")
