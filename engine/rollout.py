"""The rollout driver: prefill the prompt, then generate chunk after chunk.

Each chunk is ``denoising_steps`` forwards of a flow-matching Euler sampler (timesteps
``linspace(1, 0)``, ``x <- x + (t_next - t) * v``, the whole chunk one causal block),
then the clean pass at t = 0 with one-frame causal blocks (its K/V become history;
nothing reads its output, so by default its last block stops once its K/V are staged),
then ``commit(chunk_tokens)``. All of that is one callable over static inputs (the
chunk's noise and its first frame index), so on a GPU a steady-state chunk is ONE
`GraphCache` replay; the K/V store's host half advances in the replay hook.

Where the K/V go is a `framekv.engine.kv.KVStore`: the paged cache (default), the fp32
reference (``kv="reference"``), a store across ranks (``process_group``), or any
store the caller built for this rollout's geometry.

One capture path: `Rollout.capture_requests` says what to capture (one whole-chunk
graph per chunk length) and `Rollout.capture` captures it through
`framekv.graphs.run_warmup`, which `framekv warmup` runs too. Capturing runs the
callable (warm-up calls, and the capture's Python once), which moves the store, so it
runs before the prefill and is followed by a reset; the paged cache's device state
keeps its addresses across the reset, so the graphs stay valid. With ``cache_dir``
the kernels and cuDNN plans built for the captures are kept on disk and a later
process loads them (`framekv.engine.cache_dir`). On CPU the graph cache runs the
callable eagerly; the code path is the same.

Memory is constant in the number of chunks: the cache's pool never grows, the graphs
are captured once per chunk length, and the driver keeps nothing per chunk.

One file: the driver is one object (lifecycle, streams, capture, steps); the model, the
K/V stores and the graph cache it drives live in their own modules.
"""
from __future__ import annotations

import functools

import msgspec
import torch

from framekv import ops
from framekv.graphs import CaptureRequest, GraphCache, WarmupReport, chunk_key, owner_token, run_warmup
from framekv.specs import ModelSpec, Preset, RolloutSpec, load_preset

from .attention import get_backend
from .attention.ulysses import resolve_world_size
from .attention.ulysses_kv import UlyssesKV
from .cache import CausalKVCache
from .cache_dir import use_cache_dir
from .kv import KVStore, PagedKV, ReferenceKV
from .memory import check_fits, rollout_bytes
from .model import CausalVideoDiT, default_backend, model_dtype


def resolve_device(device=None) -> torch.device:
    """A torch device from a name (default: cuda if available, else cpu); ValueError for
    an unknown name or CUDA on a machine without it (`framekv.ops.resolve_device`)."""
    return ops.resolve_device(device)


def resolve_specs(preset) -> tuple[str, ModelSpec, RolloutSpec]:
    """(name, model, rollout) from a `Preset`, a preset name or path, or a
    (ModelSpec, RolloutSpec) pair."""
    if isinstance(preset, (str, bytes)) or hasattr(preset, "__fspath__"):
        preset = load_preset(preset)
    if isinstance(preset, Preset):
        return preset.name, preset.model, preset.rollout
    if (isinstance(preset, tuple) and len(preset) == 2 and isinstance(preset[0], ModelSpec)
            and isinstance(preset[1], RolloutSpec)):
        Preset(name=preset[0].name, model=preset[0], rollout=preset[1])  # cross-checks
        return preset[0].name, preset[0], preset[1]
    raise ValueError("preset must be a Preset, a preset name or path, or a "
                     f"(ModelSpec, RolloutSpec) pair, got {type(preset).__name__}")


def with_chunks(rollout: RolloutSpec, chunks: int) -> RolloutSpec:
    """The rollout with another chunk count; a short last chunk stays when chunks > 1."""
    last = rollout.last_chunk_frames if chunks > 1 else 0
    return msgspec.structs.replace(rollout, chunks=chunks, last_chunk_frames=last)


