"""The channels-last building blocks of the Wan 2.1 VAE's fused programs (`FusedBlocks`:
the decoder's `vae_fused.FusedDecoder`, the encoder's `vae_encoder_fused.FusedEncoder`):
causal convs over their cached steps, residual blocks, the mid block's attention, and a
pass that walks a stack of them; each program adds its own resampling blocks. They
give what diffusers' modules give, up to bf16 rounding, in a fraction of the memory
traffic. What differs from running the modules, and why each is exact:

* Every activation is [B, T, H, W, C] (channels last), every conv weight channels
  last: cuDNN's convolutions run on that layout natively, so no NCHW<->NHWC
  conversion runs around each of them. A 1x1x1 shortcut is a matmul over C. Each
  conv, with its bias and a residual block's residual, is one
  `framekv.engine.fused_conv.conv_add`: per geometry the fastest of torch's conv and
  cuDNN's plans (the adds in the conv's epilogue, or after it).
* ``WanRMS_norm`` + SiLU is one kernel (`framekv.ops.rms_silu`), reading the
  activation once and writing its result straight into the next causal conv's input
  buffer after the conv's two cached steps ([B, 2 + T, H, W, C]); the conv then pads
  only H and W (its own zero padding, no copy). The module's ``F.pad`` and
  ``torch.cat([cache, x])`` copies, its fp32 round trip and its five bf16 roundings
  are gone (one rounding instead: the bf16 difference).
* All frames of a steady chunk pass at once: a causal conv over ``[cache, x_0 ..
  x_{T-1}]`` gives each step what a pass per frame (or per group) gives it (the same
  two steps before it); the norms, the spatial convs and the attention act per step.
  The next cache is the buffer's last two steps, as the modules keep them. A video's
  first chunk passes its first frame alone (`FusedBlocks.passes`), then the rest.
* A cache entry is read from the arena straight into the two steps before the conv's
  input in its buffer, and its next value written back straight from the buffer's
  last two (`vae_cache.ChunkCache`): one pass each way, no copy of the state between
  (a folded conv reads the entry's second step once more, into its second tap).
* No conv adds its bias in a pass of its own but a program's output conv; each bias
  goes where its output is read next. A residual block's first conv: the norm after
  it adds it (its output feeds nothing else), in fp32 before the norm. The residual
  stream is held without its pending bias, a [C] vector known when the program is
  built: the next norms add it in fp32, a shortcut's bias and the attention's
  projection bias take it in, and a resampling block adds it while copying its input.
  Sums are reordered (the bias joins the residual later): bf16 rounding, not more.
* A causal conv with fewer than `FOLD_BELOW` input channels runs as a 2-D conv over
  its three time taps stacked on the channels: the input buffer is [B, T, H, W, K],
  K >= 3 C' (step s, tap k in channels k C' .. k C' + C holds step s + k of ``[cache,
  x]``; C' >= C, the channels past C, and past the third tap, zero where a program
  pads a narrow input), all three taps written by one norm call from one read of its
  input, and the weight [C_out, K, 3, 3]. Same products, same sums; cuDNN's
  heuristics pick a far slower kernel for a 3-D conv of 96 channels than for a 2-D
  one of 288, and for a 2-D one of 24 channels than of 32.

Cache entries are those of `vae_cache.CacheLayout` in diffusers' order; the programs
keep them as [B, steps, H, W, C] (`CacheArena(channels_last=True)` stores them so).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from framekv.ops.rms_silu import rms_norm_silu

from ..fused_conv import conv_add

__all__ = ["FOLD_BELOW", "FusedBlocks"]

#: Causal convs with fewer input channels than this run with their time taps folded
#: into the channels (module doc).
FOLD_BELOW = 128


@dataclasses.dataclass(frozen=True)
class _Conv:
    weight: torch.Tensor          # [C_out, C_in, kt, kh, kw] or, folded, [C_out, 3 C', kh, kw]
    bias: torch.Tensor | None
    pad: tuple[int, ...]          # (0, ph, pw): time is padded by the cached steps; folded (ph, pw)
    out: int                      # output channels kept (the rest are padding)
    folded: bool = False          # time taps stacked on the input channels (module doc)
    stride: tuple[int, ...] | int = 1
    width: int = 0                # folded: channels a tap (C'); the 3 taps, then zeros


def conv_weights(w: torch.Tensor, b, pad: tuple[int, ...], *, stride=1, pad_out_to: int = 1,
                 fold_below: int = 0, pad_in_to: int = 1, pad_folded_to: int = 1) -> _Conv:
    """A conv's weight ``w`` [C_out, C_in, ...] and bias channels last, its output channels
    zero-padded to a multiple of ``pad_out_to``; a 3-D conv of 3 time taps and fewer than
    ``fold_below`` input channels folded (module doc), each tap's channels zero-padded
    to a multiple of ``pad_in_to`` and the taps together to one of ``pad_folded_to``
    (zero weights past the third tap). ``pad``: a 3-D conv's (0, ph, pw), a 2-D conv's."""
    out = w.shape[0]
    extra = -out % pad_out_to
    if extra:
        w = torch.cat([w, w.new_zeros(extra, *w.shape[1:])])
        b = None if b is None else torch.cat([b, b.new_zeros(extra)])
    if w.dim() == 4:
        return _Conv(w.contiguous(memory_format=torch.channels_last), b, pad, out, stride=stride)
    if w.shape[2] == 3 and w.shape[1] < fold_below and stride in (1, (1, 1, 1)):
        wide = -w.shape[1] % pad_in_to
        if wide:
            w = torch.cat([w, w.new_zeros(w.shape[0], wide, *w.shape[2:])], dim=1)
        width = w.shape[1]
        # [C_out, C', 3, kh, kw] -> [C_out, 3 C', kh, kw]: channel k C' + c is tap k
        w = w.transpose(1, 2).reshape(w.shape[0], -1, *w.shape[3:])
        extra = -w.shape[1] % pad_folded_to
        if extra:
            w = torch.cat([w, w.new_zeros(w.shape[0], extra, *w.shape[2:])], dim=1)
        return _Conv(w.contiguous(memory_format=torch.channels_last), b, pad[1:], out, True,
                     width=width)
    return _Conv(w.contiguous(memory_format=torch.channels_last_3d), b, pad, out, stride=stride)


def _conv(m, pad_out_to: int = 1, fold_below: int = 0) -> _Conv:
    """`conv_weights` of a module: an ``nn.Conv2d`` or a diffusers ``WanCausalConv3d``."""
    w, b = m.weight.detach(), None if m.bias is None else m.bias.detach()
    pad = tuple(m.padding) if w.dim() == 4 else (0, m._padding[2], m._padding[0])
    return conv_weights(w, b, pad, stride=tuple(m.stride), pad_out_to=pad_out_to,
                        fold_below=fold_below)


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


def mid_modules(mid) -> list:
    """A ``WanMidBlock``'s modules in order: residual block, then attention and residual
    block pairs."""
    modules = [mid.resnets[0]]
    for attn, res in zip(mid.attentions, mid.resnets[1:]):
        modules += [attn, res]
    return modules


class FusedBlocks:
    """A fused program's stack: ``conv_in``, ``blocks`` (("res", `_Res`), ("attn", ...),
    ("resample", a subclass's weights whose first item is its time conv or None)),
    ``norm_out`` (gamma, pending bias) and ``conv_out``; `forward` runs it over one
    pass of steps. Subclasses build it with `_walk` and define ``_resample_weights(m,
    pending) -> (weights, pending after)`` and ``_resample(w, x, caches, idx, first)``.
    ``fold_below``: the causal convs with fewer input channels run with their time
    taps folded (default `FOLD_BELOW`; 0 folds none)."""

    def __init__(self, fold_below: int | None = None):
        self.fold_below = FOLD_BELOW if fold_below is None else fold_below

    def _walk(self, conv_in: _Conv, modules: list, norm_out, conv_out: _Conv) -> None:
        """The stack of ``modules`` between ``conv_in`` and ``norm_out`` + ``conv_out``,
        the pending bias walking it in order (module doc)."""
        self.conv_in, pending = _unbiased(conv_in), _plus(None, conv_in.bias)
        self.blocks: list = []
        for m in modules:
            if hasattr(m, "conv1"):
                res = self._res_weights(m, pending)
                pending = None if res.short is not None else _plus(pending, m.conv2.bias)
                self.blocks.append(("res", res))
            elif hasattr(m, "to_qkv"):
                self.blocks.append(("attn", self._attn_weights(m, pending)))
                pending = None
            else:
                w, pending = self._resample_weights(m, pending)
                self.blocks.append(("resample", w))
        self.norm_out = (norm_out.gamma.detach().reshape(-1), pending)
        self.conv_out = conv_out
        # cache entries in diffusers' order: conv_in, two per residual block, one per
        # resampling block with a time conv, conv_out
        self.entries = 2 + sum(2 if kind == "res" else int(kind == "resample" and w[0] is not None)
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

    # ------------------------------------------------------------------ forward
    def passes(self, x: torch.Tensor, caches, first: bool) -> list[torch.Tensor]:
        """A chunk's passes over x [B, T, H, W, C_in] (`forward`): a video's first frame
        alone when ``first``, then the rest at once."""
        parts = [self.forward(x[:, :1], caches, True)] if first else []
        if x.shape[1] > len(parts):
            parts.append(self.forward(x[:, len(parts):], caches, False))
        return parts

    def forward(self, x: torch.Tensor, caches, first: bool) -> torch.Tensor:
        """One pass of x [B, T, H, W, C_in] -> conv_out's kept channels [B, T', H', W',
        C_out] (a view; without its bias when the subclass keeps it apart). ``first``:
        a video's first frame alone. ``caches``: the chunk's `vae_cache.ChunkCache`, each
        entry [B, steps, H, W, C] read, then given its next value."""
        idx = iter(range(self.entries))
        x = self._causal(self.conv_in, caches, next(idx), _copy_into(x))
        for kind, w in self.blocks:
            if kind == "res":
                x = self._res(w, x, caches, next(idx), next(idx))
            elif kind == "attn":
                x = self._attn(w, x)
            else:
                x = self._resample(w, x, caches, idx, first)
        gamma, pending = self.norm_out
        y = self._causal(self.conv_out, caches, next(idx), _norm_into(x, gamma, pending))
        return y[..., :self.conv_out.out]

    @staticmethod
    def _apply(conv: _Conv, x: torch.Tensor, residual=None) -> torch.Tensor:
        """conv(x) + bias [+ residual], x [N, C, *S] channels last -> [N, *S', C_out]
        (`framekv.engine.fused_conv.conv_add`: each geometry its fastest way)."""
        return _last(conv_add(x, conv.weight, conv.bias, residual, conv.pad, conv.stride))

    def _causal(self, conv: _Conv, caches, i: int, fill: "_Fill",
                residual=None) -> torch.Tensor:
        """The causal conv of cache entry i over [cache, input]: the entry is read into
        the conv's buffer and its next value written from it (``caches``, a
        `vae_cache.ChunkCache`); ``fill`` writes the input's steps into the buffer;
        ``residual`` [B, T, H, W, C_out] is added to the output [B, T, H, W, C_out]."""
        T = fill.steps
        if conv.folded:
            x = self._fold(caches, i, fill, conv)             # [B, T, H, W, K]
            B, _, H, W, _ = x.shape
            r = None if residual is None else residual.reshape(B * T, H, W, -1).movedim(-1, 1)
            y = self._apply(conv, x.view(B * T, H, W, -1).movedim(-1, 1), r)
            return y.view(B, T, *y.shape[1:])
        buf = caches.empty(i, 2 + T)                          # [B, 2 + T, H, W, C]
        caches.load(i, buf[:, :2])
        fill([buf[:, 2:]], [T])
        caches.store(i, buf[:, -2:])                          # the next chunk's two steps
        return self._apply(conv, buf.movedim(-1, 1),          # [B, T, H, W, C_out]
                           None if residual is None else residual.movedim(-1, 1))

    @staticmethod
    def _fold(caches, i: int, fill: "_Fill", conv: _Conv) -> torch.Tensor:
        """The folded conv's input [B, T, H, W, K]: ``conv.width`` channels a tap, step s,
        tap k holding step s + k of [c0, c1, x0, ..] (channels past the entry's C, and
        past the third tap, zero); entry i becomes that sequence's last two steps."""
        T, width = fill.steps, conv.width
        c = caches.tensors[i]                                 # [S, 2, H, W, C]
        C, K = c.shape[4], conv.weight.shape[1]
        buf = (c.new_empty if 3 * C == K else c.new_zeros)(caches.batch, T, *c.shape[2:4], K)
        tap = [buf[..., k * width:k * width + C] for k in range(3)]   # [B, T, H, W, C] each
        n = min(T, 2)                     # the entry's steps tap 0 holds: c0 (and c1)
        caches.load(i, tap[0][:, :n], steps=slice(0, n))
        caches.load(i, tap[1][:, :1], steps=slice(1, 2))              # c1, read again
        ks = [k for k in range(3) if T - 2 + k > 0]
        fill([tap[k][:, 2 - k:] for k in ks], [T - 2 + k for k in ks])   # x read once
        # T = 1: the next entry is [c1, x0], c1 still in tap 1 (fill wrote tap 2 alone)
        caches.store(i, tap[2][:, -2:] if T >= 2 else torch.cat([tap[1][:, :1], tap[2]], dim=1))
        return buf

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
        q, k, v = F.linear(n, wqkv, bqkv).chunk(3, dim=-1)               # [BT, HW, C]
        return F.linear(_attention(q, k, v), wp, bp).view(B, T, H, W, C).add_(x)


#: Head sizes up to this run in PyTorch's fused attention; wider ones (the Wan VAE's
#: one head of 384) by `_attention`'s two matmuls.
FUSED_HEAD_MAX = 256


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of one head, q, k, v [N, L, C] -> [N, L, C]. A head wider than
    `FUSED_HEAD_MAX` has no flash or cuDNN kernel and PyTorch's fallback is slow: the
    scores [L, L] are one batched matmul of q and k (the scale applied to the fp32
    accumulator) in q's dtype, the softmax reads them and accumulates in fp32, its
    probabilities rounded once to q's dtype, then one matmul with v; frame by frame,
    so the scores take L^2 elements at a time."""
    if q.shape[-1] <= FUSED_HEAD_MAX:
        return F.scaled_dot_product_attention(q, k, v)
    L, scale = q.shape[1], q.shape[-1] ** -0.5
    out = torch.empty_like(q)
    for n in range(q.shape[0]):
        s = torch.baddbmm(q.new_empty(()).expand(1, L, L), q[n:n + 1], k[n:n + 1].transpose(1, 2),
                          beta=0, alpha=scale)                           # [1, L, L]
        torch.bmm(torch.softmax(s, dim=-1), v[n:n + 1], out=out[n:n + 1])
    return out


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
