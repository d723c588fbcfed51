"""`WanRollout`: a diffusers `WanTransformer3DModel` rolled out chunk by chunk over
framekv's K/V cache, Self-Forcing style: a `ChunkRunner` over `WanChunks`.

The pinned prefix is the first ``sink_frames`` generated frames (the prompt lives in
cross-attention, not in the K/V), the window the ``window_frames`` finished frames
behind the sink, the staged tokens one chunk::

    P = sink_frames * tpf     W = window_frames * tpf     M = frames_per_chunk * tpf

A chunk (one graph replay on CUDA): the sampler's steps at the model's timesteps
``[t_i]`` (sigma_i = t_i / 1000), the whole chunk one causal block; then a clean pass
at timestep 0 (one block of the chunk, or one-frame blocks) whose K/V become history;
then the commit. Classifier-free guidance (``guidance_scale``): each branch a sequence
of the pool with its own prompt and history, both rows of every forward. Many
sequences (``sequences=N``): N independent sequences on one pool, each with its own
prompt, position and history; a prompt change can re-cache a sequence's history
(`ChunkRunner.recache`).

The blocks' GEMMs run in the model's dtype or, with ``gemm_dtype="fp8"``, in fp8
(`framekv.engine.fp8_linear`: self- and cross-attention projections and the MLP; the
prompt's cross-attention K/V, the embeddings and the head stay in the model's dtype).

Prompts are embeddings [1, L, text_dim] or, with a ``text_encoder`` (`TextEncoder`, its
``max_tokens`` the rollout's L), text: each text encoded once, as ``WanPipeline`` encodes
it; under guidance a text prompt's negative defaults to the text "" (as the pipeline's).
"""
from __future__ import annotations

import os

import torch

from ..attention import get_backend
from ..attention.registry import default_backend
from ..cache import CausalKVCache
from ..cache_dir import use_cache_dir
from ..fp8_linear import FP8, resolve_gemm_dtype
from ..kv import KVStore, PagedKV
from framekv.specs.checks import check_choice, check_count, check_text
from ..rollout import check_store_dtype, resolve_kv_dtype
from ..runner import CLEAN_BLOCKS, ChunkRunner
from ..samplers import DEFAULT_SAMPLER
from .model import WanChunks
from .setup import (PRESETS, WanShape, build_model, check_model, model_device_dtype,
                    preset_sizes)
from .text import TEXT_CONFIGS, TextEncoder, has_text_encoder
from .weights import load_model

__all__ = ["CLEAN_BLOCKS", "WanRollout"]