class Rollout:
    """One autoregressive rollout of the reference model over a K/V store.

    Args:
        preset: a `Preset`, a preset name or path, or a (ModelSpec, RolloutSpec) pair.
        device: "cpu", "cuda[:N]" or None (cuda if available).
        backend: attention backend name or instance (default: cudnn on CUDA, reference
            on CPU); one instance serves every layer.
        use_graphs: run each chunk through the `GraphCache` (replays on CUDA, eager
            calls on CPU) rather than calling it directly.
        debug: the graph cache's address checks at every replay.
        resident: run each chunk's graph resident (`GraphCache.resident`): submitted
            by one host store to a loop kept on the device instead of a graph launch
            (docs/benchmarks.md says when that pays). Needs ``use_graphs``; on CPU
            chunks run eagerly.
        model: an existing `CausalVideoDiT` of the same spec and prompt length to
            share (its weights are read, never changed; its attention backend is
            used, ``backend`` is ignored); default: a new one.
        process_group: run under Ulysses sequence parallelism over this
            torch.distributed group (every rank builds the same `Rollout`): the cache
            holds this rank's H_kv / W K/V heads, each forward runs this rank's share
            of the tokens (`UlyssesKV`); every rank gets the whole chunk's latents.
        kv: "paged" (the paged `CausalKVCache`, default), "reference" (the fp32
            exact-window reference: no graphs) or a `KVStore` built for this
            rollout's geometry.
        cache_dir: keep compiled kernels and built cuDNN plans in this folder and load
            them from it (`framekv.engine.cache_dir`); with a shared model, its cuDNN
            backend gets the plan folder if it has none.
        sequences: None (one stream, latents [F, C, H, W]) or B >= 1 streams stepped
            together: one pool of B sequences, every forward a batch of B rows, each
            stream its own noise and position (`reset_streams` restarts some of them
            while the others go on); `step` returns [B, F, C, H, W].
        batch_sizes: with ``sequences``, the batch sizes to capture graphs for (each
            <= B; default (B,)): `step_rows` replays a chunk over any that many of the
            pool's sequences (a scheduler's rounded-up batches).
        glue: the model's glue for this rollout's forwards (`CausalVideoDiT.glue`):
            "fused" (framekv's ops, default: the same math, 1.22x faster a wan-1.3b
            chunk on the H200, docs/benchmarks.md) or "torch" (torch ops).
        trim_clean_pass: True (default): the clean pass is kept for its K/V only, so
            its last block stops once they are staged (no attention, projection, MLP
            or head there); False: every layer runs, as stock rollouts do. The
            latents are the same.

    Usage::

        r = Rollout("tiny")
        r.prefill()
        frames = [r.step() for _ in range(r.spec.chunks)]   # each [F, C, H, W] fp32
    """

    def __init__(self, preset="tiny", device=None, *, backend=None, use_graphs: bool = True,
                 debug: bool = False, model: CausalVideoDiT | None = None,
                 process_group=None, resident: bool = False, kv="paged", cache_dir=None,
                 sequences: int | None = None, batch_sizes=None, glue: str = "fused",
                 trim_clean_pass: bool = True):
        if glue not in ("fused", "torch"):
            raise ValueError(f"glue must be 'fused' or 'torch', got {glue!r}")
        self.glue, self.trim_clean_pass = glue, _check_flag("trim_clean_pass", trim_clean_pass)
        if resident and not use_graphs:
            raise ValueError("resident=True runs captured graphs: it needs use_graphs=True, "
                             "got use_graphs=False")
        self.streams = _check_streams(sequences, kv, process_group)
        B = self.streams or 1
        self.batch_sizes = _check_batch_sizes(batch_sizes, B)
        self.name, self.model_spec, self.spec = resolve_specs(preset)
        self.device = resolve_device(device)
        self.dtype = model_dtype(self.model_spec, self.device)
        self.use_graphs, self.resident = use_graphs, resident
        self.geometry = self.spec.geometry()
        check_fits(f"preset {self.name!r}", rollout_bytes(
            self.model_spec, self.spec, self.dtype, weights=model is None,
            paged_cache=kv == "paged", sequences=B,
            reference_attention=_default_name(backend, self.device) == "reference"), self.device)
        self.model = self._model(model, backend, use_cache_dir(cache_dir, self.device))
        #: name of the attention backend (a shared model brings its own)
        self.backend: str = self.model.blocks[0].attn.backend.name
        self.kv: KVStore = self._store(kv, process_group)
        if use_graphs and not self.kv.graph_safe:
            raise ValueError(f"kv={type(self.kv).__name__} cannot be captured in graphs: "
                             "pass use_graphs=False")
        self.graphs = GraphCache(self.device, debug=debug)
        steps = self.spec.denoising_steps
        self.timesteps = torch.linspace(1.0, 0.0, steps + 1, device=self.device)  # [steps+1]
        self._dts = [float(b - a) for a, b in zip(self.timesteps[:-1].tolist(),
                                                   self.timesteps[1:].tolist())]
        self._zero_t = torch.zeros(1, device=self.device)
        # (chunk tokens, batch rows) -> what was captured
        self._requests: dict[tuple[int, int], CaptureRequest] = {}
        self._runners: dict[int, object] = {}  # chunk tokens -> open ResidentGraph
        #: per stream: chunks generated and frames done since its start
        self.stream_chunks, self.stream_frames = [0] * B, [0] * B
        self.prefilled = self.closed = False
        #: chunks run per path: "graphs" (a replay or resident run), "eager"; ``path``:
        #: the last chunk's (None before one)
        self.paths: dict[str, int] = {"eager": 0, "graphs": 0}
        self.path: str | None = None

    def _model(self, model, backend, plan_dir) -> CausalVideoDiT:
        if model is None:
            backend = get_backend(backend if backend is not None else default_backend(self.device),
                                  plan_dir=plan_dir, device=self.device)
            if not backend.supports_kv_cache:
                raise ValueError(f"backend {backend.name!r} cannot attend over the K/V cache: "
                                 "use 'cudnn' (CUDA) or 'reference'")
            return CausalVideoDiT(self.model_spec, prompt_tokens=self.spec.prompt_tokens,
                                  device=self.device, backend=backend)
        if (model.spec, model.prompt_tokens) != (self.model_spec, self.spec.prompt_tokens):
            raise ValueError("model was built for another spec or prompt length")
        shared = model.blocks[0].attn.backend
        if plan_dir is not None and getattr(shared, "plan_files", False) is None:
            from .attention.cudnn_graph import PlanFiles

            shared.plan_files = PlanFiles(plan_dir)
        return model

    def _store(self, kv, process_group) -> KVStore:
        if isinstance(kv, KVStore):
            if kv.geometry != self.geometry:
                raise ValueError(f"kv keeps geometry {kv.geometry}, this rollout needs "
                                 f"{self.geometry}")
            return kv
        if kv == "reference":
            return ReferenceKV(self.geometry, self.model_spec.num_layers)
        if kv != "paged":
            raise ValueError(f"kv must be 'paged', 'reference' or a KVStore, got {kv!r}")
        world = 1 if process_group is None else resolve_world_size(process_group, None)
        m, tpp = self.model_spec, self.model_spec.tokens_per_page
        B = self.streams or 1
        cache = CausalKVCache(
            num_layers=m.num_layers, num_kv_heads=m.num_kv_heads // world, head_dim=m.head_dim,
            dtype=self.dtype, tokens_per_page=tpp, device=self.device, num_sequences=B,
            pool_tokens=CausalKVCache.pool_tokens_for(self.geometry, tpp, num_sequences=B))
        if process_group is None:
            return PagedKV(cache, self.geometry)
        return UlyssesKV(self.model, cache, self.geometry, process_group)

    @property
    def cache(self) -> CausalKVCache | None:
        """The paged cache of the K/V store, or None for a store without one."""
        return getattr(self.kv, "cache", None)

    @property
    def parallel(self) -> UlyssesKV | None:
        """The Ulysses store under ``process_group``, else None (one process)."""
        return self.kv if isinstance(self.kv, UlyssesKV) else None

    # ------------------------------------------------------------------ chunks
    def chunk_frames(self, index: int) -> int:
        """Frames of chunk ``index``: the short last chunk at ``spec.chunks - 1``,
        full chunks otherwise (also past the planned count: the rollout is open-ended)."""
        s = self.spec
        return s.last_chunk_frames if s.last_chunk_frames and index == s.chunks - 1 \
            else s.frames_per_chunk

    @property
    def chunk_index(self) -> int:
        """Chunks generated by stream 0 since its start (the only stream by default)."""
        return self.stream_chunks[0]

    @property
    def frames_done(self) -> int:
        """Frames generated by stream 0 since its start."""
        return self.stream_frames[0]

    def chunk_fn(self, noise: torch.Tensor, frame0: torch.Tensor) -> torch.Tensor:
        """One whole chunk over static inputs: the Euler denoising forwards, the clean
        pass, the commit. noise fp32 [F, C, H, W] (or [B, F, C, H, W]); frame0 int64 [1]
        (or [B]) -> clean latents fp32 in the shape of noise."""
        T = noise.shape[-4] * self.spec.tokens_per_frame
        self.model.glue = self.glue  # a shared model runs each rollout's own glue
        x = noise.clone()                                                  # fp32 [F, C, H, W]
        for i, dt in enumerate(self._dts):
            v = self.model(x, self.timesteps[i:i + 1], frame0, kv=self.kv, seq_len=T,
                           causal_block_size=T)
            x = x + dt * v.float()
        self.model(x, self._zero_t, frame0, kv=self.kv, seq_len=T,
                   causal_block_size=self.spec.tokens_per_frame, output=not self.trim_clean_pass)
        self.kv.commit(T)
        return x

    def inputs(self, index=None, frame0=None) -> dict[str, torch.Tensor]:
        """Static inputs of the next chunk: its noise (from the model seed, the stream
        and the chunk index, drawn on the CPU so every device sees the same) and its
        first frame. ``index`` and ``frame0``: an int (every stream) or one per stream;
        default each stream's own."""
        B = self.streams or 1
        index = self.stream_chunks if index is None else _per_stream(index, B, "index")
        frame0 = self.stream_frames if frame0 is None else _per_stream(frame0, B, "frame0")
        frames = {self.chunk_frames(i) for i in index}
        if len(frames) > 1:
            raise ValueError(f"the streams' next chunks differ in length ({sorted(frames)} "
                             f"frames at chunk indices {list(index)}): a batched step needs "
                             "one chunk length")
        m = self.model_spec
        noise = torch.stack([torch.randn(
            self.chunk_frames(i), m.in_channels, m.latent_height, m.latent_width,
            generator=torch.Generator().manual_seed(_noise_seed(m.seed, stream, i)))
            for stream, i in enumerate(index)])                        # [B, F, C, H, W]
        noise = noise if self.streams else noise[0]
        return {"noise": noise.to(self.device),
                "frame0": torch.tensor(list(frame0), dtype=torch.int64, device=self.device)}

    # ------------------------------------------------------------------ capture
    def capture_request(self, tokens: int, batch: int | None = None) -> CaptureRequest:
        """What to capture for chunks of ``tokens`` real tokens over ``batch`` sequences
        (default all the rollout's streams): the whole chunk as one graph, the store's
        host half as its replay hook."""
        B = self.streams or 1
        batch = B if batch is None else batch
        if batch not in self.batch_sizes and batch != B:
            raise ValueError(f"batch must be one of the batch sizes {self.batch_sizes} or "
                             f"{B}, got {batch!r}")
        frames, rem = divmod(tokens, self.spec.tokens_per_frame)
        if rem or tokens not in self.spec.chunk_token_counts():
            raise ValueError(f"tokens must be one of the rollout's chunk lengths "
                             f"{self.spec.chunk_token_counts()}, got {tokens}")
        index = self.spec.chunks - 1 if frames != self.spec.frames_per_chunk else 0
        inputs = self.inputs(index, frame0=0)
        if self.streams:
            inputs = {name: t[:batch] for name, t in inputs.items()}
        blocks = (tokens,) * self.spec.denoising_steps + (self.spec.tokens_per_frame,)
        splits, packed = self.kv.key_layout(self.model.blocks[0].attn, tokens, blocks, batch)
        key = chunk_key(owner_token(self), self.geometry, tokens,
                        denoise_steps=self.spec.denoising_steps,
                        clean_block=self.spec.tokens_per_frame, inputs=inputs,
                        splits=splits, batch=batch, packed=packed)
        return CaptureRequest(key, self.chunk_fn, inputs,
                              functools.partial(self.kv.after_replay, tokens))

    def capture_requests(self) -> list[CaptureRequest]:
        """Every graph this rollout replays: one whole chunk per chunk length and batch
        size."""
        return [self.capture_request(t, b) for t in self.spec.chunk_token_counts()
                for b in self.batch_sizes]

    def chunk_key(self, tokens: int, batch: int | None = None):
        """The `GraphKey` of chunks of ``tokens`` tokens over ``batch`` sequences."""
        return self.capture_request(tokens, batch).key

    def capture(self, *, progress: bool = False, stream=None) -> WarmupReport:
        """Capture every graph of `capture_requests` (those not captured yet), then
        reset the store; returns the warm-up report (per graph: seconds, memory).

        Must run before `prefill` (capturing moves the store; the reset would drop
        the prompt). `prefill` calls it when graphs are on and nothing is captured.
        ``progress``: a progress bar on ``stream`` (default stderr).
        """
        self._check_open()
        if self.prefilled:
            raise ValueError("capture() must run before prefill(): it resets the cache")
        if not self.use_graphs:
            raise ValueError("capture() needs use_graphs=True")
        try:
            with self.kv.capture_scope():
                requests = self.capture_requests()
                report = run_warmup(self.graphs, requests, progress=progress, stream=stream)
            self._requests.update(((r.key.tokens, r.key.batch), r) for r in requests)
        finally:
            self.reset()
        return report

    # ------------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        """Back to position 0, no prompt (graphs stay valid)."""
        self._check_open()
        self.kv.reset()
        B = self.streams or 1
        self.stream_chunks, self.stream_frames = [0] * B, [0] * B
        self.prefilled = False
        self.paths, self.path = {"eager": 0, "graphs": 0}, None

    def prefill(self) -> None:
        """Capture (graphs on, first time), then commit the prompt as the pinned prefix."""
        self._check_open()
        if self.prefilled:
            raise ValueError("the prompt is already prefilled; reset() first")
        if self.use_graphs and not self._requests:
            self.capture()
        self._prefill(self.kv)
        self.prefilled = True

    def step(self) -> torch.Tensor:
        """Generate the next chunk; returns its clean latents, fp32 [F, C, H, W] (a copy).

        With graphs on, a chunk is a replay (a resident run with ``resident``) when the
        store can replay it now, else it runs eagerly; ``paths`` counts both.
        """
        self._check_open()
        if not self.prefilled:
            raise ValueError("call prefill() before step()")
        inputs = self.inputs()
        frames = inputs["noise"].shape[-4]
        tokens = frames * self.spec.tokens_per_frame
        if self.use_graphs and self.kv.replayable:
            # Replay only: a capture here would run warm-up calls on the live cache.
            key = self._requests[(tokens, self.streams or 1)].key
            out = (self._run_resident(key, tokens, inputs) if self.resident
                   else self.graphs.replay(key, inputs))
            self.path = "graphs"
        else:
            out = self.chunk_fn(**inputs)
            self.path = "eager"
        self.paths[self.path] += 1
        self.stream_chunks = [i + 1 for i in self.stream_chunks]
        self.stream_frames = [f + frames for f in self.stream_frames]
        return out.clone()

    @property
    def chunk_shape(self) -> tuple[int, int, int, int]:
        """(F, C, H, W) of one stream's full chunk of latents."""
        m = self.model_spec
        return (self.spec.frames_per_chunk, m.in_channels, m.latent_height, m.latent_width)

    @property
    def frames_per_chunk(self) -> int:
        return self.spec.frames_per_chunk

    @property
    def prompt_shape(self) -> tuple[int, int]:
        """(prompt_tokens, text_dim) of a prompt (`prefill_rows`)."""
        return tuple(self.model.prompt.shape)

    def step_rows(self, rows, noise: torch.Tensor, frame0: torch.Tensor) -> torch.Tensor:
        """One chunk over the pool's sequences ``rows`` (host ints, as many as one of
        ``batch_sizes``): batch row r is sequence rows[r], starting from noise[r] at
        frame frame0[r]; returns the clean latents [B, F, C, H, W] (a copy). Replays the
        graph captured for that batch size; the caller keeps each sequence's position
        (a scheduler's step; `step` keeps them for all streams)."""
        self._check_open()
        rows = tuple(rows)
        if not self.streams or len(rows) not in self.batch_sizes:
            raise ValueError(f"rows must name as many sequences as one of the batch sizes "
                             f"{self.batch_sizes} of a rollout with sequences=, got {len(rows)}")
        want = (len(rows), None, self.model_spec.in_channels, self.model_spec.latent_height,
                self.model_spec.latent_width)
        if noise.dim() != 5 or any(w is not None and w != n for w, n in zip(want, noise.shape)):
            raise ValueError(f"noise must be [{len(rows)}, F, {want[2]}, {want[3]}, {want[4]}], "
                             f"got {list(noise.shape)}")
        tokens = noise.shape[1] * self.spec.tokens_per_frame
        self.kv.use_sequences(rows)
        inputs = {"noise": noise.to(self.device, torch.float32),
                  "frame0": frame0.to(self.device, torch.int64)}
        key = self._requests.get((tokens, len(rows)))
        if self.use_graphs and key is not None:
            out, self.path = self.graphs.replay(key.key, inputs), "graphs"
        else:
            out, self.path = self.chunk_fn(**inputs), "eager"
        self.paths[self.path] += 1
        return out.clone()

    def prefill_rows(self, rows, prompt: torch.Tensor | None = None, *,
                     rewrite: bool = False) -> None:
        """The prompt (``prompt`` [prompt_tokens, text_dim], default the model's) as the
        pinned prefix of sequences ``rows`` (host ints): committed at position 0, or with
        ``rewrite`` written over the pinned region of sequences already under way (their
        history stays, and is seen under the new prompt from the next chunk)."""
        self._check_open()
        self.kv.use_sequences(rows)
        try:
            self._prefill(self.kv, prompt=prompt, rewrite=rewrite)
        finally:
            self.kv.use_sequences(range(self.streams or 1))

    def _prefill(self, kv, **kw) -> None:
        self.model.glue = self.glue
        self.model.prefill(kv, **kw)

    def reset_streams(self, streams) -> None:
        """Restart streams ``streams`` (host ints) at position 0 with the prompt
        prefilled, while the others keep their position: the next `step` runs them all
        in one batch, the restarted ones at their chunk 0. Graphs stay valid."""
        self._check_open()
        if not self.streams:
            raise ValueError("reset_streams needs a rollout of several streams "
                             "(Rollout(..., sequences=B)); use reset()")
        if not self.prefilled:
            raise ValueError("call prefill() before reset_streams()")
        streams = list(streams)
        self.kv.reset_sequences(streams)
        self.kv.use_sequences(streams)
        try:
            self._prefill(self.kv)
        finally:
            self.kv.use_sequences(range(self.streams))
        for i in streams:
            self.stream_chunks[i] = self.stream_frames[i] = 0

    def _run_resident(self, key, tokens: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One chunk through its `ResidentGraph` (opened on first use): the inputs are
        copied into the static buffers and on the device before the submit, as its
        contract asks; returns the static output once the run is done."""
        runner = self._runners.get(tokens)
        if runner is None or runner.closed:
            runner = self._runners[tokens] = self.graphs.resident(key)
        self.graphs.load(key, inputs)
        if self.device.type == "cuda":
            # This stream only: a device-wide synchronize would wait for the loop to idle.
            torch.cuda.current_stream(self.device).synchronize()
        runner.submit()
        return runner.wait()

    def run(self, chunks: int | None = None) -> list[torch.Tensor]:
        """Prefill if needed, then ``chunks`` more chunks (default: the spec's count)."""
        if not self.prefilled:
            self.prefill()
        return [self.step() for _ in range(self.spec.chunks if chunks is None else chunks)]

    def close(self) -> None:
        """Free the store and the graphs; the rollout is unusable after (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.graphs.clear()
        self.kv.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this Rollout was closed: its cache and graphs are freed; "
                               "build a new one")


def _noise_seed(seed: int, stream: int, index: int) -> int:
    """Seed of the noise of chunk ``index`` of a stream (stream 0: the one-stream seed)."""
    return (seed << 32) + 1 + index + (stream << 24)


def _per_stream(value, B: int, name: str) -> list[int]:
    """An int for every stream, or one int per stream, as a list of B ints."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * B
    value = list(value)
    if len(value) != B:
        raise ValueError(f"{name} must be an int or one per stream ({B}), got {value}")
    return value


def _check_flag(name: str, value) -> bool:
    """``value`` if it is a bool, else a ValueError naming ``name``."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def _check_batch_sizes(batch_sizes, B: int) -> tuple[int, ...]:
    """Sorted distinct batch sizes, each in [1, B]; default (B,)."""
    if batch_sizes is None:
        return (B,)
    sizes = tuple(sorted(set(batch_sizes))) if isinstance(batch_sizes, (list, tuple)) else ()
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= B
                        for b in sizes):
        raise ValueError(f"batch_sizes must be integers in [1, {B}] (the rollout's sequences), "
                         f"got {batch_sizes!r}")
    return sizes


def _check_streams(sequences, kv, process_group) -> int | None:
    """The ``sequences`` argument of a `Rollout`, checked against its other arguments."""
    if sequences is None:
        return None
    if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
        raise ValueError(f"sequences must be None or an integer >= 1, got {sequences!r}")
    if kv != "paged" or process_group is not None:
        raise ValueError("sequences runs several streams on one paged pool: it needs "
                         f"kv='paged' and no process_group, got kv={kv!r}, "
                         f"process_group={process_group!r}")
    return sequences


def _default_name(backend, device: torch.device) -> str:
    """The name of the backend a rollout will run (an instance: its own)."""
    if backend is None:
        return default_backend(device)
    return getattr(backend, "name", backend)
