"""The Wan 2.1 VAE encoder's chunk program, channels last with fused norms
(`FusedEncoder`, `fused_encode_program`): the latents of diffusers' ``WanEncoder3d``
run as ``AutoencoderKLWan._encode`` runs it (`vae_encoder.encode_program`), up to bf16
rounding, in a fraction of its memory traffic.

The causal convs, residual blocks, the mid block's attention and the pending biases
are `vae_blocks`' (its module doc says why each is exact). What the encoder adds:

* A steady chunk's 4k frames pass at once where ``_encode`` runs groups of 4: a
  causal conv gives each step what the group pass gives it (the same two steps before
  it), and a time downsample (a (3, 1, 1) conv of stride 2 over its cached step and its
  input) meets the same windows, since each group brings an even number of steps. A
  video's first chunk passes its first frame alone: the time downsamples skip their
  conv then and keep the frame as their cache, as the modules do.
* The input conv reads the frames' three channels zero-padded to `IN_WIDTH` per time
  tap (cuDNN's channels-last kernels want multiples of 8), the three taps together
  zero-padded to `IN_FOLDED` channels: the tap copies write the frames in, the
  padding is zeros and its weights zero.
* A downsample's ``ZeroPad2d((0, 1, 0, 1))`` and its 3x3 conv of stride 2 are one 4x4
  conv of stride 2 and padding 1 whose first row and column of weights are zero:
  output (i, j) reads input rows 2i - 1 .. 2i + 2, the first at zero weight, so rows
  2i .. 2i + 2 as the padded conv does, row H (and column W) padding either way; no
  copy of the input is made. The bias b pending on the input is not in it: the conv
  of the padded ``x + b`` is conv(x) plus the conv of a constant b image, which is a
  vector c inside and differs on the last output row, column and corner, where taps
  fall on the padding (`_border_bias` takes all four from the conv of a 4x4 image of
  b, in fp32). The last row, column and corner get their difference added; c joins
  the spatial conv's bias, pending on the output (a 2-D downsample) or added by the
  copy that puts the output after the time conv's cached step (a 3-D one), whose own
  bias is then pending; a first frame, which skips the time conv, is held as itself
  minus that bias.
* The output conv, ``quant_conv``'s first z channels (the posterior mean; the log
  variance is never needed) and the normalisation ``(mean - latents_mean) / std`` are
  one conv: every map is linear, so their weights and biases compose (in fp32, rounded
  once); the conv's output channels are zero-padded to 8, and the bias is added by the
  copy that writes the latents out in [B, z, F', h, w].

Cache entries are those of `vae_cache.CacheLayout.probe(part="encoder")` in diffusers'
order ([C, 2, H, W] for the causal convs, [C, 1, H, W] for the time downsamples); the
program keeps them as [B, steps, H, W, C] (`CacheArena(channels_last=True)`).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .vae_blocks import (FOLD_BELOW, FusedBlocks, _biased_copy, _conv, _Conv, _plus,
                         _unbiased, conv_weights, mid_modules)

__all__ = ["FusedEncoder", "IN_FOLDED", "IN_WIDTH", "fused_encode_program"]

#: Channels per time tap the input conv reads (the frames' 3, zero-padded).
IN_WIDTH = 8
#: Channels the input conv reads, its three taps together zero-padded (module doc).
IN_FOLDED = 32
_DOWNSAMPLES = ("downsample2d", "downsample3d")


def _border_bias(weight: torch.Tensor, pending) -> tuple:
    """A downsample conv's (weight [C_out, C_in, 3, 3], stride 2 after a ``ZeroPad2d((0,
    1, 0, 1))``) response to the constant image of ``pending`` [C_in] (fp32, or None):
    (inside c; what the last row, then the last column adds to c; what the corner adds
    beyond both), each [C_out] fp32, or Nones (module doc)."""
    if pending is None:
        return None, None, None, None
    image = pending.view(1, -1, 1, 1).expand(1, -1, 4, 4)                # [1, C_in, 4, 4]
    out = F.conv2d(F.pad(image, (0, 1, 0, 1)), weight.float(), stride=2)[0]  # [C_out, 2, 2]
    inside = out[:, 0, 0]
    row, col = out[:, 1, 0] - inside, out[:, 0, 1] - inside
    return inside, row, col, out[:, 1, 1] - inside - row - col


def _as_four(spatial: _Conv) -> _Conv:
    """A 3x3 stride-2 unpadded conv as the 4x4 conv of padding 1 (module doc)."""
    w = F.pad(spatial.weight, (1, 0, 1, 0)).contiguous(memory_format=torch.channels_last)
    return dataclasses.replace(spatial, weight=w, bias=None, pad=(1, 1))


class FusedEncoder(FusedBlocks):
    """The encoder's weights, channels last, and its forward over a pass of steps
    (module doc): `FusedBlocks.forward` of frames [B, T, H, W, 3] (a view) -> latents
    [B, T', H / 8, W / 8, z] without their bias ``out_bias`` [z], T' = T / 4, or 1 for
    a video's first frame alone. Built from a Wan 2.1 ``AutoencoderKLWan`` (checked by
    its caller); holds its own copies of the conv weights, shares the rest.
    ``fold_below``: the causal convs with fewer input channels run with their time taps
    folded (default `FOLD_BELOW`; 0 folds none)."""

    def __init__(self, vae, *, fold_below: int | None = None):
        super().__init__(FOLD_BELOW if fold_below is None else fold_below)
        e = vae.encoder
        c = e.conv_in
        conv_in = conv_weights(c.weight.detach(), c.bias.detach(),
                               (0, c._padding[2], c._padding[0]), fold_below=self.fold_below,
                               pad_in_to=IN_WIDTH, pad_folded_to=IN_FOLDED)
        conv_out, self.out_bias = self._latent_conv(vae)
        self._walk(conv_in, list(e.down_blocks) + mid_modules(e.mid_block), e.norm_out,
                   conv_out)

    def _latent_conv(self, vae):
        """The output conv, the mean's rows of ``quant_conv`` and the normalisation as
        one conv (module doc): (its weights, unbiased; its bias [z])."""
        cfg, c, q = vae.config, vae.encoder.conv_out, vae.quant_conv
        z, dev = cfg.z_dim, c.weight.device
        wq = q.weight.detach().float().reshape(2 * z, 2 * z)[:z]             # [z, 2z]
        w = torch.einsum("jc,c...->j...", wq, c.weight.detach().float())    # [z, C, 3, 3, 3]
        b = wq @ c.bias.detach().float() + q.bias.detach().float()[:z]
        inv_std = 1.0 / torch.tensor(cfg.latents_std, dtype=torch.float32).to(dev)
        w = w * inv_std.view(-1, 1, 1, 1, 1)
        b = (b - torch.tensor(cfg.latents_mean, dtype=torch.float32).to(dev)) * inv_std
        conv = conv_weights(w.to(c.weight.dtype), None, (0, c._padding[2], c._padding[0]),
                            pad_out_to=8, fold_below=self.fold_below)
        return conv, b.to(c.weight.dtype)

    def _resample_weights(self, m, pending):
        if m.mode not in _DOWNSAMPLES:
            raise ValueError(f"encoder resample: expected one of {_DOWNSAMPLES}, got {m.mode!r}")
        spatial = _conv(m.resample[1])            # 3x3, stride 2, unpadded: run as 4x4
        inside, *border = _border_bias(spatial.weight, pending)
        bias = _plus(_plus(None, spatial.bias), inside)
        if m.mode == "downsample2d":
            return (None, _as_four(spatial), border, None, None), bias
        time = _conv(m.time_conv)                 # (3, 1, 1), stride (2, 1, 1): never folded
        held = _plus(bias, None if time.bias is None else -time.bias)
        return (_unbiased(time), _as_four(spatial), border, bias, held), _plus(None, time.bias)

    def _resample(self, w, x, caches, idx, first):
        time, spatial, (row, col, corner), bias, held = w
        B, T, H, W, C = x.shape
        y = self._apply(spatial, x.reshape(B * T, H, W, C).movedim(-1, 1))  # [BT, H/2, W/2, C]
        if row is not None:       # the pending bias's border terms (module doc)
            y[:, -1].add_(row)
            y[:, :, -1].add_(col)
            y[:, -1, -1].add_(corner)
        y = y.view(B, T, *y.shape[1:])
        if time is None:
            return y                                          # the spatial bias pending
        i = next(idx)                                         # entry [B, 1, H/2, W/2, C]
        if first:        # a video's first frame skips the time conv and is its cache
            caches.store(i, _biased_copy(torch.empty_like(y), y, bias))
            return y if held is None else y.add_(held)
        buf = caches.empty(i, 1 + T)
        caches.load(i, buf[:, :1])
        _biased_copy(buf[:, 1:], y, bias)
        caches.store(i, buf[:, -1:])                          # the next chunk's step
        return self._apply(time, buf.movedim(-1, 1))          # [B, T/2, ...]: its bias pending


def fused_encode_program(fused: FusedEncoder, arena, *, first: bool, write: bool = True):
    """The chunk callable ``fn(frames, rows) -> latents`` of `vae_encoder.encode_program`'s
    contract, run by ``fused`` over a channels-last ``arena``."""

    @torch.no_grad()
    def fn(frames: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        caches = arena.chunk(rows, first, write)                        # [B, steps, H, W, C]
        parts = fused.passes(frames.movedim(1, -1), caches, first)     # [B, F_i, h, w, z]
        B, _, h, w, z = parts[0].shape
        out = torch.empty(B, z, sum(p.shape[1] for p in parts), h, w, dtype=frames.dtype,
                          device=frames.device)
        view, t = out.movedim(1, -1), 0                                 # [B, F', h, w, z]
        for p in parts:
            _biased_copy(view[:, t:t + p.shape[1]], p, fused.out_bias)
            t += p.shape[1]
        return out

    return fn
