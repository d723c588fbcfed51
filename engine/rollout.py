"""The rollout driver: prefill the prompt, then generate chunk after chunk.

Each chunk is ``denoising_steps`` forwards of a flow-matching Euler sampler (timesteps
``linspace(1, 0)``, ``x <- x + (t_next - t) * v``, the whole chunk one causal block),
then the clean pass at t = 0 with one-frame causal blocks (its K/V become history),
then ``commit(chunk_tokens)``. All of that is one callable over static inputs (the
chunk's noise and its first frame index), so on a GPU a steady-state chunk is ONE
`GraphCache` replay; the host mirror of the cache advances in the replay hook.

Capturing runs the callable (warm-up calls, and the capture's Python once), which
moves the cache. So `Rollout.capture` runs before the prefill, on the real cache, and
then resets the cache with ``close(); open(geometry)``: the geometry's device state
keeps its addresses across a reopen, so the graphs stay valid. On CPU the graph cache
runs the callable eagerly; the code path is the same.

Memory is constant in the number of chunks: the cache's pool never grows, the graphs
are captured once per chunk length, and the driver keeps nothing per chunk.
"""
from __future__ import annotations

import functools

import msgspec
import torch

from framekv.graphs import CaptureRequest, GraphCache, chunk_key, owner_token
from framekv.specs import ModelSpec, Preset, RolloutSpec, load_preset

from .cache import CausalKVCache
from .model import CausalVideoDiT, default_backend, model_dtype
from .ulysses import UlyssesParallel


