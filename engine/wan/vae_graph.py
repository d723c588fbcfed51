"""The Wan VAE decoder's chunk program through diffusers' modules (`chunk_program`),
the one `StreamingVAEDecoder(fused=False)` runs eagerly or replays as a CUDA graph; the
decoder's rows are `coder_rows.DecoderRows`, its cache `vae_cache.CacheArena`.

diffusers' ``WanDecoder3d`` decodes one latent frame per call and keeps, per causal
layer, a cache list entry: ``None`` before a video's first frame; after it, the
layer's last input step (one time step) or, for a time-upsampling ``WanResample``,
the marker ``"Rep"``; from the second frame on, the last ``CACHE_T = 2`` steps. Both
first-frame forms are the steady two-step form with zeros in front, exactly
(`vae_cache` says why), so after a video's first frame every entry is widened to two
steps (`to_steady`), and every later frame of every sequence runs one shape. The
arena holds, per used entry, ``[S, C_l, 2, H_l, W_l]`` for S sequences (shapes from
an eager dry run, `CacheLayout.probe`), and a chunk is one program over static inputs:

    cache = [None] * n (first chunk) | [arena_l[rows] for l]      # gather
    x = post_quant_conv(latents / inv_std + mean)                  # WanPipeline's denorm
    frames = [decoder(x[:, :, i], cache, first_chunk=(first and i == 0)) for i in F]
    arena_l[rows] = cache_l                                        # scatter
    return clamp(cat(frames), -1, 1)

Graph keys (`CoderRows._key`) hold the batch, the frames and the stage ("first": the
chunk starts the rows' videos; "steady": every row continues one)."""
from __future__ import annotations

import torch

from .coder_rows import STAGES, DecoderRows
from .vae_cache import CacheArena, CacheLayout, causal_slots, module_cache, to_steady

__all__ = ["STAGES", "CacheArena", "CacheLayout", "DecoderRows", "causal_slots",
           "chunk_program", "to_steady"]


def chunk_program(vae, arena: CacheArena, *, first: bool, mean: torch.Tensor,
                  inv_std: torch.Tensor, write: bool = True):
    """The chunk callable ``fn(latents, rows) -> frames`` (module doc): latents [B, C, F,
    H, W] normalised, in the vae's dtype; rows [B] int64 the sequences, distinct; frames
    [B, 3, F', 8H, 8W] clamped to [-1, 1]. ``write=False`` skips the scatter (a graph's
    warm-up calls must not advance the caches)."""
    layout = arena.layout

    @torch.no_grad()
    def fn(latents: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        B, F = latents.shape[0], latents.shape[2]
        x = vae.post_quant_conv(latents / inv_std + mean)  # [B, C, F, H, W]
        cache = module_cache(arena, rows, first)
        frames = []
        for i in range(F):
            frames.append(vae.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0],
                                      first_chunk=first and i == 0))  # [B, 3, 1 or 4, 8H, 8W]
            if first and i == 0:
                cache = to_steady(cache, layout, B, x.device)
        if write:
            arena.scatter(rows, cache)
        return torch.clamp(torch.cat(frames, dim=2), min=-1.0, max=1.0)

    return fn
