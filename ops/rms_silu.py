"""``rms_norm_silu``: an RMS norm over a tensor's last dimension, times a scale and a
per-channel gamma, optionally followed by SiLU, in one kernel; an optional per-channel
bias is added to x first.

Contract (x [B, M, N], rows (b, m) of N values)::

    z   = x + bias                                     # fp32; bias 0 when None
    y   = z / max(||z||_2, eps) * scale * gamma        # fp32, scale default sqrt(N)
    out = silu(y) if silu else y                       # rounded once to out's dtype

This is the Wan VAE's ``WanRMS_norm`` (``F.normalize`` over the channels, times
sqrt(C) and gamma) and the SiLU after it: there six kernels and an fp32 round trip of
the whole tensor, here one read and one write. The unfused module rounds to bf16
after the normalize, after each product and after the SiLU; this op rounds once, so
its bf16 result is within a few bf16 steps of the module's and closer to fp32. The
bias is a convolution's, when that convolution's output feeds only this norm: added
here it costs no pass of its own.

Rows are (b, m) with out[b] free to be a slice of a larger buffer (a causal conv's
input after its cached steps): only the last dimension must be contiguous. Tensors
are bf16 or fp32, each its own. ``out`` may be up to `MAX_OUTS` tensors [B, M_i, N],
M_i <= M, each given the first M_i rows of the result: the time taps of a folded
causal conv's input are the same steps at three offsets, written from one read of x.

Kernel: a segment of g lanes per row (g a power of two <= 32, the smallest with
g * 12 >= N), each lane holding k groups of four values (k = ceil(N / 4g), at most
`MAX_N` / 128): group q of lane l is values 4 (l + g q) .. + 3, one 8- or 16-byte
access when every tensor is `vector_aligned` (N a multiple of 4, the usual case),
else four checked scalar accesses. The squares' sum is a butterfly of shuffles over the
segment (`segment_total`); a block of `_BLOCK` threads holds `_BLOCK` / g rows; the
rows past the end compute on row 0 and store nothing, so every lane meets every
shuffle. Nothing syncs with the host or allocates: graph-capturable. One file: one
op (kernel, reference, validating wrapper, custom op).
"""
from __future__ import annotations

import functools
import math
import struct
from typing import Optional

import torch
import torch.nn.functional as F
from numba import cuda
from numba import float32 as _f32
from numba import uint64 as _u64

from ._float import (bits_f32, check_float_dtype, load_f32, load_f32x4, quotient,
                     reciprocal_bits, store_f32, store_f32x4, vector_aligned)
from ._launch import SIMULATOR, Kernel, array_arg, int_arg, use_kernel
from ._reduce import WARP, segment_total
from framekv.specs.checks import (check_disjoint, check_last_dim_contiguous, check_no_overlap,
                                 check_tensor, rows_interleaved)

__all__ = ["rms_norm_silu", "rms_norm_silu_reference", "MAX_N", "MAX_OUTS"]

_SILU, _VEC, _BIAS = 1, 2, 4
_GROUPS_MAX = 8            # groups of four a lane holds: 32 registers of values
MAX_N = 4 * WARP * _GROUPS_MAX
_BLOCK = 8 if SIMULATOR else 256   # threads per block (the simulator: one thread each)
MAX_OUTS = 3               # a folded causal conv's three time taps


