"""`WanRollout`: a diffusers `WanTransformer3DModel` rolled out chunk by chunk over
framekv's K/V cache, Self-Forcing style.

The model is used as it is: its self-attention processors and its rope are replaced in
place (`processors`), its cross-attention gets a processor that projects the prompt's
K/V once per prompt, everything else (patch embedding, time and text conditioning,
blocks, head) is its own forward. The pinned prefix is the first ``sink_frames``
generated frames (the prompt lives in cross-attention, not in the K/V), the window the
``window_frames`` finished frames behind the sink, the staged tokens one chunk::

    P = sink_frames * tpf     W = window_frames * tpf     M = frames_per_chunk * tpf

A chunk (one graph replay on CUDA): the sampler's steps, each one model forward with
the whole chunk one causal block, at timestep t_i (``[t_i]``, the model's own scale);
then a clean pass at timestep 0 over the clean latents (one block of the chunk, or
one-frame blocks) whose K/V become history; then the commit. Samplers, with
sigma_i = t_i / 1000 and sigma after the last step 0:

    euler          x <- x + (sigma_{i+1} - sigma_i) * v(x, t_i)
    self_forcing   x0 = x - sigma_i * v(x, t_i); x <- (1 - sigma_{i+1}) x0 + sigma_{i+1} e
                   (fresh noise e from the device's default generator, which a CUDA
                   graph replay advances); the chunk is x0 of the last step

Classifier-free guidance (``guidance_scale=g``): the conditional and the unconditional
branch are two sequences of one pool, run as the two rows of every forward (one
launch per layer for both); v = v_u + g (v_c - v_u). Each branch attends over its own
history and its clean pass commits its own K/V (under its own prompt).
"""
from __future__ import annotations

import torch

from framekv.graphs import CaptureRequest, GraphCache, chunk_key, owner_token

from ..attention import get_backend
from ..attention.registry import default_backend
from ..cache import CausalKVCache
from ..cache_dir import use_cache_dir
from ..kv import KVStore, PagedKV
from .processors import WanContext, WanCrossAttention, WanRope, WanSelfAttention
from .setup import WanShape, build_model, check_model, load_model, model_device_dtype

SAMPLERS = ("euler", "self_forcing")
CLEAN_BLOCKS = ("chunk", "frame")


