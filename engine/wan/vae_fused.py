"""The Wan 2.1 VAE decoder's chunk program, channels last with fused norms
(`FusedDecoder`, `fused_chunk_program`): the frames of diffusers' ``WanDecoder3d`` run
frame by frame (`vae_graph.chunk_program`), up to bf16 rounding, in a fraction of
its memory traffic.

The causal convs, residual blocks, the mid block's attention and the pending biases
are `vae_blocks`' (its module doc says why each is exact). What the decoder adds:

* A steady chunk's latent frames pass at once; a time upsample's output steps come
  out in the order the frame-by-frame pass makes them. A video's first chunk passes
  its first frame alone (no cache, and the time upsamples skip their conv:
  diffusers' ``"Rep"``), then the rest at once.
* An upsample adds the bias pending on its input while copying it (time conv) or in
  one pass at the low resolution. A time conv's bias is added by the copy that
  orders its sub-steps, a phase conv's by the copies that interleave its phases.
* A nearest 2x upsample and the 3x3 conv after it are one 2x2 conv of the small
  input to four output phases ((row, column) parity: the 3x3 taps that land on the
  same input pixel are summed into one, in fp32 before the weight's rounding), the
  phases then interleaved by four strided copies: 16 instead of 36 products per input
  pixel, and the 4x larger upsampled input is never written.
* The 3-channel output conv runs with its channels zero-padded to 8 (cuDNN's
  channels-last kernels want multiples of 8) and adds its own bias.

Cache entries are those of `vae_cache.CacheLayout` in diffusers' order; the fused
program keeps them as [B, 2, H, W, C] (`CacheArena(channels_last=True)` stores them so).
"""
from __future__ import annotations

import torch

from .vae_blocks import (FOLD_BELOW, FusedBlocks, _Conv, _biased_copy, _copy_into, _last,
                         _unbiased, mid_modules)

__all__ = ["FusedDecoder", "fused_chunk_program", "FOLD_BELOW"]

# _PHASES[p]: how the 3 taps of a 3x3 conv after a nearest 2x upsample fall on the 2
# taps (rows i - 1 + p, i + p) of the small input, for output rows of parity p.
_PHASES = ((1.0, 0.0, 0.0), (0.0, 1.0, 1.0)), ((1.0, 1.0, 0.0), (0.0, 0.0, 1.0))


def _upsample_conv(m) -> _Conv:
    """The 3x3 conv ``m`` after a nearest 2x upsample as a 2x2 conv to four phases:
    weight [4 C_out, C_in, 2, 2], phase (py, px) in channels (2 py + px) C_out + c."""
    w = m.weight.detach()                                     # [C_out, C_in, 3, 3]
    if tuple(w.shape[2:]) != (3, 3) or tuple(m.padding) != (1, 1):
        raise ValueError(f"upsample conv: expected a 3x3 kernel with padding 1, got kernel "
                         f"{list(w.shape[2:])} and padding {list(m.padding)}")
    a = torch.tensor(_PHASES, dtype=torch.float32, device=w.device)    # [p, 2, 3]
    w4 = torch.einsum("pak,qbl,oikl->pqoiab", a, a, w.float()).to(w.dtype)
    w4 = w4.reshape(-1, *w4.shape[3:]).contiguous(memory_format=torch.channels_last)
    b = None if m.bias is None else m.bias.detach().repeat(4)
    return _Conv(w4, b, (1, 1), w.shape[0])


class FusedDecoder(FusedBlocks):
    """The decoder's weights, channels last, and its forward over a pass of steps
    (module doc): `FusedBlocks.forward` of x [B, T, h, w, z] post-quant latents ->
    [B, T', 8h, 8w, 3] frames (unclamped), T' = 4T, or 1 for a video's first frame
    alone. Built from a Wan 2.1 ``AutoencoderKLWan`` (checked by its caller); holds
    its own copies of the conv weights, shares the rest. ``fold_below``: the causal
    convs with fewer input channels run with their time taps folded (default
    `FOLD_BELOW`; 0 folds none)."""

    def __init__(self, vae, *, fold_below: int | None = None):
        super().__init__(FOLD_BELOW if fold_below is None else fold_below)
        d = vae.decoder
        self.post_quant = vae.post_quant_conv
        modules = mid_modules(d.mid_block)
        for up in d.up_blocks:
            modules += list(up.resnets) + ([] if up.upsamplers is None else [up.upsamplers[0]])
        self._walk(self._causal_conv(d.conv_in), modules, d.norm_out,
                   self._causal_conv(d.conv_out, pad_out_to=8))

    def _resample_weights(self, u, pending):
        time = self._causal_conv(u.time_conv) if u.mode == "upsample3d" else None
        conv = u.resample[1]
        bias = None if conv.bias is None else conv.bias.detach()
        time_bias = None if time is None or time.bias is None else time.bias.view(2, 1, 1, -1)
        return (None if time is None else _unbiased(time), time_bias,
                _unbiased(_upsample_conv(conv)), bias, pending), None

    def _resample(self, w, x, caches, idx, first):
        time, time_bias, spatial, bias, pending = w
        B, T, H, W, C = x.shape
        if time is not None:
            i = next(idx)
        if time is not None and not first:   # a video's first frame skips the time conv
            y = self._causal(time, caches, i, _copy_into(x, pending))  # (its cache stays 0)
            # channels [2, C]: sub-step s of step t becomes step 2t + s
            y = y.view(B, T, H, W, 2, C).permute(0, 1, 4, 2, 3, 5)
            x = _biased_copy(y.new_empty(y.shape), y, time_bias)   # bias [2, 1, 1, C]
            T *= 2
        elif pending is not None:    # x (a residual block's output) is this block's alone
            x = x.add_(pending)
        p = self._apply(spatial, x.reshape(B * T, H, W, C).movedim(-1, 1))  # [BT, H+1, W+1, 4Co]
        p = p.view(B * T, H + 1, W + 1, 2, 2, spatial.out)
        out = p.new_empty(B * T, H, 2, W, 2, spatial.out)
        for py in range(2):                  # phase (py, px) of pixel (i, j) is p[i + py, j + px]
            for px in range(2):
                _biased_copy(out[:, :, py, :, px], p[:, py:py + H, px:px + W, py, px], bias)
        return out.view(B, T, 2 * H, 2 * W, spatial.out)


def fused_chunk_program(fused: FusedDecoder, arena, *, first: bool, mean: torch.Tensor,
                        inv_std: torch.Tensor, write: bool = True):
    """The chunk callable ``fn(latents, rows) -> frames`` of `vae_graph.chunk_program`'s
    contract, run by ``fused`` over a channels-last ``arena``."""

    @torch.no_grad()
    def fn(latents: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        x = _last(fused.post_quant(latents / inv_std + mean))          # [B, F, h, w, z]
        caches = arena.chunk(rows, first, write)                        # [B, 2, H, W, C]
        parts = fused.passes(x, caches, first)
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)   # [B, F', H, W, 3]
        out = torch.empty(y.shape[0], 3, *y.shape[1:4], dtype=y.dtype, device=y.device)
        return torch.clamp(y.movedim(-1, 1), -1.0, 1.0, out=out)       # one pass

    return fn