def _segment(n: int) -> tuple[int, int]:
    """(g, k): lanes per row and groups of four per lane for rows of n values."""
    g = 1
    while g < WARP and g * 12 < n:
        g *= 2
    return g, -(-n // (4 * g))


@functools.lru_cache(maxsize=None)
def _kernel(flags: int, n: int, g: int, k: int, nt: int, outs: int) -> Kernel:
    """The kernel for one row width (n, g, k, the flags and the output count compiled in
    as constants)."""
    vals, vec, act = 4 * k, (flags & _VEC) != 0, (flags & _SILU) != 0
    biased = (flags & _BIAS) != 0

    @cuda.jit(device=True)
    def _put(out, b, m, j, y):
        # four values y at row (b, m), columns j ..: rows past out's M_i are not its own
        if m < out.shape[1]:
            outr = out[_u64(b), _u64(m)]
            if vec:
                if j < n:
                    store_f32x4(outr, (j,), y)
            else:
                for i in range(4):
                    if j + i < n:
                        store_f32(outr, (j + i,), y[i])

    @cuda.jit
    def _rms_silu_kernel(x, out0, out1, out2, gamma, bias, scale_bits, eps_bits, inv_m):
        # x: [B, M, N], out_i: [B, M_i, N] float bits (out1, out2 unread past ``outs``);
        # gamma, bias: [N] (bias unread unless biased); one row per segment of g lanes.
        part = cuda.shared.array(_BLOCK if _BLOCK > WARP else WARP, _f32)  # simulator sums
        v = cuda.local.array(vals, _f32)
        t = cuda.threadIdx.x
        lane = t % g
        row = cuda.blockIdx.x * (nt // g) + t // g
        M = x.shape[1]
        live = row < x.shape[0] * M
        r = row if live else 0
        b = quotient(r, inv_m)
        m = r - b * M
        xr = x[_u64(b), _u64(m)]
        acc = _f32(0)
        for q in range(k):
            j = 4 * (lane + g * q)
            for i in range(4):
                v[4 * q + i] = _f32(0)
            if vec:
                if j < n:
                    v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3] = load_f32x4(xr, (j,))
            else:
                for i in range(4):
                    if j + i < n:
                        v[4 * q + i] = load_f32(xr, (j + i,))
            for i in range(4):
                if biased and j + i < n:
                    v[4 * q + i] += load_f32(bias, (j + i,))
                acc += v[4 * q + i] * v[4 * q + i]
        total = segment_total(acc, part, t, nt, g)
        eps = bits_f32(eps_bits)
        norm = _f32(math.sqrt(total))
        mul = bits_f32(scale_bits) / (norm if norm > eps else eps)
        if live:
            for q in range(k):
                j = 4 * (lane + g * q)
                for i in range(4):
                    y = _f32(0)
                    if j + i < n:
                        y = v[4 * q + i] * mul * load_f32(gamma, (j + i,))
                    if act:
                        y = y / (_f32(1) + _f32(math.exp(-y)))
                    v[4 * q + i] = y
                y4 = (v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3])
                _put(out0, b, m, j, y4)
                if outs > 1:
                    _put(out1, b, m, j, y4)
                if outs > 2:
                    _put(out2, b, m, j, y4)

    return Kernel(_rms_silu_kernel)


# --------------------------------------------------------------------------- reference


def rms_norm_silu_reference(x, gamma, *, bias=None, scale=None, silu=True, eps=1e-12,
                            out=None):
    """Torch reference of :func:`rms_norm_silu` (same arguments): fp32, rounded once."""
    s = math.sqrt(x.shape[-1]) if scale is None else float(scale)
    z = x.float() if bias is None else x.float() + bias.float()
    y = F.normalize(z, dim=-1, eps=eps) * s * gamma.float()
    if silu:
        y = F.silu(y)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for o in _as_tuple(out):
        o.copy_(y[:, :o.shape[1]])
    return out


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# --------------------------------------------------------------------------- op


def _f32_bits(value: float) -> int:
    return struct.unpack("<i", struct.pack("<f", value))[0]