class WanRollout(ChunkRunner):
    """A Wan transformer's autoregressive rollout over a framekv K/V store.

    Args:
        model: a diffusers ``WanTransformer3DModel`` (text-to-video: no image K/V); its
            modules and weights are used as they are (with the fused glue its q, k, v
            projections are packed into one weight, values unchanged).
        latent_size: (H, W) of a latent frame.
        frames_per_chunk, sink_frames, window_frames: the geometry (module doc).
        timesteps: the model timesteps of the denoising steps, in (0, 1000], decreasing.
        sampler, sampler_options: a registered sampler's name (default euler) and its
            options (`framekv.engine.samplers`), over ``timesteps``.
        clean_block: "chunk" (the clean pass is one block, as Self-Forcing trains) or
            "frame" (one-frame blocks).
        device: default the model's; backend: attention backend (default cudnn on
            CUDA, reference on CPU); use_graphs: one graph replay per chunk;
        cache_dir: keep and load kernels and cuDNN plans (`framekv.engine.cache_dir`).
        kv: a `KVStore` for this geometry instead of the paged cache (baselines; one
            sequence).
        guidance_scale, sequences, batch_sizes, trim_clean_pass: as for `ChunkRunner`.
        prompt_tokens: L of every prompt (default: what the first prompt has).
        glue: "fused" (default: the blocks' glue, QK norm and rope through framekv's
            ops) or "torch" (the stock math as torch ops).
        text_encoder: a `TextEncoder` for text prompts (its ``max_tokens`` is L: it sets
            ``prompt_tokens`` or must equal it; its ``d_model`` the model's text_dim).
        kv_dtype: the paged pool's dtype (`framekv.engine.rollout.resolve_kv_dtype`):
            None or "bf16" the model's compute dtype (default), "fp8" or
            torch.float8_e4m3fn (e4m3 with per-head scales; q, k, v stay in the model's
            dtype). With ``kv``: None takes its cache's dtype, anything else must name it.
        gemm_dtype: the blocks' GEMMs (`framekv.engine.fp8_linear.resolve_gemm_dtype`):
            None or "bf16" the model's dtype (default), "fp8" or torch.float8_e4m3fn
            (fp8 GEMMs with row-wise scales; the weights quantized here, once, their
            copies held by the rollout). ValueError naming a layer whose in or out
            features are not multiples of 16, or on CUDA a model not in bfloat16.

    Attributes:
        model: the diffusers model; shape: the `WanShape`; text_encoder: the
            `TextEncoder` or None; ``recorder``: see `ChunkRunner`; kv_dtype: the dtype
            the K/V are kept in; gemm_dtype: the dtype the blocks' GEMMs run in.
    """

    def __init__(self, model, *, latent_size, frames_per_chunk: int, sink_frames: int = 1,
                 window_frames: int, timesteps=(1000, 750, 500, 250),
                 sampler: str = DEFAULT_SAMPLER,
                 clean_block: str = "chunk", device=None, backend=None, use_graphs: bool = True,
                 cache_dir=None, kv: KVStore | None = None, guidance_scale: float | None = None,
                 sequences: int | None = None, batch_sizes=None, prompt_tokens: int | None = None,
                 glue: str = "fused", trim_clean_pass: bool = True, text_encoder=None,
                 kv_dtype=None, sampler_options=None, gemm_dtype=None):
        check_model(model)
        check_choice("glue", glue, ("fused", "torch"))
        check_count("prompt_tokens", prompt_tokens)
        prompt_tokens = _check_encoder(text_encoder, model, prompt_tokens)
        if kv is not None and (sequences is not None or guidance_scale is not None):
            raise ValueError("kv holds one sequence: it takes no sequences (got "
                             f"{sequences!r}) and no guidance_scale (got {guidance_scale!r})")
        self.shape = WanShape.of(model, latent_size, frames_per_chunk, sink_frames, window_frames)
        dev, dtype = model_device_dtype(model, device)
        held = getattr(getattr(kv, "cache", None), "dtype", None)
        self.kv_dtype: torch.dtype = (held if kv_dtype is None and held is not None
                                      else resolve_kv_dtype(kv_dtype, dtype))
        if kv is not None:
            check_store_dtype(kv, self.kv_dtype)
        self.gemm_dtype: torch.dtype = resolve_gemm_dtype(gemm_dtype, dtype)
        pool = (check_count("sequences", sequences) or 1) * (1 if guidance_scale is None else 2)
        name = backend if backend is not None else default_backend(dev, self.shape.head_dim)
        attention = get_backend(name, plan_dir=use_cache_dir(cache_dir, dev), device=dev)
        chunks = WanChunks(model, self.shape, glue=glue, backend=attention, sequences=pool,
                           prompt_tokens=prompt_tokens, device=dev, dtype=dtype,
                           fp8=self.gemm_dtype == FP8)
        if kv is None:
            kv = PagedKV(self._cache(dev, self.kv_dtype, pool), self.shape.geometry())
        super().__init__(chunks, kv,
                         frames_per_chunk=frames_per_chunk, timesteps=list(timesteps),
                         sampler=sampler, clean_block=clean_block, sink_frames=sink_frames,
                         use_graphs=use_graphs, sequences=sequences, batch_sizes=batch_sizes,
                         guidance_scale=guidance_scale, trim_clean_pass=trim_clean_pass,
                         sampler_options=sampler_options)
        self.model, self.backend, self.glue = model, attention, glue
        self.text_encoder = text_encoder

    @classmethod
    def from_config(cls, config="tiny", *, seed: int = 0, dtype=None, device=None,
                    text_encoder=None, **kwargs):
        """A rollout of a randomly initialised model: ``config`` a shipped name
        (`CONFIGS`: "tiny", "1.3b") or a config dict; ``kwargs`` as for the constructor,
        by default at the sizes of the config's preset (`preset_sizes`, `PRESETS`).
        ``text_encoder``: None, a `TextEncoder`, or "random": a random one of the
        config's `TEXT_CONFIGS` entry (seed ``seed``, L the rollout's prompt_tokens)."""
        if "latent_size" not in kwargs and isinstance(config, str) and config in PRESETS:
            kwargs = {**preset_sizes(PRESETS[config]), **kwargs}
        model = build_model(config, dtype=dtype, device=device, seed=seed)
        if isinstance(text_encoder, str):
            if (text_encoder != "random" or not isinstance(config, str)
                    or config not in TEXT_CONFIGS):
                raise ValueError(f"text_encoder must be None, a TextEncoder or 'random' (with "
                                 f"config one of {sorted(TEXT_CONFIGS)}), got "
                                 f"text_encoder={text_encoder!r}, config={config!r}")
            dev, dt = model_device_dtype(model)
            text_encoder = TextEncoder.from_config(config, seed=seed, dtype=dt, device=dev,
                                                   max_tokens=kwargs.get("prompt_tokens") or 512)
        return cls(model, text_encoder=text_encoder, **kwargs)

    @classmethod
    def from_pretrained(cls, path, *, config=None, dtype=None, device=None, key=None,
                        text_encoder=None, **kwargs):
        """A rollout of local weights (`weights.load_model`: a diffusers folder, or a
        generator checkpoint with ``config`` its shape and ``key`` its entry). The text
        encoder and tokenizer of the folder (``path``, or ``config`` when it is one) come
        too where it has them, L the rollout's ``prompt_tokens`` (default 512);
        ``text_encoder``: a `TextEncoder` instead, or False for none."""
        model = load_model(path, dtype=dtype, device=device, config=config, key=key)
        if text_encoder is None:
            folder = next((p for p in (path, config) if isinstance(p, (str, os.PathLike))
                           and has_text_encoder(p)), None)
            if folder is not None:
                dev, dt = model_device_dtype(model)
                text_encoder = TextEncoder.from_pretrained(
                    folder, max_tokens=kwargs.get("prompt_tokens") or 512, dtype=dt, device=dev)
        return cls(model, text_encoder=text_encoder or None, **kwargs)

    def _cache(self, device, dtype, pool: int) -> CausalKVCache:
        """The paged cache of ``pool`` sequences, its pool in ``dtype`` (`kv_dtype`)."""
        s, tpp = self.shape, self.shape.tokens_per_page
        return CausalKVCache(num_layers=s.num_layers, num_kv_heads=s.heads, head_dim=s.head_dim,
                             dtype=dtype, tokens_per_page=tpp, device=device, num_sequences=pool,
                             pool_tokens=CausalKVCache.pool_tokens_for(
                                 s.geometry(), tpp, num_sequences=pool))

    _prompt_names = ("text_embeds", "negative_embeds")

    def set_prompt(self, text_embeds: torch.Tensor | str,
                   negative_embeds: torch.Tensor | str | None = None, *,
                   recache: bool = False) -> None:
        """The prompt for the chunks from now on: ``text_embeds`` [1, L, text_dim] (a
        text encoder's output) or text (encoded by ``text_encoder``), projected to every
        block's cross-attention K/V once, here; the same L every time.
        ``negative_embeds``: the unconditional branch's, embeddings or text (guidance
        only; default the text "" for a text prompt, else zeros). ``recache``: also
        recompute the history's K/V under it."""
        if isinstance(text_embeds, str):
            check_text("text_embeds", text_embeds)     # the negative prompt may be ""
            if negative_embeds is None and self.guidance is not None:
                negative_embeds = ""
            text_embeds = self.encode_prompt(text_embeds)
        if isinstance(negative_embeds, str) and self.guidance is not None:
            negative_embeds = self.encode_prompt(negative_embeds)
        super().set_prompt(text_embeds, negative_embeds, recache=recache)

    def encode_prompt(self, text: str) -> torch.Tensor:
        """[1, L, text_dim] embeddings of ``text`` by the rollout's text encoder."""
        if self.text_encoder is None:
            raise ValueError(f"a text prompt needs a text encoder: pass text_encoder= (a "
                             f"TextEncoder) to WanRollout, got the text {text!r}")
        return self.text_encoder.encode([text])


def _check_encoder(encoder, model, prompt_tokens: int | None) -> int | None:
    """The rollout's prompt length with ``encoder`` (its max_tokens); ValueError when it
    is no `TextEncoder`, its max_tokens is not ``prompt_tokens`` or its width not the
    model's text_dim."""
    if encoder is None:
        return prompt_tokens
    if not isinstance(encoder, TextEncoder):
        raise ValueError(f"text_encoder must be None or a TextEncoder, got "
                         f"{type(encoder).__name__}")
    if prompt_tokens is not None and encoder.max_tokens != prompt_tokens:
        raise ValueError(f"text_encoder's max_tokens ({encoder.max_tokens}) must equal "
                         f"prompt_tokens ({prompt_tokens}), the rollout's prompt length L")
    if encoder.d_model != model.config.text_dim:
        raise ValueError(f"text_encoder's d_model ({encoder.d_model}) must equal the model's "
                         f"text_dim ({model.config.text_dim})")
    return encoder.max_tokens
