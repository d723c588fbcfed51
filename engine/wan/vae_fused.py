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
* No conv but the output conv adds its bias in a pass of its own; each bias goes
  where its output is read next. A residual block's first conv: the norm after it
  adds it (its output feeds nothing else), in fp32 before the norm. The residual
  stream (conv_in's output, each block's conv2 + residual) is held without its
  pending bias, a [C] vector known when the decoder is built: the next norms add it
  in fp32, a shortcut's bias and the attention's projection bias take it in, and an
  upsample adds it while copying its input (time conv) or in one pass at the low
  resolution. A time conv's bias is added by the copy that orders its sub-steps, a
  phase conv's by the copies that interleave its phases. Sums are reordered (the
  bias joins the residual later): bf16 rounding, not more.
* A causal conv with fewer than `FOLD_BELOW` input channels runs as a 2-D conv over
  its three time taps stacked on the channels: the input buffer is [B, T, H, W, 3, C]
  (step s, tap k holds step s + k of ``[cache, x]``), all three taps written by one
  norm call from one read of its input, and the weight [C_out, 3 C, 3, 3]. Same
  products, same sums; cuDNN's heuristics pick a far slower kernel for a 3-D conv of
  96 channels than for a 2-D one of 288.
* A nearest 2x upsample and the 3x3 conv after it are one 2x2 conv of the small
  input to four output phases ((row, column) parity: the 3x3 taps that land on the
  same input pixel are summed into one, in fp32 before the weight's rounding), the
  phases then interleaved by four strided copies: 16 instead of 36 products per input
  pixel, and the 4x larger upsampled input is never written.
* The 3-channel output conv runs with its channels zero-padded to 8 (cuDNN's
  channels-last kernels want multiples of 8).

Cache entries are those of `vae_graph.CacheLayout` in diffusers' order; the fused
program keeps them as [B, 2, H, W, C] (`CacheArena(channels_last=True)` stores them so).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from framekv.ops.rms_silu import rms_norm_silu

__all__ = ["FusedDecoder", "fused_chunk_program", "FOLD_BELOW"]

#: Causal convs with fewer input channels than this run with their time taps folded
#: into the channels (module doc).
FOLD_BELOW = 128


@dataclasses.dataclass(frozen=True)
class _Conv:
    weight: torch.Tensor          # [C_out, C_in, kt, kh, kw] or, folded, [C_out, 3 C_in, kh, kw]
    bias: torch.Tensor | None
    pad: tuple[int, ...]          # (0, ph, pw): time is padded by the cached steps; folded (ph, pw)
    out: int                      # output channels kept (the rest are padding)
    folded: bool = False          # time taps stacked on the input channels (module doc)


def _conv(m, pad_out_to: int = 1, fold_below: int = 0) -> _Conv:
    w, b = m.weight.detach(), None if m.bias is None else m.bias.detach()
    out = w.shape[0]
    extra = -out % pad_out_to
    if extra:
        w = torch.cat([w, w.new_zeros(extra, *w.shape[1:])])
        b = None if b is None else torch.cat([b, b.new_zeros(extra)])
    if w.dim() == 4:
        return _Conv(w.contiguous(memory_format=torch.channels_last), b, tuple(m.padding), out)
    pad = (0, m._padding[2], m._padding[0])
    if w.shape[2] == 3 and w.shape[1] < fold_below:
        # [C_out, C_in, 3, kh, kw] -> [C_out, 3 C_in, kh, kw]: channel k C_in + c is tap k
        w = w.transpose(1, 2).reshape(w.shape[0], -1, *w.shape[3:])
        return _Conv(w.contiguous(memory_format=torch.channels_last), b, pad[1:], out, True)
    return _Conv(w.contiguous(memory_format=torch.channels_last_3d), b, pad, out)


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


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[B, T, H, W, C] (a slice of a buffer too) as [B, T*H*W, C], a view."""
    return t.view(t.shape[0], -1, t.shape[-1])


def _last(y: torch.Tensor) -> torch.Tensor:
    """A conv's [N, C, ...] output as [N, ..., C] (free when it is channels last)."""
    y = y.movedim(1, -1)
    return y if y.is_contiguous() else y.contiguous()


@dataclasses.dataclass(frozen=True)
class _Res:
    """A residual block: x arrives held without ``pending`` (added by norm1 and, with a
    shortcut, its bias); the block's output is held without its ``pending`` after."""
    gamma1: torch.Tensor
    pending: torch.Tensor | None      # x's pending bias [C_in], fp32
    conv1: _Conv                      # without its bias: norm2 adds ``bias1``
    gamma2: torch.Tensor
    bias1: torch.Tensor | None
    conv2: _Conv                      # without its bias: it is pending after the block
    short: tuple | None               # (weight [C_out, C_in], bias [C_out]) with biases folded in


def _plus(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """Two pending biases summed in fp32 (None: none)."""
    if b is None:
        return a
    return b.detach().float() if a is None else a + b.detach().float()


def _unbiased(conv: _Conv) -> _Conv:
    return dataclasses.replace(conv, bias=None)


class FusedDecoder:
    """The decoder's weights, channels last, and its forward over a pass of steps
    (module doc). Built from a Wan 2.1 ``AutoencoderKLWan`` (checked by its caller);
    holds its own copies of the conv weights, shares the rest. ``fold_below``: the
    causal convs with fewer input channels run with their time taps folded (default
    `FOLD_BELOW`; 0 folds none)."""

    def __init__(self, vae, *, fold_below: int | None = None):
        d = vae.decoder
        self.post_quant = vae.post_quant_conv
        self.fold_below = FOLD_BELOW if fold_below is None else fold_below
        conv_in = self._causal_conv(d.conv_in)
        self.conv_in, pending = _unbiased(conv_in), _plus(None, conv_in.bias)
        self.blocks: list = []
        modules = [d.mid_block.resnets[0]]
        for attn, res in zip(d.mid_block.attentions, d.mid_block.resnets[1:]):
            modules += [attn, res]
        for up in d.up_blocks:
            modules += list(up.resnets) + ([] if up.upsamplers is None else [up.upsamplers[0]])
        for m in modules:     # the pending bias walks the blocks in order (module doc)
            if hasattr(m, "conv1"):
                res = self._res_weights(m, pending)
                pending = None if res.short is not None else _plus(pending, m.conv2.bias)
                self.blocks.append(("res", res))
            elif hasattr(m, "to_qkv"):
                self.blocks.append(("attn", self._attn_weights(m, pending)))
                pending = None
            else:
                self.blocks.append(("up", self._up_weights(m, pending)))
                pending = None
        self.norm_out = (d.norm_out.gamma.detach().reshape(-1), pending)
        self.conv_out = self._causal_conv(d.conv_out, pad_out_to=8)
        # cache entries in diffusers' order: conv_in, two per residual block, one per
        # time upsample, conv_out
        self.entries = 2 + sum(2 if kind == "res" else int(kind == "up" and w[0] is not None)
                               for kind, w in self.blocks)

    def _causal_conv(self, m, pad_out_to: int = 1) -> _Conv:
        return _conv(m, pad_out_to, self.fold_below)

    def _res_weights(self, r, pending) -> _Res:
        conv1, conv2, short = self._causal_conv(r.conv1), self._causal_conv(r.conv2), None
        if not isinstance(r.conv_shortcut, torch.nn.Identity):
            w = r.conv_shortcut.weight.detach()
            w = w.reshape(w.shape[0], -1)                               # [C_out, C_in]
            b = r.conv_shortcut.bias.detach().float() + conv2.bias.float()
            if pending is not None:
                b = b + w.float() @ pending
            short = (w, b.to(w.dtype))
        return _Res(r.norm1.gamma.detach().reshape(-1), pending, _unbiased(conv1),
                    r.norm2.gamma.detach().reshape(-1), conv1.bias, _unbiased(conv2), short)

    @staticmethod
    def _attn_weights(a, pending):
        def flat(m):
            return m.weight.detach().reshape(m.weight.shape[0], -1), m.bias.detach()
        wp, bp = flat(a.proj)
        bp = bp if pending is None else (bp.float() + pending).to(bp.dtype)
        return a.norm.gamma.detach().reshape(-1), pending, flat(a.to_qkv), (wp, bp)

    def _up_weights(self, u, pending):
        time = self._causal_conv(u.time_conv) if u.mode == "upsample3d" else None
        conv = u.resample[1]
        bias = None if conv.bias is None else conv.bias.detach()
        time_bias = None if time is None or time.bias is None else time.bias.view(2, 1, 1, -1)
        return (None if time is None else _unbiased(time), time_bias,
                _unbiased(_upsample_conv(conv)), bias, pending)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, caches: list, first: bool) -> torch.Tensor:
        """One pass: x [B, T, h, w, z] post-quant latents -> [B, T', 8h, 8w, 3] frames
        (unclamped), T' = 4T, or 1 for a video's first frame alone (``first``, T = 1).
        ``caches``: per entry [B, 2, H, W, C], read, then overwritten with the next."""
        idx = iter(range(self.entries))
        x = self._causal(self.conv_in, caches, next(idx), _copy_into(x))
        for kind, w in self.blocks:
            if kind == "res":
                x = self._res(w, x, caches, next(idx), next(idx))
            elif kind == "attn":
                x = self._attn(w, x)
            else:
                x = self._up(w, x, caches, idx, first)
        gamma, pending = self.norm_out
        y = self._causal(self.conv_out, caches, next(idx), _norm_into(x, gamma, pending))
        return y[..., :self.conv_out.out]

    @staticmethod
    def _apply(conv: _Conv, x: torch.Tensor, residual=None) -> torch.Tensor:
        """conv(x) + bias [+ residual], x [N, C, *S] channels last -> [N, *S', C_out]."""
        y = (F.conv3d if x.dim() == 5 else F.conv2d)(x, conv.weight, conv.bias, padding=conv.pad)
        return _last(y if residual is None else y.add_(residual))

    def _causal(self, conv: _Conv, caches: list, i: int, fill: "_Fill",
                residual=None) -> torch.Tensor:
        """The causal conv of cache entry i over [cache, input]: ``fill`` writes the
        input's steps into the conv's buffer; ``residual`` [B, T, H, W, C_out] is added
        to the output [B, T, H, W, C_out]."""
        c, T = caches[i], fill.steps                          # [B, 2, H, W, C]
        if conv.folded:
            x = self._fold(c, fill)                           # [B, T, H, W, 3 C]
            B, _, H, W, _ = x.shape
            r = None if residual is None else residual.reshape(B * T, H, W, -1).movedim(-1, 1)
            y = self._apply(conv, x.view(B * T, H, W, -1).movedim(-1, 1), r)
            return y.view(B, T, *y.shape[1:])
        buf = c.new_empty(c.shape[0], 2 + T, *c.shape[2:])
        buf[:, :2].copy_(c)
        fill([buf[:, 2:]], [T])
        c.copy_(buf[:, -2:])                                  # the next chunk's two steps
        return self._apply(conv, buf.movedim(-1, 1),          # [B, T, H, W, C_out]
                           None if residual is None else residual.movedim(-1, 1))

    @staticmethod
    def _fold(c: torch.Tensor, fill: "_Fill") -> torch.Tensor:
        """The folded conv's input: step s, tap k holds step s + k of [c0, c1, x0, ..];
        the cache c [B, 2, H, W, C] becomes that sequence's last two steps."""
        T = fill.steps
        buf = c.new_empty(c.shape[0], T, *c.shape[2:4], 3, c.shape[4])
        tap = [buf[..., k, :] for k in range(3)]              # [B, T, H, W, C] each
        tap[0][:, :2].copy_(c[:, :min(2, T)])
        tap[1][:, :1].copy_(c[:, 1:])
        ks = [k for k in range(3) if T - 2 + k > 0]
        fill([tap[k][:, 2 - k:] for k in ks], [T - 2 + k for k in ks])   # x read once
        if T == 1:
            c[:, :1].copy_(c[:, 1:])
        c[:, 2 - min(2, T):].copy_(tap[2][:, -min(2, T):])
        return buf.view(*buf.shape[:4], -1)

    def _res(self, w: _Res, x, caches, i1, i2):
        h = x if w.short is None else F.linear(x, *w.short)  # [B, T, H, W, C_out]
        # conv1's output is held by norm2's fill alone (no name here): freed once read
        norm2 = _norm_into(self._causal(w.conv1, caches, i1, _norm_into(x, w.gamma1, w.pending)),
                           w.gamma2, w.bias1, release=True)
        return self._causal(w.conv2, caches, i2, norm2, residual=h)

    @staticmethod
    def _attn(w, x):
        gamma, pending, (wqkv, bqkv), (wp, bp) = w
        B, T, H, W, C = x.shape
        n = rms_norm_silu(_rows(x), gamma, bias=pending, silu=False).view(B * T, H * W, C)
        q, k, v = F.linear(n, wqkv, bqkv).unsqueeze(1).chunk(3, dim=-1)   # [BT, 1, HW, C]
        o = F.scaled_dot_product_attention(q, k, v).squeeze(1)           # [BT, HW, C]
        return F.linear(o, wp, bp).view(B, T, H, W, C).add_(x)

    def _up(self, w, x, caches, idx, first):
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


class _Fill:
    """Writes a causal conv's input: ``fill(outs, counts)`` puts the input's first
    ``counts[i]`` steps into ``outs[i]`` [B, counts[i], H, W, C] (a folded conv's taps:
    the same steps at three offsets, one call); ``steps`` is the input's step count.
    With ``release`` the input is let go by the call that writes all its steps (a conv's
    output feeding only this norm is then freed before the next conv runs)."""

    def __init__(self, x: torch.Tensor, write, release: bool = False):
        self.steps, self._x, self._write, self._release = x.shape[1], x, write, release

    def __call__(self, outs: list, counts: list) -> None:
        x, n = self._x, max(counts)
        if self._release and n == self.steps:
            self._x = None
        self._write(x[:, :n], outs, counts)


def _biased_copy(out: torch.Tensor, src: torch.Tensor, bias=None) -> torch.Tensor:
    """out = src [+ bias, broadcast], one pass."""
    return out.copy_(src) if bias is None else torch.add(src, bias, out=out)


def _copy_into(x: torch.Tensor, bias=None) -> _Fill:
    def write(src, outs, counts):
        for out, n in zip(outs, counts):
            _biased_copy(out, src[:, :n], bias)
    return _Fill(x, write)


def _norm_into(x: torch.Tensor, gamma, bias=None, release: bool = False) -> _Fill:
    def write(src, outs, counts):
        rms_norm_silu(_rows(src), gamma, bias=bias, out=tuple(_rows(o) for o in outs))
    return _Fill(x, write, release)


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