def _execute(x, gamma, bias, outs, scale: float, silu: bool, eps: float) -> None:
    if x.numel() == 0:
        return
    if not use_kernel(x):
        rms_norm_silu_reference(x, gamma, bias=bias, scale=scale, silu=silu, eps=eps, out=outs)
        return
    B, M, N = x.shape
    g, k = _segment(N)
    nt = max(g, _BLOCK)
    vec = all(vector_aligned(t) for t in (x, gamma, *outs))
    flags = (_SILU if silu else 0) | (_VEC if vec else 0) | (0 if bias is None else _BIAS)
    out_args = [array_arg(o) for o in outs]
    out_args += [out_args[0]] * (MAX_OUTS - len(outs))      # never written past len(outs)
    args = [array_arg(x), *out_args, array_arg(gamma),
            array_arg(gamma if bias is None else bias), int_arg(_f32_bits(scale)),
            int_arg(_f32_bits(eps)), int_arg(reciprocal_bits(M))]
    _kernel(flags, N, g, k, nt, len(outs)).launch(-(-B * M // (nt // g)), nt, args, x.device)


@torch.library.custom_op("framekv::rms_norm_silu", mutates_args=("out0", "out1", "out2"))
def _rms_norm_silu_op(x: torch.Tensor, gamma: torch.Tensor, bias: Optional[torch.Tensor],
                      out0: torch.Tensor, out1: Optional[torch.Tensor],
                      out2: Optional[torch.Tensor], scale: float, silu: bool, eps: float) -> None:
    outs = tuple(o for o in (out0, out1, out2) if o is not None)
    _execute(x, gamma, bias, outs, scale, silu, eps)


@_rms_norm_silu_op.register_fake
def _(x, gamma, bias, out0, out1, out2, scale, silu, eps) -> None:
    return None


def _check_channels(name: str, t, x) -> None:
    """gamma or bias: [N] float on x's device, contiguous."""
    N = x.shape[2]
    check_tensor(name, t, ndims=(1,), layout="[N]")
    check_float_dtype(name, t)
    if t.shape[0] != N or t.device != x.device:
        raise ValueError(f"{name}: expected [{N}] on {x.device} (N and device of x), got "
                         f"{list(t.shape)} on {t.device}")
    check_last_dim_contiguous(name, t)


def _check(x, gamma, bias) -> None:
    check_tensor("x", x, ndims=(3,), layout="[B, M, N]")
    check_float_dtype("x", x)
    check_last_dim_contiguous("x", x)
    N = x.shape[2]
    if N > MAX_N:
        raise ValueError(f"x: expected N <= {MAX_N} (a row in the registers of at most 32 "
                         f"lanes), got N = {N}")
    _check_channels("gamma", gamma, x)
    if bias is not None:
        _check_channels("bias", bias, x)


def _check_outs(outs: tuple, x, gamma, bias) -> None:
    """Each out [B, M_i, N], 1 <= M_i <= M, on x's device; none overlapping x, gamma,
    bias or another out."""
    if not 1 <= len(outs) <= MAX_OUTS:
        raise ValueError(f"out: expected a tensor or 1 to {MAX_OUTS} tensors, got {len(outs)}")
    B, M, N = x.shape
    inputs = [("x", x), ("gamma", gamma)] + ([] if bias is None else [("bias", bias)])
    for i, o in enumerate(outs):
        name = "out" if len(outs) == 1 else f"out[{i}]"
        check_tensor(name, o, ndims=(3,), layout="[B, M_i, N]")
        check_float_dtype(name, o)
        if (o.shape[0], o.shape[2]) != (B, N) or not 1 <= o.shape[1] <= M or o.device != x.device:
            raise ValueError(f"{name}: expected [{B}, M_i, {N}] with 1 <= M_i <= {M} on "
                             f"{x.device} (B, M, N and device of x), got {list(o.shape)} on "
                             f"{o.device}")
        check_last_dim_contiguous(name, o)
        check_no_overlap(name, o)
        check_disjoint(name, o, inputs + [(f"out[{j}]", p) for j, p in enumerate(outs[:i])
                                          if not rows_interleaved(o, p)])


def rms_norm_silu(x: torch.Tensor, gamma: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                  scale: Optional[float] = None, silu: bool = True, eps: float = 1e-12,
                  out=None):
    """RMS norm of ``x + bias`` over the last dimension, times ``scale`` and ``gamma``,
    then SiLU when ``silu``; returns ``out`` (module doc).

    Args:
        x: [B, M, N] bf16 or fp32, N contiguous (N <= `MAX_N`), other strides free.
        gamma: [N] bf16 or fp32 on x's device.
        bias: None or [N] bf16 or fp32 on x's device, added to x before the norm.
        scale: a finite number (default sqrt(N), as ``WanRMS_norm``).
        silu: apply SiLU after the norm.
        eps: the norm's floor (``F.normalize``'s), a finite number >= 0.
        out: None (a new contiguous tensor like x), a tensor [B, M, N], or a tuple of 1
            to `MAX_OUTS` tensors [B, M_i, N] with 1 <= M_i <= M, each given the result's
            first M_i rows; bf16/fp32, N contiguous, none overlapping x, gamma, bias or
            another.

    Raises ValueError naming the bad argument before anything is written. One kernel on
    torch's current stream for CUDA tensors (one read of x, whatever the outputs); the
    torch reference on CPU.
    """
    _check(x, gamma, bias)
    scale = math.sqrt(x.shape[2]) if scale is None else scale
    for name, v, low in (("scale", scale, -math.inf), ("eps", eps, 0.0)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v < math.inf:
            raise ValueError(f"{name}: expected a finite number{'' if low < 0 else ' >= 0'}, "
                             f"got {v!r}")
    if not isinstance(silu, bool):
        raise ValueError(f"silu: expected True or False, got {silu!r}")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    outs = _as_tuple(out)
    if isinstance(out, torch.Tensor) and out.shape != x.shape:
        raise ValueError(f"out: expected shape {list(x.shape)} on {x.device} (those of x), "
                         f"got {list(out.shape)} on {out.device}")
    _check_outs(outs, x, gamma, bias)
    _rms_norm_silu_op(x, gamma, bias, *outs, *[None] * (MAX_OUTS - len(outs)), float(scale),
                      silu, float(eps))
    return out
