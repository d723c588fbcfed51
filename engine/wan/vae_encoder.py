"""`StreamingVAEEncoder`: a video's frames to Wan latents chunk by chunk as they arrive,
the mirror of `StreamingVAEDecoder`.

Contract. ``encode(frames, rows)`` takes frames [B, 3, F, H, W] in [-1, 1] (H and W
multiples of 8) and returns latents [B, z, F', H / 8, W / 8] as the transformer reads
them, in the vae's dtype, a fresh tensor. A video's first chunk takes F = 1 + 4k frames
(k >= 0) and gives 1 + k latent frames, a later chunk 4k frames (k >= 1) and k. The
latents of a video encoded in chunks, however it is cut, concatenated along time, are
what WanVideoToVideoPipeline makes of the whole video::

    mean = vae.encode(frames).latent_dist.mode()      # the posterior mean
    latents = (mean - latents_mean) * (1 / latents_std)  # in the vae's dtype, per channel

(untiled, the vae's default). diffusers' ``AutoencoderKLWan._encode`` runs its encoder
over the first frame alone, then over groups of 4, with a causal cache per conv
(``vae_cache``); a stream is that loop with each sequence's cache kept between calls,
in one arena (`CacheArena`) widened to its steady form after the first frame, so a
chunk has two shapes only, "first" and "steady". The modules' program (``fused=False``,
`encode_program`) runs the encoder as ``_encode`` does, then ``quant_conv`` and the
normalisation; the fused one (`vae_encoder_fused`) runs the same convs channels last
with fused norms, a chunk's frames at once. Rows, stages, graphs, `snapshot` /
`restore`, `capture` and `close` are `coder_rows`'; Wan 2.2 VAEs are refused.
"""
from __future__ import annotations

import torch

from .coder_rows import EncoderRows
from .vae import VaeCoder
from .vae_cache import CacheArena, CacheLayout, module_cache, to_steady
from .vae_encoder_fused import FusedEncoder, fused_encode_program

__all__ = ["StreamingVAEEncoder", "encode_program"]


def encode_program(vae, arena: CacheArena, *, first: bool, mean: torch.Tensor,
                   inv_std: torch.Tensor, write: bool = True):
    """The chunk callable ``fn(frames, rows) -> latents`` through diffusers' modules
    (module doc): frames [B, 3, F, H, W] in the vae's dtype; rows [B] int64 the
    sequences, distinct; latents [B, z, F', H / 8, W / 8] normalised. ``write=False``
    skips the scatter (a graph's warm-up calls must not advance the caches)."""
    layout, z = arena.layout, vae.config.z_dim

    @torch.no_grad()
    def fn(frames: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        B, F = frames.shape[0], frames.shape[2]
        cache = module_cache(arena, rows, first)
        outs = []
        if first:               # the first frame alone, as _encode runs it
            outs.append(vae.encoder(frames[:, :, :1], feat_cache=cache, feat_idx=[0]))
            cache = to_steady(cache, layout, B, frames.device)
        for i in range(int(first), F, EncoderRows.TIME):                 # groups of 4
            outs.append(vae.encoder(frames[:, :, i:i + EncoderRows.TIME], feat_cache=cache,
                                    feat_idx=[0]))                       # [B, 2z, 1, h, w]
        if write:
            arena.scatter(rows, cache)
        moments = vae.quant_conv(torch.cat(outs, dim=2))                 # [B, 2z, F', h, w]
        return (moments[:, :z] - mean) * inv_std

    return fn


class StreamingVAEEncoder(VaeCoder, EncoderRows):
    """Encode frames to Wan latents chunk by chunk (module doc), each sequence's causal
    cache kept between calls. Arguments and attributes are `StreamingVAEDecoder`'s, the
    encoder's where it says decoder: ``vae`` (Wan 2.1), ``sequences`` (default: the batch
    of the first `encode` or `capture`), ``use_graphs``, ``device``, ``fused``
    (`vae_encoder_fused`; False runs diffusers' modules as ``_encode`` does; the two give
    the same latents up to bf16 rounding and share the state's form). Latents come back
    in the vae's dtype.
    """

    NAME, FUSED = "vae-encode", FusedEncoder

    # ------------------------------------------------------------------ internals
    MISMATCH = "another vae or frame size, or an encoder that has not encoded yet"

    def _layout(self, frame_size: tuple[int, int]) -> CacheLayout:
        return CacheLayout.probe(self.vae, frame_size, self.device, part="encoder")

    def _chunk(self, first: bool, write: bool):
        if self.fused:
            return fused_encode_program(self._program_weights, self._cache, first=first,
                                        write=write)
        return encode_program(self.vae, self._cache, first=first, mean=self._mean,
                              inv_std=self._inv_std, write=write)
