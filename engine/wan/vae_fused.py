"""The Wan 2.1 VAE decoder's chunk program, channels last with fused norms
(`FusedDecoder`, `fused_chunk_program`): the frames of diffusers' ``WanDecoder3d`` run
frame by frame (`vae_graph.chunk_program`), up to bf16 rounding, in a fraction of
its memory traffic.

What differs from running the diffusers modules, and why each is exact:

* Every activation is [B, T, H, W, C] (channels last), every conv weight channels
  last: cuDNN's convolutions run on that layout natively, so no NCHW<->NHWC
  conversion runs around each of them. A 1x1x1 shortcut is a matmul over C.
* ``WanRMS_norm`` + SiLU is one kernel (`framekv.ops.rms_silu`), reading the
  activation once and writing its result straight into the next causal conv's input
  buffer after the conv's two cached steps ([B, 2 + T, H, W, C]); the conv then pads
  only H and W (its own zero padding, no copy). The module's ``F.pad`` and
  ``torch.cat([cache, x])`` copies, its fp32 round trip and its five bf16 roundings
  are gone (one rounding instead: the bf16 difference).
* All latent frames of a steady chunk pass at once: a causal conv over
  ``[cache, x_0 .. x_{F-1}]`` gives each step what the frame-by-frame pass gives it
  (the same two steps before it), the norms, the spatial convs and the mid block's
  attention act per step, and a time upsample's output steps come out in the same
  order. The next cache is the buffer's last two steps, as the modules keep them.
  A video's first chunk passes its first frame alone (no cache, and the time
  upsamples skip their conv: diffusers' ``"Rep"``), then the rest at once.
* A residual block's first conv runs without its bias: the norm after it adds it
  (its output feeds nothing else), in fp32 before the norm, where the module adds it
  in a pass of its own and rounds.
* The nearest 2x upsample runs in the activation's dtype (it copies values; the
  module's fp32 round trip changes none), and the 3-channel output conv runs with
  its channels zero-padded to 8 (cuDNN's channels-last kernels want multiples of 8).

Cache entries are those of `vae_graph.CacheLayout` in diffusers' order; the fused
program keeps them as [B, 2, H, W, C] (`CacheArena(channels_last=True)` stores them so).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from framekv.ops.rms_silu import rms_norm_silu

__all__ = ["FusedDecoder", "fused_chunk_program"]


@dataclasses.dataclass(frozen=True)
class _Conv:
    weight: torch.Tensor          # [C_out, C_in, kt, kh, kw], channels last
    bias: torch.Tensor | None
    pad: tuple[int, int, int]     # (0, ph, pw): time is padded by the cached steps
    out: int                      # output channels kept (the rest are padding)


def _conv(m, pad_out_to: int = 1) -> _Conv:
    w, b = m.weight.detach(), None if m.bias is None else m.bias.detach()
    out = w.shape[0]
    extra = -out % pad_out_to
    if extra:
        w = torch.cat([w, w.new_zeros(extra, *w.shape[1:])])
        b = None if b is None else torch.cat([b, b.new_zeros(extra)])
    fmt = torch.channels_last_3d if w.dim() == 5 else torch.channels_last
    pad = tuple(m.padding) if w.dim() == 4 else (0, m._padding[2], m._padding[0])
    return _Conv(w.contiguous(memory_format=fmt), b, pad, out)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B, T, H, W, C] (a slice of a buffer too) as [B, T*H*W, C], a view."""
    return t.view(t.shape[0], -1, t.shape[-1])


def _last(y: torch.Tensor) -> torch.Tensor:
    """A conv's [N, C, ...] output as [N, ..., C] (free when it is channels last)."""
    y = y.movedim(1, -1)
    return y if y.is_contiguous() else y.contiguous()