class WanRollout:
    """A Wan transformer's autoregressive rollout over a framekv K/V store.

    Args:
        model: a diffusers ``WanTransformer3DModel`` (text-to-video: no image K/V); its
            processors and rope are replaced in place.
        latent_size: (H, W) of a latent frame.
        frames_per_chunk, sink_frames, window_frames: the geometry (module doc).
        timesteps: the model timesteps of the denoising steps, in (0, 1000], decreasing.
        sampler: "euler" or "self_forcing".
        clean_block: "chunk" (the clean pass is one block, as Self-Forcing trains) or
            "frame" (one-frame blocks).
        device: default the model's; backend: attention backend (default cudnn on
            CUDA, reference on CPU); use_graphs: one graph replay per chunk;
        cache_dir: keep and load kernels and cuDNN plans (`framekv.engine.cache_dir`).
        kv: a `KVStore` for this geometry instead of the paged cache (baselines).
        guidance_scale: None (no guidance) or g: classifier-free guidance with the
            branches as two sequences of the pool (module doc); ``set_prompt`` then
            also takes the unconditional embeddings.

    Attributes:
        frames_done: frames generated since the last reset; ``geometry``, ``cache``.
        recorder: None, or ``recorder(label, velocity)`` after every forward of an
            eager chunk ("step 0", ..., "clean"); a graph replay calls nothing.
    """

    def __init__(self, model, *, latent_size, frames_per_chunk: int, sink_frames: int = 1,
                 window_frames: int, timesteps=(1000, 750, 500, 250), sampler: str = "euler",
                 clean_block: str = "chunk", device=None, backend=None, use_graphs: bool = True,
                 cache_dir=None, kv: KVStore | None = None, guidance_scale: float | None = None):
        check_model(model)
        self.guidance = _guidance(guidance_scale)
        self.batch = 1 if self.guidance is None else 2  # rows: conditional, unconditional
        self.shape = WanShape.of(model, latent_size, frames_per_chunk, sink_frames, window_frames)
        self.sampler = _choice("sampler", sampler, SAMPLERS)
        self.clean_block = _choice("clean_block", clean_block, CLEAN_BLOCKS)
        self.sigmas = _sigmas(timesteps)
        self.device, self.dtype = model_device_dtype(model, device)
        self.model, self.use_graphs = model, use_graphs
        self.geometry = self.shape.geometry()
        plan_dir = use_cache_dir(cache_dir, self.device)
        name = backend if backend is not None else default_backend(self.device)
        self.backend = get_backend(name, plan_dir=plan_dir, device=self.device)
        self.kv = kv if kv is not None else PagedKV(self._cache(), self.geometry)
        if getattr(self.kv, "batch", 1) != self.batch:
            raise ValueError(f"kv must run {self.batch} sequences per forward, got "
                             f"{getattr(self.kv, 'batch', 1)}")
        self._frame0 = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.ctx = WanContext(self.kv, self._frame0)
        self._install()
        self.graphs = GraphCache(self.device)
        B = self.batch
        self._t = [torch.full((B,), float(t), device=self.device) for t in timesteps]
        self._t0 = torch.zeros(B, device=self.device)
        self._text_stub = torch.zeros(B, 1, model.config.text_dim, device=self.device,
                                      dtype=self.dtype)
        self._key = None
        self.frames_done, self.recorder, self.prompted = 0, None, False

    @classmethod
    def from_config(cls, config="tiny", *, seed: int = 0, dtype=None, device=None, **kwargs):
        """A rollout of a randomly initialised model: ``config`` a shipped name
        (`CONFIGS`: "tiny", "1.3b") or a config dict; ``kwargs`` as for the constructor."""
        return cls(build_model(config, dtype=dtype, device=device, seed=seed), **kwargs)

    @classmethod
    def from_pretrained(cls, path, *, config=None, dtype=None, device=None, **kwargs):
        """A rollout of local weights (`setup.load_model`: a diffusers folder, or a
        single-file checkpoint with ``config`` a local folder of its shape)."""
        return cls(load_model(path, dtype=dtype, device=device, config=config), **kwargs)

    # ------------------------------------------------------------------ setup
    def _cache(self) -> CausalKVCache:
        s, tpp = self.shape, self.shape.tokens_per_page
        return CausalKVCache(num_layers=s.num_layers, num_kv_heads=s.heads, head_dim=s.head_dim,
                             dtype=self.dtype, tokens_per_page=tpp, device=self.device,
                             num_sequences=self.batch,
                             pool_tokens=CausalKVCache.pool_tokens_for(
                                 self.geometry, tpp, num_sequences=self.batch))

    def _install(self) -> None:
        """The framekv processors and rope, in place, and the cross-attention cache."""
        from ..attention import CachedAttention

        s = self.shape
        self._cross = []
        for i, block in enumerate(self.model.blocks):
            cached = CachedAttention(s.heads, s.heads, s.head_dim, backend=self.backend,
                                     layer_idx=i)
            block.attn1.set_processor(WanSelfAttention(self.ctx, cached))
            cross = WanCrossAttention()
            block.attn2.set_processor(cross)
            self._cross.append(cross)
        self.model.rope = WanRope(self.ctx, s.head_dim, s.patch_size,
                                  getattr(self.model.rope, "theta", 10000.0))

    @property
    def cache(self) -> CausalKVCache | None:
        """The paged cache, or None for another store."""
        return getattr(self.kv, "cache", None)

    # ------------------------------------------------------------------ prompt
    @torch.no_grad()
    def set_prompt(self, text_embeds: torch.Tensor, negative_embeds: torch.Tensor | None = None
                   ) -> None:
        """The prompt for the chunks from now on: ``text_embeds`` [1, L, text_dim] (the
        text encoder's output), embedded and projected to every block's cross-attention
        K/V once, here. May be called again mid-rollout with the same L.

        ``negative_embeds`` [1, L, text_dim]: the unconditional branch's (with
        guidance only; default zeros, the empty conditioning)."""
        text_embeds = self._check_text("text_embeds", text_embeds)
        if self.guidance is None:
            if negative_embeds is not None:
                raise ValueError("negative_embeds needs guidance_scale (classifier-free "
                                 "guidance); this rollout has none")
        else:
            negative_embeds = (torch.zeros_like(text_embeds) if negative_embeds is None
                               else self._check_text("negative_embeds", negative_embeds))
            if negative_embeds.shape != text_embeds.shape:
                raise ValueError(f"negative_embeds must have the shape of text_embeds "
                                 f"{list(text_embeds.shape)}, got {list(negative_embeds.shape)}")
            text_embeds = torch.cat([text_embeds, negative_embeds])          # [2, L, text_dim]
        emb = self.model.condition_embedder.text_embedder(
            text_embeds.to(self.device, self.dtype))                         # [B, L, hidden]
        for block, cross in zip(self.model.blocks, self._cross):
            cross.set_text(block.attn2, emb)
        self.prompted = True

    def _check_text(self, name: str, x) -> torch.Tensor:
        dim = self.model.config.text_dim
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != 1 \
                or x.shape[2] != dim:
            got = list(x.shape) if isinstance(x, torch.Tensor) else x
            raise ValueError(f"{name} must be a [1, L, {dim}] tensor, got {got}")
        return x

    # ------------------------------------------------------------------ chunks
    def _forward(self, x: torch.Tensor, t: torch.Tensor, block: int, label: str) -> torch.Tensor:
        """One model forward over the chunk's latents x [1, C, F, H, W] at timestep t
        (both branches as two rows with guidance, combined)."""
        self.ctx.begin(self.shape.chunk_tokens, block)
        rows = x.to(self.dtype).expand(self.batch, *x.shape[1:])             # [B, C, F, H, W]
        v = self.model(rows, t, self._text_stub, return_dict=False)[0].float()
        if self.guidance is not None:
            v_c, v_u = v[0:1], v[1:2]
            v = v_u + self.guidance * (v_c - v_u)
        if self.recorder is not None:
            self.recorder(label, v)
        return v

    def chunk_fn(self, noise: torch.Tensor, frame0: torch.Tensor) -> torch.Tensor:
        """One chunk over static inputs: the sampler's steps, the clean pass, the commit.
        noise fp32 [1, C, F, H, W]; frame0 int64 [1] -> clean latents fp32 [1, C, F, H, W]."""
        self._frame0.copy_(frame0)
        s, sig, T = self.shape, self.sigmas, self.shape.chunk_tokens
        x = noise.clone()
        for i, t in enumerate(self._t):
            v = self._forward(x, t, T, f"step {i}")
            if self.sampler == "euler":
                x = x + (sig[i + 1] - sig[i]) * v
            else:
                x = x - sig[i] * v                                           # x0
                if i + 1 < len(self._t):
                    x = (1 - sig[i + 1]) * x + sig[i + 1] * torch.randn_like(x)
        block = T if self.clean_block == "chunk" else s.tokens_per_frame
        self._forward(x, self._t0, block, "clean")
        self.kv.commit(T)
        return x

    def _inputs(self, noise) -> dict[str, torch.Tensor]:
        want = (1, self.shape.channels, self.shape.frames_per_chunk, *self.shape.latent_size)
        if noise is None:
            gen = torch.Generator().manual_seed(self.frames_done)
            noise = torch.randn(want, generator=gen)
        if not isinstance(noise, torch.Tensor) or tuple(noise.shape) != want:
            got = list(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
            raise ValueError(f"noise must be a {list(want)} tensor, got {got}")
        return {"noise": noise.to(self.device, torch.float32),
                "frame0": torch.tensor([self.frames_done], dtype=torch.int64, device=self.device)}

    def capture_request(self) -> CaptureRequest:
        """The chunk as one graph (the one capture path: `framekv.graphs.run_warmup`)."""
        inputs = self._inputs(torch.zeros(1, self.shape.channels, self.shape.frames_per_chunk,
                                          *self.shape.latent_size))
        s, T = self.shape, self.shape.chunk_tokens
        clean = T if self.clean_block == "chunk" else s.tokens_per_frame
        blocks = (T,) * len(self._t) + (clean,)
        key = chunk_key(owner_token(self), self.geometry, T, denoise_steps=len(self._t),
                        clean_block=clean, inputs=inputs,
                        splits=self.kv.key_splits(self._cached(), T, blocks), batch=self.batch)
        return CaptureRequest(key, self.chunk_fn, inputs, lambda: self.kv.after_replay(T))

    def _cached(self):
        return self.model.blocks[0].attn1.processor.cached

    def capture(self, *, progress: bool = False, stream=None):
        """Capture the chunk graph (before the first step; the store is reset after)."""
        from framekv.graphs import run_warmup

        if self.frames_done:
            raise ValueError("capture() runs before the first step: it resets the rollout")
        self._require_prompt()
        try:
            with self.kv.capture_scope():
                request = self.capture_request()
                report = run_warmup(self.graphs, [request], progress=progress, stream=stream)
            self._key = request.key
        finally:
            self.reset()
        return report

    @torch.no_grad()
    def step(self, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Generate the next chunk; returns its clean latents, fp32 [1, C, F, H, W] (a copy).

        ``noise``: the chunk's starting noise [1, C, F, H, W], or None (drawn from a CPU
        generator seeded with the frame index, so every device sees the same).
        """
        self._require_prompt()
        inputs = self._inputs(noise)  # checked before a first step's capture
        if self.use_graphs and self._key is None:
            self.capture()  # at frame 0, and back at frame 0 after: the inputs still hold
        if self.use_graphs and self.kv.replayable:
            out = self.graphs.replay(self._key, inputs)
        else:
            out = self.chunk_fn(**inputs)
        self.frames_done += self.shape.frames_per_chunk
        return out.clone()

    def reset(self) -> None:
        """Back to frame 0 (the prompt and the captured graph stay)."""
        self.kv.reset()
        self.frames_done = 0

    def _require_prompt(self) -> None:
        if not self.prompted:
            raise ValueError("no prompt: call set_prompt(text_embeds) before a step")


def _choice(name: str, value, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def _guidance(g) -> float | None:
    if g is None:
        return None
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not g == g:
        raise ValueError(f"guidance_scale must be None or a number, got {g!r}")
    return float(g)


def _sigmas(timesteps) -> list[float]:
    """sigma_i = t_i / 1000 and a final 0; ValueError unless t decreases in (0, 1000]."""
    ts = [float(t) for t in timesteps] if isinstance(timesteps, (tuple, list)) else None
    if not ts or any(not 0 < t <= 1000 for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
        raise ValueError(f"timesteps must be a decreasing sequence in (0, 1000], got {timesteps!r}")
    return [t / 1000.0 for t in ts] + [0.0]
