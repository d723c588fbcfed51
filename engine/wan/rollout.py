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

Many streams (``sequences=N``): N independent streams on one pool, each with its own
prompt (one row of every cross-attention buffer), position and history; `step_rows`
runs any B of them (B one of ``batch_sizes``) as one graph replay. A prompt change
can re-cache a stream's history (`recache`): its visible frames' K/V recomputed by
clean passes under the new prompt (`framekv.engine.wan.recache`).

One file: the rollout is one object (prompts, streams, chunks, capture, steps), as
`framekv.engine.Rollout` is for the reference model.
"""
from __future__ import annotations

import torch

from framekv.graphs import CaptureRequest, GraphCache, chunk_key, owner_token

from ..attention import get_backend
from ..attention.registry import default_backend
from ..cache import CausalKVCache
from ..cache_dir import use_cache_dir
from ..kv import KVStore, PagedKV
from ..rollout import _check_batch_sizes, _check_flag
from . import blocks
from .processors import (WanContext, WanCrossAttention, WanRope, WanSelfAttention,
                         pack_projections)
from .recache import History, recache
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
        sequences: None (one stream) or N >= 1 streams on one pool, stepped with
            `step_rows` (not with guidance); batch_sizes: the batch sizes captured
            (each in [1, N], default (N,)); prompt_tokens: L of every prompt (default:
            what the first prompt has).
        glue: "fused" (default: the blocks' glue, QK norm and rope through framekv's
            ops, `framekv.engine.wan.blocks`; the same math, 1.15x faster a chunk on
            the H200, docs/benchmarks.md) or "torch" (the stock blocks and the
            processors' torch QK norm and rope).
        trim_clean_pass: True (default): with the fused glue the clean pass's last
            block stops once its K/V are staged (no attention, cross-attention or MLP
            there); False: every layer runs, as stock rollouts do. The latents are
            the same.

    Attributes:
        frames_done: frames generated since the last reset; ``geometry``, ``cache``.
        recorder: None, or ``recorder(label, velocity)`` after every forward of an
            eager chunk ("step 0", ..., "clean"; the clean pass, kept for its K/V only,
            passes None); a graph replay calls nothing.
    """

    def __init__(self, model, *, latent_size, frames_per_chunk: int, sink_frames: int = 1,
                 window_frames: int, timesteps=(1000, 750, 500, 250), sampler: str = "euler",
                 clean_block: str = "chunk", device=None, backend=None, use_graphs: bool = True,
                 cache_dir=None, kv: KVStore | None = None, guidance_scale: float | None = None,
                 sequences: int | None = None, batch_sizes=None, prompt_tokens: int | None = None,
                 glue: str = "fused", trim_clean_pass: bool = True):
        check_model(model)
        self.glue = _choice("glue", glue, ("fused", "torch"))
        self.trim_clean_pass = _check_flag("trim_clean_pass", trim_clean_pass)
        self.guidance = _guidance(guidance_scale)
        self.streams = _streams(sequences, self.guidance, kv)
        self.batch = 1 if self.guidance is None else 2  # rows: conditional, unconditional
        self.pool = self.streams or self.batch          # sequences of the pool
        self.batch_sizes = (_check_batch_sizes(batch_sizes, self.pool) if self.streams
                            else (self.batch,))
        self.prompt_tokens = _positive("prompt_tokens", prompt_tokens)
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
        if getattr(self.kv, "batch", 1) != self.pool:
            raise ValueError(f"kv must run {self.pool} sequences per forward, got "
                             f"{getattr(self.kv, 'batch', 1)}")
        self.ctx = WanContext(self.kv, torch.zeros(1, dtype=torch.int64, device=self.device),
                              glue=self.glue)
        self.ctx.rows = getattr(self.kv, "_ids", None) if self.streams else None
        self._install()
        self.graphs = GraphCache(self.device)
        self._t = [torch.full((1,), float(t), device=self.device) for t in timesteps]
        self._t0 = torch.zeros(1, device=self.device)
        self._text_stub = torch.zeros(1, 1, model.config.text_dim, device=self.device,
                                      dtype=self.dtype)
        self._keys: dict[int, object] = {}  # batch rows -> captured chunk key
        self.history = History(self.pool, self.shape)
        self.frames_done, self.recorder, self.prompted = 0, None, False
        self.prefilled = self.closed = False

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
                             num_sequences=self.pool,
                             pool_tokens=CausalKVCache.pool_tokens_for(
                                 self.geometry, tpp, num_sequences=self.pool))

    def _install(self) -> None:
        """The framekv processors and rope, in place, and the cross-attention cache."""
        from ..attention import CachedAttention

        s = self.shape
        self._cross = []
        for i, block in enumerate(self.model.blocks):
            (blocks.install if self.glue == "fused" else blocks.uninstall)(block)
            if self.glue == "fused":
                pack_projections(block.attn1)
            cached = CachedAttention(s.heads, s.heads, s.head_dim, backend=self.backend,
                                     layer_idx=i)
            last = i == len(self.model.blocks) - 1
            block.attn1.set_processor(WanSelfAttention(self.ctx, cached, last=last))
            cross = WanCrossAttention(self.ctx, self.pool)
            block.attn2.set_processor(cross)
            self._cross.append(cross)
        self.model.rope = WanRope(self.ctx, s.head_dim, s.patch_size,
                                  getattr(self.model.rope, "theta", 10000.0))

    @property
    def cache(self) -> CausalKVCache | None:
        """The paged cache, or None for another store."""
        return getattr(self.kv, "cache", None)

    # ------------------------------------------------------------------ prompt
    @property
    def prompt_shape(self) -> tuple[int, int] | None:
        """(L, text_dim) of a prompt (L: ``prompt_tokens``, or the first prompt's)."""
        L = self.prompt_tokens if self._cross[0].k is None else self._cross[0].k.shape[1]
        return None if L is None else (L, self.model.config.text_dim)

    def default_prompt(self) -> torch.Tensor:
        """The prompt a stream gets when none is given: [L, text_dim] standard normal
        embeddings from a fixed seed (stand-ins for a text encoder's output)."""
        if self.prompt_shape is None:
            raise ValueError("a default prompt needs prompt_tokens (its length L)")
        return torch.randn(self.prompt_shape, generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def set_prompt(self, text_embeds: torch.Tensor, negative_embeds: torch.Tensor | None = None,
                   *, recache: bool = False) -> None:
        """The prompt for the chunks from now on: ``text_embeds`` [1, L, text_dim] (the
        text encoder's output), embedded and projected to every block's cross-attention
        K/V once, here. May be called again mid-rollout with the same L; ``recache``:
        also recompute the history's K/V under it (`recache`; no guidance).

        ``negative_embeds`` [1, L, text_dim]: the unconditional branch's (with
        guidance only; default zeros, the empty conditioning). With ``sequences`` the
        prompt goes to every stream (`prefill_rows` sets some)."""
        text_embeds = self._check_text("text_embeds", text_embeds)
        if self.guidance is None:
            if negative_embeds is not None:
                raise ValueError("negative_embeds needs guidance_scale (classifier-free "
                                 "guidance); this rollout has none")
            text_embeds = text_embeds.expand(self.pool, -1, -1)
        else:
            negative_embeds = (torch.zeros_like(text_embeds) if negative_embeds is None
                               else self._check_text("negative_embeds", negative_embeds))
            if negative_embeds.shape != text_embeds.shape:
                raise ValueError(f"negative_embeds must have the shape of text_embeds "
                                 f"{list(text_embeds.shape)}, got {list(negative_embeds.shape)}")
            if recache:
                raise ValueError("recache needs a rollout without guidance_scale")
            text_embeds = torch.cat([text_embeds, negative_embeds])          # [2, L, text_dim]
        self._set_text(text_embeds, range(self.pool))
        if recache:
            self.recache(range(self.pool))

    def _set_text(self, text: torch.Tensor, rows) -> None:
        emb = self.model.condition_embedder.text_embedder(
            text.to(self.device, self.dtype))                                # [R, L, hidden]
        for block, cross in zip(self.model.blocks, self._cross):
            cross.set_text(block.attn2, emb, rows)
        self.prompted = True

    def _check_text(self, name: str, x) -> torch.Tensor:
        dim = self.model.config.text_dim
        L = self.prompt_shape[0] if self.prompt_shape else None
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0] != 1 \
                or x.shape[2] != dim:
            got = list(x.shape) if isinstance(x, torch.Tensor) else x
            raise ValueError(f"{name} must be a [1, {L or 'L'}, {dim}] tensor, got {got}")
        if L is not None and x.shape[1] != L:
            raise ValueError(f"{name} must keep the prompt length of the first set_prompt "
                             f"(or prompt_tokens): {L} tokens, got {x.shape[1]}")
        return x

    def prefill_rows(self, rows, prompt: torch.Tensor | None = None, *,
                     rewrite: bool = False) -> None:
        """The prompt of sequences ``rows`` (host ints): ``prompt`` [L, text_dim] (default
        `default_prompt`). Without ``rewrite`` they start over (no history; their K/V
        the caller resets); with it their history is re-cached under the new prompt."""
        self._check_open()
        rows = list(rows)
        prompt = self.default_prompt() if prompt is None else prompt
        text = self._check_text("prompt", prompt[None] if isinstance(prompt, torch.Tensor)
                                and prompt.dim() == 2 else prompt)
        self._set_text(text.expand(len(rows), -1, -1), rows)
        if rewrite:
            self.recache(rows)
        else:
            for r in rows:
                self.history.clear(r)

    def recache(self, rows) -> None:
        """Recompute the K/V of the visible history of sequences ``rows`` (host ints)
        under their current prompt (`framekv.engine.wan.recache.recache`)."""
        if self.guidance is not None:
            raise ValueError("recache needs a rollout without guidance_scale")
        for r in rows:
            recache(self, r)

    # ------------------------------------------------------------------ chunks
    @property
    def chunk_shape(self) -> tuple[int, int, int, int]:
        """(C, F, H, W) of one stream's chunk of latents."""
        s = self.shape
        return (s.channels, s.frames_per_chunk, *s.latent_size)

    @property
    def frames_per_chunk(self) -> int:
        return self.shape.frames_per_chunk

    def _forward(self, x: torch.Tensor, t: torch.Tensor, block: int, label: str, *,
                 output: bool = True) -> torch.Tensor | None:
        """One model forward over latents x [R, C, F', H, W] at timestep t, in causal
        blocks of ``block`` tokens (both branches as two rows with guidance, combined).
        ``output=False``: kept for its K/V only (`WanContext.begin`), returns None."""
        self.ctx.begin(x.shape[2] * self.shape.tokens_per_frame, block, output=output)
        rows = x.to(self.dtype)
        if self.guidance is not None:
            rows = rows.expand(self.batch, *x.shape[1:])                    # [2, C, F, H, W]
        R = rows.shape[0]
        v = self.model(rows, t.expand(R), self._text_stub.expand(R, -1, -1),
                       return_dict=False)[0]
        if not output:
            v = None
        else:
            v = v.float()
            if self.guidance is not None:
                v_c, v_u = v[0:1], v[1:2]
                v = v_u + self.guidance * (v_c - v_u)
        if self.recorder is not None:
            self.recorder(label, v)
        return v

    def chunk_fn(self, noise: torch.Tensor, frame0: torch.Tensor) -> torch.Tensor:
        """One chunk over static inputs: the sampler's steps, the clean pass, the commit.
        noise fp32 [R, C, F, H, W]; frame0 int64 [R] -> clean latents fp32 [R, C, F, H, W]
        (R = 1, or the batch rows of `step_rows`)."""
        self.ctx.frame0 = frame0
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
        self.clean_pass(x)
        return x

    def clean_pass(self, x: torch.Tensor) -> None:
        """The forward at timestep 0 over clean latents x [R, C, F', H, W] (F' <= the
        chunk's frames) at ``ctx.frame0``, and the commit of its K/V: one block for a
        whole chunk with ``clean_block="chunk"``, one-frame blocks otherwise."""
        tpf, frames = self.shape.tokens_per_frame, x.shape[2]
        whole = self.clean_block == "chunk" and frames == self.shape.frames_per_chunk
        self._forward(x, self._t0, frames * tpf if whole else tpf, "clean",
                      output=not self.trim_clean_pass)
        self.kv.commit(frames * tpf)

    def _inputs(self, noise) -> dict[str, torch.Tensor]:
        want = (1, *self.chunk_shape)
        if noise is None:
            gen = torch.Generator().manual_seed(self.frames_done)
            noise = torch.randn(want, generator=gen)
        if not isinstance(noise, torch.Tensor) or tuple(noise.shape) != want:
            got = list(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
            raise ValueError(f"noise must be a {list(want)} tensor, got {got}")
        return {"noise": noise.to(self.device, torch.float32),
                "frame0": torch.tensor([self.frames_done], dtype=torch.int64, device=self.device)}

    def capture_request(self, batch: int | None = None) -> CaptureRequest:
        """The chunk over ``batch`` rows (default the one-stream forward's) as one graph
        (the one capture path: `framekv.graphs.run_warmup`)."""
        B = 1 if batch is None else batch
        inputs = {"noise": torch.zeros(B, *self.chunk_shape, device=self.device),
                  "frame0": torch.zeros(B, dtype=torch.int64, device=self.device)}
        s, T = self.shape, self.shape.chunk_tokens
        clean = T if self.clean_block == "chunk" else s.tokens_per_frame
        blocks = (T,) * len(self._t) + (clean,)
        rows = self.batch if batch is None else batch
        more = {"batch": rows} if self.streams else {}
        splits, packed = self.kv.key_layout(self._cached(), T, blocks, **more)
        key = chunk_key(owner_token(self), self.geometry, T, denoise_steps=len(self._t),
                        clean_block=clean, inputs=inputs, splits=splits, batch=rows,
                        packed=packed)
        return CaptureRequest(key, self.chunk_fn, inputs, lambda: self.kv.after_replay(T))

    def _cached(self):
        return self.model.blocks[0].attn1.processor.cached

    def capture(self, *, progress: bool = False, stream=None):
        """Capture the chunk graphs (one, or one per batch size with ``sequences``)
        before the first step; the store is reset after."""
        from framekv.graphs import run_warmup

        if self.frames_done or self.prefilled:
            raise ValueError("capture() runs before the first step: it resets the rollout")
        if not self.prompted and self.prompt_tokens is not None:
            self._set_text(self.default_prompt()[None].expand(self.pool, -1, -1), range(self.pool))
        self._require_prompt()
        sizes = self.batch_sizes if self.streams else (None,)
        try:
            with self.kv.capture_scope():
                requests = [self.capture_request(b) for b in sizes]
                report = run_warmup(self.graphs, requests, progress=progress, stream=stream)
            self._keys = {r.key.batch: r.key for r in requests}
        finally:
            self.reset()
        return report

    @torch.no_grad()
    def step(self, noise: torch.Tensor | None = None) -> torch.Tensor:
        """Generate the next chunk; returns its clean latents, fp32 [1, C, F, H, W] (a copy).

        ``noise``: the chunk's starting noise [1, C, F, H, W], or None (drawn from a CPU
        generator seeded with the frame index, so every device sees the same).
        """
        self._check_open()
        if self.streams:
            raise ValueError("a rollout with sequences steps with step_rows(rows, noise, frame0)")
        self._require_prompt()
        inputs = self._inputs(noise)  # checked before a first step's capture
        if self.use_graphs and not self._keys:
            self.capture()  # at frame 0, and back at frame 0 after: the inputs still hold
        if self.use_graphs and self.kv.replayable:
            out = self.graphs.replay(self._keys[self.batch], inputs)
        else:
            out = self.chunk_fn(**inputs)
        if self.guidance is None:
            self.history.add(0, self.frames_done, out[0])
        self.frames_done += self.shape.frames_per_chunk
        return out.clone()

    @torch.no_grad()
    def step_rows(self, rows, noise: torch.Tensor, frame0: torch.Tensor) -> torch.Tensor:
        """One chunk of the pool's sequences ``rows`` (host ints, as many as one of
        ``batch_sizes``): row r is sequence rows[r], from noise[r] [C, F, H, W] at frame
        frame0[r]; returns the clean latents [B, C, F, H, W] (a copy). One graph replay
        (captured for that batch size); the caller keeps each sequence's position."""
        self._check_open()
        rows = tuple(rows)
        if not self.streams or len(rows) not in self.batch_sizes:
            raise ValueError(f"rows must name as many sequences as one of the batch sizes "
                             f"{self.batch_sizes} of a rollout with sequences=, got {len(rows)}")
        want = (len(rows), *self.chunk_shape)
        if not isinstance(noise, torch.Tensor) or tuple(noise.shape) != want:
            got = list(noise.shape) if isinstance(noise, torch.Tensor) else type(noise).__name__
            raise ValueError(f"noise must be a {list(want)} tensor, got {got}")
        self._require_prompt()
        self.kv.use_sequences(rows)
        frames = torch.as_tensor(frame0).tolist()  # the history's frame indices, read once
        inputs = {"noise": noise.to(self.device, torch.float32),
                  "frame0": torch.tensor(frames, dtype=torch.int64, device=self.device)}
        key = self._keys.get(len(rows))
        if self.use_graphs and key is not None and self.kv.replayable:
            out = self.graphs.replay(key, inputs).clone()
        else:
            out = self.chunk_fn(**inputs).clone()
        for i, (r, f0) in enumerate(zip(rows, frames)):
            self.history.add(r, f0, out[i])
        return out

    def reset(self) -> None:
        """Back to frame 0 (the prompt and the captured graphs stay)."""
        self.kv.reset()
        self.history.clear()
        self.frames_done = 0
        self.prefilled = False

    def close(self) -> None:
        """Free the store and the graphs; the rollout is unusable after (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self.graphs.clear()
        self.kv.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this WanRollout was closed: its cache and graphs are freed")

    def _require_prompt(self) -> None:
        if not self.prompted:
            raise ValueError("no prompt: call set_prompt(text_embeds) before a step")


def _choice(name: str, value, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def _streams(sequences, guidance, kv) -> int | None:
    if sequences is None:
        return None
    if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
        raise ValueError(f"sequences must be None or an integer >= 1, got {sequences!r}")
    if guidance is not None or kv is not None:
        raise ValueError("sequences runs streams on framekv's pool without guidance: it takes "
                         f"no guidance_scale (got {guidance!r}) and no kv (got {kv!r})")
    return sequences


def _positive(name: str, value) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}")
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