class FusedDecoder:
    """The decoder's weights, channels last, and its forward over a pass of steps
    (module doc). Built from a Wan 2.1 ``AutoencoderKLWan`` (checked by its caller);
    holds its own copies of the conv weights, shares the rest."""

    def __init__(self, vae):
        d = vae.decoder
        self.post_quant = vae.post_quant_conv
        self.conv_in = _conv(d.conv_in)
        self.blocks: list = [("res", self._res_weights(d.mid_block.resnets[0]))]
        for attn, res in zip(d.mid_block.attentions, d.mid_block.resnets[1:]):
            self.blocks += [("attn", self._attn_weights(attn)), ("res", self._res_weights(res))]
        for up in d.up_blocks:
            self.blocks += [("res", self._res_weights(r)) for r in up.resnets]
            if up.upsamplers is not None:
                u = up.upsamplers[0]
                time = _conv(u.time_conv) if u.mode == "upsample3d" else None
                self.blocks.append(("up", (time, _conv(u.resample[1]))))
        self.norm_out = d.norm_out.gamma.detach().reshape(-1)
        self.conv_out = _conv(d.conv_out, pad_out_to=8)
        # cache entries in diffusers' order: conv_in, two per residual block, one per
        # time upsample, conv_out
        self.entries = 2 + sum(2 if kind == "res" else int(kind == "up" and w[0] is not None)
                               for kind, w in self.blocks)

    @staticmethod
    def _res_weights(r):
        conv1, short = _conv(r.conv1), None
        if not isinstance(r.conv_shortcut, torch.nn.Identity):
            w = r.conv_shortcut.weight.detach()
            short = (w.reshape(w.shape[0], -1), r.conv_shortcut.bias.detach())
        # conv1 without its bias: norm2 adds it (module doc)
        return (r.norm1.gamma.detach().reshape(-1), dataclasses.replace(conv1, bias=None),
                r.norm2.gamma.detach().reshape(-1), conv1.bias, _conv(r.conv2), short)

    @staticmethod
    def _attn_weights(a):
        def flat(m):
            return m.weight.detach().reshape(m.weight.shape[0], -1), m.bias.detach()
        return a.norm.gamma.detach().reshape(-1), flat(a.to_qkv), flat(a.proj)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, caches: list, first: bool) -> torch.Tensor:
        """One pass: x [B, T, h, w, z] post-quant latents -> [B, T', 8h, 8w, 3] frames
        (unclamped), T' = 4T, or 1 for a video's first frame alone (``first``, T = 1).
        ``caches``: per entry [B, 2, H, W, C], read, then overwritten with the next."""
        idx = iter(range(self.entries))
        x = self._causal(self.conv_in, caches, next(idx), x.shape[1], lambda out: out.copy_(x))
        for kind, w in self.blocks:
            if kind == "res":
                x = self._res(w, x, caches, next(idx), next(idx))
            elif kind == "attn":
                x = self._attn(w, x)
            else:
                x = self._up(w, x, caches, idx, first)
        y = self._causal(self.conv_out, caches, next(idx), x.shape[1],
                         self._norm_into(x, self.norm_out))
        return y[..., :self.conv_out.out]

    @staticmethod
    def _norm_into(x, gamma, bias=None):
        """A one-shot fill of a causal conv's buffer with norm(x); x is let go once read
        (a conv's output feeding only this norm is freed before the next conv runs)."""
        held = [x]
        return lambda out: rms_norm_silu(_rows(held.pop()), gamma, bias=bias, out=_rows(out))

    @staticmethod
    def _apply(conv: _Conv, x: torch.Tensor, residual=None) -> torch.Tensor:
        """conv(x) + bias [+ residual], x [N, C, *S] channels last -> [N, *S', C_out]."""
        y = (F.conv3d if x.dim() == 5 else F.conv2d)(x, conv.weight, conv.bias, padding=conv.pad)
        return _last(y if residual is None else y.add_(residual))

    def _causal(self, conv: _Conv, caches: list, i: int, steps: int, fill,
                residual=None) -> torch.Tensor:
        """The causal conv of cache entry i over [cache, input]: ``fill(dst)`` writes the
        input's ``steps`` steps into the buffer after the two cached ones; ``residual``
        [B, T, H, W, C_out] is added to the output."""
        c = caches[i]                                         # [B, 2, H, W, C]
        buf = c.new_empty(c.shape[0], 2 + steps, *c.shape[2:])
        buf[:, :2].copy_(c)
        fill(buf[:, 2:])
        c.copy_(buf[:, -2:])                                  # the next chunk's two steps
        return self._apply(conv, buf.movedim(-1, 1),          # [B, T, H, W, C_out]
                           None if residual is None else residual.movedim(-1, 1))

    def _res(self, w, x, caches, i1, i2):
        gamma1, conv1, gamma2, bias1, conv2, short = w
        h = x if short is None else F.linear(x, *short)      # [B, T, H, W, C_out]
        T = x.shape[1]
        norm2 = self._norm_into(self._causal(conv1, caches, i1, T, self._norm_into(x, gamma1)),
                                gamma2, bias1)           # holds conv1's output, alone
        return self._causal(conv2, caches, i2, T, norm2, residual=h)

    @staticmethod
    def _attn(w, x):
        gamma, (wqkv, bqkv), (wp, bp) = w
        B, T, H, W, C = x.shape
        n = rms_norm_silu(_rows(x), gamma, silu=False).view(B * T, H * W, C)
        q, k, v = F.linear(n, wqkv, bqkv).unsqueeze(1).chunk(3, dim=-1)   # [BT, 1, HW, C]
        o = F.scaled_dot_product_attention(q, k, v).squeeze(1)           # [BT, HW, C]
        return F.linear(o, wp, bp).view(B, T, H, W, C).add_(x)

    def _up(self, w, x, caches, idx, first):
        time, spatial = w
        B, T, H, W, C = x.shape
        if time is not None:
            i = next(idx)
            if not first:      # a video's first frame skips the time conv (its cache stays 0)
                y = self._causal(time, caches, i, T, lambda out: out.copy_(x))
                # channels [2, C]: sub-step s of step t becomes step 2t + s
                x = y.view(B, T, H, W, 2, C).permute(0, 1, 4, 2, 3, 5).contiguous()
                T *= 2
        f = x.view(B * T, H, W, C).movedim(-1, 1)                         # [BT, C, H, W]
        f = F.interpolate(f, scale_factor=2.0, mode="nearest")
        f = self._apply(spatial, f)
        return f.view(B, T, 2 * H, 2 * W, f.shape[-1])


def fused_chunk_program(fused: FusedDecoder, arena, *, first: bool, mean: torch.Tensor,
                        inv_std: torch.Tensor, write: bool = True):
    """The chunk callable ``fn(latents, rows) -> frames`` of `vae_graph.chunk_program`'s
    contract, run by ``fused`` over a channels-last ``arena``."""

    @torch.no_grad()
    def fn(latents: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        B, _, Fr = latents.shape[:3]
        x = _last(fused.post_quant(latents / inv_std + mean))          # [B, F, h, w, z]
        if first:
            caches = [t.new_zeros(B, *t.shape[1:]) for t in arena.rows_last]
        else:
            caches = arena.gather(rows)                                 # [B, 2, H, W, C]
        parts = [fused.forward(x[:, :1], caches, True)] if first else []
        if Fr > len(parts):
            parts.append(fused.forward(x[:, len(parts):], caches, False))
        if write:
            arena.scatter(rows, caches)
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)   # [B, F', H, W, 3]
        out = torch.empty(y.shape[0], 3, *y.shape[1:4], dtype=y.dtype, device=y.device)
        return torch.clamp(y.movedim(-1, 1), -1.0, 1.0, out=out)       # one pass

    return fn