def resolve_device(device=None) -> torch.device:
    """A torch device from a name (default: cuda if available, else cpu).

    Raises ValueError for an unknown device name or CUDA on a machine without it.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: use cpu or cuda[:N]") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")
    return dev


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
    """One autoregressive rollout of the reference model over a causal K/V cache.

    Args:
        preset: a `Preset`, a preset name or path, or a (ModelSpec, RolloutSpec) pair.
        device: "cpu", "cuda[:N]" or None (cuda if available).
        backend: attention backend (default: cudnn on CUDA, reference on CPU).
        use_graphs: run each chunk through the `GraphCache` (replays on CUDA, eager
            calls on CPU) rather than calling it directly.
        debug: the graph cache's address checks at every replay.
        resident: run each chunk's graph resident (`GraphCache.resident`): a chunk
            is submitted by one host store to a loop kept on the device instead of
            a graph launch, which after a wait costs ~100 µs of host time on an H200
            (docs/benchmarks.md). Needs ``use_graphs``; on CPU chunks run eagerly.
        model: an existing `CausalVideoDiT` of the same spec and prompt length to
            share (its weights are read, never changed; its attention backend is
            used, ``backend`` is ignored); default: a new one.
        process_group: run under Ulysses sequence parallelism over this
            torch.distributed group (every rank builds the same `Rollout`): the cache
            holds this rank's H_kv / W K/V heads, each forward runs this rank's share
            of the tokens and every layer's attention goes through `UlyssesAttention`;
            every rank gets the whole chunk's latents. None: one process.

    Usage::

        r = Rollout("tiny")
        r.prefill()
        frames = [r.step() for _ in range(r.spec.chunks)]   # each [F, C, H, W] fp32
    """

    def __init__(self, preset="tiny", device=None, *, backend=None, use_graphs: bool = True,
                 debug: bool = False, model: CausalVideoDiT | None = None,
                 process_group=None, resident: bool = False):
        if resident and not use_graphs:
            raise ValueError("resident=True runs captured graphs: it needs use_graphs=True, "
                             "got use_graphs=False")
        self.name, self.model_spec, self.spec = resolve_specs(preset)
        self.device = resolve_device(device)
        self.dtype = model_dtype(self.model_spec, self.device)
        self.use_graphs = use_graphs
        self.resident = resident
        self._runners: dict[int, object] = {}  # chunk tokens -> open ResidentGraph
        self.model = model or CausalVideoDiT(
            self.model_spec, prompt_tokens=self.spec.prompt_tokens, device=self.device,
            backend=backend if backend is not None else default_backend(self.device))
        if (self.model.spec, self.model.prompt_tokens) != (self.model_spec, self.spec.prompt_tokens):
            raise ValueError("model was built for another spec or prompt length")
        #: name of the attention backend (a shared model brings its own)
        self.backend: str = self.model.blocks[0].attn.backend.name
        #: Ulysses sequence parallelism over ``process_group``, or None (one process)
        self.parallel = (None if process_group is None
                         else UlyssesParallel(self.model, process_group))
        kv_heads = self.parallel.num_kv_heads if self.parallel else self.model_spec.num_kv_heads
        self.geometry = self.spec.geometry()
        tpp = self.model_spec.tokens_per_page
        self.cache = CausalKVCache(
            num_layers=self.model_spec.num_layers, num_kv_heads=kv_heads,
            head_dim=self.model_spec.head_dim, dtype=self.dtype, tokens_per_page=tpp,
            device=self.device, pool_tokens=CausalKVCache.pool_tokens_for(self.geometry, tpp))
        self.cache.open(self.geometry)
        self.graphs = GraphCache(self.device, debug=debug)
        steps = self.spec.denoising_steps
        self.timesteps = torch.linspace(1.0, 0.0, steps + 1, device=self.device)  # [steps+1]
        self._dts = [float(b - a) for a, b in zip(self.timesteps[:-1].tolist(),
                                                   self.timesteps[1:].tolist())]
        self._zero_t = torch.zeros(1, device=self.device)
        self._requests: dict[int, CaptureRequest] = {}  # chunk tokens -> what was captured
        self.chunk_index = 0
        self.frames_done = 0
        self.prefilled = False

    # ------------------------------------------------------------------ chunks
    def chunk_frames(self, index: int) -> int:
        """Frames of chunk ``index``: the short last chunk at ``spec.chunks - 1``,
        full chunks otherwise (also past the planned count: the rollout is open-ended)."""
        s = self.spec
        return s.last_chunk_frames if s.last_chunk_frames and index == s.chunks - 1 \
            else s.frames_per_chunk

    def chunk_fn(self, noise: torch.Tensor, frame0: torch.Tensor) -> torch.Tensor:
        """One whole chunk over static inputs: the Euler denoising forwards, the clean
        pass, the commit. noise fp32 [F, C, H, W]; frame0 int64 [1] -> clean latents
        fp32 [F, C, H, W]."""
        T = noise.shape[0] * self.spec.tokens_per_frame
        x = noise.clone()                                                  # fp32 [F, C, H, W]
        for i, dt in enumerate(self._dts):
            v = self.model(x, self.timesteps[i:i + 1], frame0, **self._attention(T, T))
            x = x + dt * v.float()
        self.model(x, self._zero_t, frame0, **self._attention(T, self.spec.tokens_per_frame))
        self._commit(T)
        return x

    def _attention(self, tokens: int, block_size: int) -> dict:
        """Where a forward's attention goes (`ReferenceRollout` sends it elsewhere)."""
        if self.parallel is not None:
            return self.parallel.forward_kwargs(self.cache, tokens, block_size)
        return {"kv_cache": self.cache, "seq_len": tokens, "causal_block_size": block_size}

    def _commit(self, tokens: int) -> None:
        self.cache.commit(tokens)

    def _after_replay(self, tokens: int) -> None:
        """Host half of a replayed chunk: the forwards staged ``tokens``, then commit."""
        self.cache.note_staged(tokens)
        self.cache.commit_mirror(tokens)

    def inputs(self, index: int, frame0: int | None = None) -> dict[str, torch.Tensor]:
        """Static inputs of chunk ``index``: its noise (from the model seed and the
        index, drawn on the CPU so every device sees the same) and its first frame."""
        frames = self.chunk_frames(index)
        m = self.model_spec
        gen = torch.Generator().manual_seed((m.seed << 32) + 1 + index)
        noise = torch.randn(frames, m.in_channels, m.latent_height, m.latent_width,
                            generator=gen)
        frame0 = self.frames_done if frame0 is None else frame0
        return {"noise": noise.to(self.device),
                "frame0": torch.tensor([frame0], dtype=torch.int64, device=self.device)}

    def capture_request(self, geometry, tokens: int, block_size: int | None = None) -> CaptureRequest:
        """What to capture for chunks of ``tokens`` real tokens (a `graphs.warmup`
        builder: every block size of one chunk length maps to the same chunk key)."""
        if geometry != self.geometry:
            raise ValueError(f"geometry {geometry} is not this rollout's {self.geometry}")
        frames, rem = divmod(tokens, self.spec.tokens_per_frame)
        if rem or tokens not in self.spec.chunk_token_counts():
            raise ValueError(f"tokens must be one of the rollout's chunk lengths "
                             f"{self.spec.chunk_token_counts()}, got {tokens}")
        index = self.spec.chunks - 1 if frames != self.spec.frames_per_chunk else 0
        inputs = self.inputs(index, frame0=0)
        key = chunk_key(owner_token(self), geometry, tokens,
                        denoise_steps=self.spec.denoising_steps,
                        clean_block=self.spec.tokens_per_frame, inputs=inputs,
                        splits=self._splits(tokens))
        return CaptureRequest(key, self.chunk_fn, inputs,
                              functools.partial(self._after_replay, tokens))

    def _splits(self, tokens: int) -> tuple[int, ...]:
        """Split-KV S of each forward of a chunk (empty for a backend that never splits)."""
        split_for = getattr(self.model.blocks[0].attn.backend, "split_for", None)
        if split_for is None:
            return ()
        blocks = [tokens] * self.spec.denoising_steps + [self.spec.tokens_per_frame]
        heads = self.parallel.num_heads if self.parallel else self.model_spec.num_heads
        return tuple(split_for(self.geometry, self.model_spec.tokens_per_page,
                               heads, tokens, b, self.device) for b in blocks)

    def chunk_key(self, tokens: int):
        """The `GraphKey` of chunks of ``tokens`` tokens."""
        return self.capture_request(self.geometry, tokens).key

    # ------------------------------------------------------------------ lifecycle
    def capture(self) -> None:
        """Capture every chunk length of the rollout, then reset the cache.

        Must run before `prefill` (capturing moves the cache; the reset would drop
        the prompt). `prefill` calls it when graphs are on and nothing is captured.
        """
        if self.prefilled:
            raise ValueError("capture() must run before prefill(): it resets the cache")
        for tokens in self.spec.chunk_token_counts():
            req = self.capture_request(self.geometry, tokens)
            if req.key not in self.graphs:
                self.graphs.capture(req.key, req.fn, req.inputs, after_replay=req.after_replay)
            self._requests[tokens] = req
        self.reset()

    def reset(self) -> None:
        """Back to position 0, no prompt: ``close(); open(geometry)`` (graphs stay valid)."""
        self.cache.close()
        self.cache.open(self.geometry)
        self.chunk_index = self.frames_done = 0
        self.prefilled = False

    def prefill(self) -> None:
        """Capture (graphs on, first time), then commit the prompt as the pinned prefix."""
        if self.prefilled:
            raise ValueError("the prompt is already prefilled; reset() first")
        if self.use_graphs and len(self._requests) < len(self.spec.chunk_token_counts()):
            self.capture()
        if self.parallel is not None:
            self.parallel.prefill(self.model, self.cache)
        else:
            self.model.prefill(kv_cache=self.cache)
        self.prefilled = True

    def step(self) -> torch.Tensor:
        """Generate the next chunk; returns its clean latents, fp32 [F, C, H, W] (a copy)."""
        if not self.prefilled:
            raise ValueError("call prefill() before step()")
        inputs = self.inputs(self.chunk_index)
        tokens = inputs["noise"].shape[0] * self.spec.tokens_per_frame
        if self.resident:
            out = self._run_resident(tokens, inputs)
        elif self.use_graphs:
            # Replay only: a capture here would run warm-up calls on the live cache.
            out = self.graphs.replay(self._requests[tokens].key, inputs)
        else:
            out = self.chunk_fn(**inputs)
        self.chunk_index += 1
        self.frames_done += inputs["noise"].shape[0]
        return out.clone()

    def _run_resident(self, tokens: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """One chunk through its `ResidentGraph` (opened on first use): the inputs are
        copied into the static buffers and on the device before the submit, as its
        contract asks; returns the static output once the run is done."""
        key = self._requests[tokens].key
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
        """Free the cache; the rollout is unusable after."""
        self.graphs.clear()
        self.cache.shutdown()


def __getattr__(name):
    # The verification harness builds on this module; imported on first use.
    if name in ("verify_rollout", "VerifyReport"):
        from . import verify

        return getattr(verify, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
