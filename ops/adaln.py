"""``adaln_`` and ``gated_residual_``: the adaptive LayerNorm and the gated residual of a
DiT block, each one kernel.

Contract (x [B, S, N]; rows are tokens (b, s); a modulation tensor [B, M, N] with M
dividing S gives token s its row ``s // (S // M)``: M = 1 per sequence, M = frames per
frame, M = S per token):

- ``gated_residual_(x, y, gate)``: ``x <- x + gate * y`` in fp32, rounded once to x's
  dtype (gate None = 1).
- ``adaln_(x, shift=, scale=, weight=, bias=, eps=, residual=, gate=, out=)``: first,
  with a residual, ``gated_residual_(x, residual, gate)``; then
  ``out = (LN(x) * weight + bias) * (1 + scale) + shift``, LN over N with fp32 mean and
  biased variance (as ``torch.nn.functional.layer_norm``), any factor None left out.
- ``adaln_(..., out=q, out_scale=s)`` with a float8_e4m3fn ``q`` (an fp8 GEMM's input):
  the same output rounded to x's dtype, then each token's row quantized as
  `framekv.ops.quantize_rows` does (``s = max(max|row| / 448, 2^-126)``, ``q =
  e4m3(row * (1 / s))``): bit for bit ``quantize_rows`` of the output ``adaln_`` writes
  in x's dtype, without that bf16 tensor or the pass reading it again.

Rounding points are those of the unfused fp32 glue (diffusers' Wan block, the reference
model's ``modulate``): the updated x is rounded once to x's dtype and stored, and the
norm reads that stored value (so the fused op equals ``x = (x.float() + g * r).to(x.dtype)``
followed by the norm); everything after is fp32, rounded once to out's dtype. Tensors
are bf16 or fp32, each free to differ from the others. The device may contract an
``a * b + c`` into one FMA, so a GPU result can differ from torch's by an fp32 ulp
before that last rounding.

Kernel: one CTA per row holding the whole row in registers:
at least N / 8 threads (whole warps), each with eight values in two groups of four
(N <= `MAX_N` = 8192). A group is four consecutive values in one 8-byte (bf16) or
16-byte (fp32) access when every tensor is `vector_aligned` (N a multiple of 4,
4-value aligned rows: the usual case), else four values a block width apart, one 2- or
4-byte access each. x is read from memory once: the gated residual is added, rounded
to x's format and stored in registers (the norm sees the stored values); the mean and
then the sum of squared deviations from it (two passes over registers: fp32 accuracy
for rows with a large mean) are block sums of one barrier each: warp shuffles, then
one more butterfly over the warps' sums (bit-identical on every run; `_reduce`); the
modulated output is written from registers. For an e4m3 out, the eight modulated
values are rounded to x's format in registers, the row's largest magnitude is a third
block maximum (`warps_max`, one more barrier), and each thread writes its values as
e4m3 (a 4-byte store per group) and thread 0 the row's scale: the bf16 path compiles to
the instructions it had before. With the norm switched off the same kernel is the
gated residual. The grid has one CTA per
row and no grid-stride loop: around such a loop the compiler keeps every hoisted
address live (255 registers and spills; 40 without it, with the row's index math done
by `_float.quotient`, so eight 192-thread CTAs fit an SM). Nothing in a launch syncs
with the host or allocates, so launches are graph-capturable.

The kernel is bound by the instructions it issues, not by memory (its profile is in
docs/benchmarks.md), so its code avoids what numba makes expensive: each tensor's row
is a 1-D view taken once with unsigned indices (no per-access 3-D stride products, no
wraparound of negative indices), the vector accesses step the last dimension by the
element size, bf16 rounds in one hardware instruction, and the warps' sums meet in a
butterfly instead of a serial loop. The kernel is compiled once per configuration
(`_kernel`: which tensors are real, the vector path, N and the block width as
constants), so absent factors cost no branch and the loops step by immediates; a model
uses two or three configurations, one compile each.

One file: one op pair, as every op of this package is (kernel, references, validating
wrappers, custom ops); its length is the checks of eight optional tensors and an fp8
output, and the kernel's three passes.
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

from ._float import (E4M3_MAX, FP8_DTYPE, bits_f32, check_float_dtype, load_f32, load_f32x4,
                     quotient, reciprocal_bits, round_f32, store_f32, store_f32x4,
                     vector_aligned)
from ._launch import (HARD_MAX_THREADS, SIMULATOR, Kernel, array_arg, int_arg, threads_holding,
                      use_kernel)
from ._reduce import WARP, absmax, warps_max, warps_total
from .quant_rows import MIN_SCALE, quantize_rows_reference
from framekv.specs.checks import (check_disjoint, check_last_dim_contiguous, check_no_overlap,
                                 check_output, check_same_device, check_tensor)

__all__ = ["adaln_", "adaln_reference", "gated_residual_", "gated_residual_reference",
           "MAX_N"]

# Kernel flags: which optional tensors are real (the others are stand-ins never read).
_RES, _GATE, _SHIFT, _SCALE, _WEIGHT, _BIAS, _NORM = 1, 2, 4, 8, 16, 32, 64
_VEC = 128  # every tensor `vector_aligned`: groups of 4 consecutive values, one access each
_FP8 = 256  # out is e4m3 with a scale per row (qscale)
_VALUES = 8  # values a thread holds in registers: two groups of four
MAX_N = _VALUES * HARD_MAX_THREADS  # a CTA holds a whole row
_WARPS = HARD_MAX_THREADS // WARP  # (a module constant: shared array sizes must be literals)

if SIMULATOR:

    def _device(fn):
        return cuda.jit(device=True)(fn)

    _KOPTS = {}  # the simulator takes no register bound

else:
    def _device(fn):
        return cuda.jit(device=True, forceinline=True)(fn)

    # 54 registers unbounded (6 CTAs of 192 threads per SM); 40 spill nothing (8 CTAs).
    _KOPTS = {"max_registers": 40}


# --------------------------------------------------------------------------- kernel


@_device
def _ld(row, j, n):
    """row[j] of a 1-D row view as float32; 0 past the row's end n (a lane with nothing
    to do)."""
    if j < n:
        return load_f32(row, (j,))
    return _f32(0)


@_device
def _ld4(row, j, step, n, vec):
    """Values j, j + step, j + 2 step, j + 3 step of a row, 0 past n; ``vec`` (step 1,
    n a multiple of 4, aligned): one access, all four in or all out."""
    if vec:
        if j < n:
            return load_f32x4(row, (j,))
        return (_f32(0), _f32(0), _f32(0), _f32(0))
    return (_ld(row, j, n), _ld(row, j + step, n), _ld(row, j + 2 * step, n),
            _ld(row, j + 3 * step, n))


@_device
def _ld4_or(row, j, step, n, vec, have, default):
    if have:
        return _ld4(row, j, step, n, vec)
    return (default, default, default, default)


@_device
def _st4(row, j, step, n, vec, v):
    if vec:
        if j < n:
            store_f32x4(row, (j,), v)
        return
    if j < n:
        store_f32(row, (j,), v[0])
    if j + step < n:
        store_f32(row, (j + step,), v[1])
    if j + 2 * step < n:
        store_f32(row, (j + 2 * step,), v[2])
    if j + 3 * step < n:
        store_f32(row, (j + 3 * step,), v[3])


@_device
def _block_sum(v, part, runs, t, nt):
    """Sum of v over the block's threads, returned to every thread, in a fixed order
    (the same bits on every run; `warps_total`). One barrier; each sum of a row takes
    its own ``runs``."""
    return warps_total(v, part, runs, t, nt, 0, (nt + WARP - 1) >> 5)


@_device
def _slots(t, nt, vec):
    """(first value of this thread's first group, of its second, step in a group): four
    consecutive values per group on the vector path (a warp moves 256 or 512 contiguous
    bytes per access), else values nt apart (each access coalesced)."""
    if vec:
        return 4 * t, 4 * (t + nt), 1
    return t, t + 4 * nt, nt


@_device
def _add_gated(xr, rr, gr, j, st, n, vec, xs, flags):
    """One group of the row xr + gate row gr * residual row rr, rounded to x's format:
    stored, and returned as the norm must see it (the stored values)."""
    rs = _ld4(rr, j, st, n, vec)
    gs = _ld4_or(gr, j, st, n, vec, flags & _GATE, _f32(1))
    v = (round_f32(xr, xs[0] + gs[0] * rs[0]), round_f32(xr, xs[1] + gs[1] * rs[1]),
         round_f32(xr, xs[2] + gs[2] * rs[2]), round_f32(xr, xs[3] + gs[3] * rs[3]))
    _st4(xr, j, st, n, vec, v)
    return v


@_device
def _sq(d, j, n):
    return d * d if j < n else _f32(0)


@_device
def _deviation(xs, j, st, n, mean):
    """Sum of (x - mean)^2 over one group's values that are in the row."""
    return (_sq(xs[0] - mean, j, n) + _sq(xs[1] - mean, j + st, n)
            + _sq(xs[2] - mean, j + 2 * st, n) + _sq(xs[3] - mean, j + 3 * st, n))


@_device
def _mod(v, w, bb, c, h, mean, rstd):
    return ((v - mean) * rstd * w + bb) * (_f32(1) + c) + h


@_device
def _mod4(mods, j, st, n, vec, xs, mean, rstd, flags):
    """One group of the output row, the modulated norm, in fp32; mods: the rows of
    shift, scale, weight and bias (weight and bias are [B, 1, N] with zero strides:
    row 0)."""
    shift, scale, weight, bias = mods
    one, zero = _f32(1), _f32(0)
    hs = _ld4_or(shift, j, st, n, vec, flags & _SHIFT, zero)
    cs = _ld4_or(scale, j, st, n, vec, flags & _SCALE, zero)
    ws = _ld4_or(weight, j, st, n, vec, flags & _WEIGHT, one)
    bs = _ld4_or(bias, j, st, n, vec, flags & _BIAS, zero)
    return (_mod(xs[0], ws[0], bs[0], cs[0], hs[0], mean, rstd),
            _mod(xs[1], ws[1], bs[1], cs[1], hs[1], mean, rstd),
            _mod(xs[2], ws[2], bs[2], cs[2], hs[2], mean, rstd),
            _mod(xs[3], ws[3], bs[3], cs[3], hs[3], mean, rstd))


@_device
def _rounded4(xr, v):
    """Four fp32 values rounded to the format of x's row xr (what an out like x holds)."""
    return (round_f32(xr, v[0]), round_f32(xr, v[1]), round_f32(xr, v[2]),
            round_f32(xr, v[3]))


@_device
def _absmax4(top, v, j, st, n):
    """The largest of top and the |values| of one group that are in the row."""
    for i in range(4):
        if j + i * st < n:
            top = absmax(top, v[i])
    return top


@_device
def _scaled4(v, inv):
    return (v[0] * inv, v[1] * inv, v[2] * inv, v[3] * inv)


@_device
def _out_fp8(outr, qsr, ya, yc, j1, j2, st, n, vec, part, runs, t, nt):
    """The row's 8-per-thread outputs ya, yc (rounded to x's format) as e4m3 with the
    row's scale (`framekv.ops.quantize_rows`' formula): its largest |value| is a block
    maximum (one more barrier), written to qsr[0] by thread 0."""
    top = _absmax4(_absmax4(_f32(0), ya, j1, st, n), yc, j2, st, n)
    top = warps_max(top, part, runs, t, nt, 0, (nt + WARP - 1) >> 5)
    sc = top / _f32(E4M3_MAX)
    if sc < _f32(MIN_SCALE):
        sc = _f32(MIN_SCALE)
    inv = _f32(1) / sc
    _st4(outr, j1, st, n, vec, _scaled4(ya, inv))
    _st4(outr, j2, st, n, vec, _scaled4(yc, inv))
    if t == 0:
        store_f32(qsr, (_u64(0),), sc)


@_device
def _rows(x, out, res, gate, shift, scale, weight, bias, qscale, flags, n, nt, eps_bits,
          inv_s, inv_gate, inv_shift, inv_scale):
    # x, out, res: [B, S, N]; gate, shift, scale: [B, M, N] (M may differ per tensor);
    # weight, bias: [B, 1, N] (zero strides); all float bits (int16 = bf16, int32 =
    # fp32; out int8 = e4m3 with _FP8, qscale [B, S, 1] its fp32 row scales); n = N,
    # nt = the block's threads (compile-time constants, as flags). A tensor whose flag
    # is off is a stand-in (x) that is never read. The block has at least N / 8
    # threads: each holds its 8 values in registers for the row.
    part = cuda.shared.array(HARD_MAX_THREADS, _f32)  # used by the simulator's sums only
    runs_mean = cuda.shared.array(_WARPS, _f32)
    runs_var = cuda.shared.array(_WARPS, _f32)
    runs_max = cuda.shared.array(_WARPS, _f32)
    S = x.shape[1]
    t = cuda.threadIdx.x
    eps = bits_f32(eps_bits)
    vec = (flags & _VEC) != 0
    j1, j2, st = _slots(t, nt, vec)
    # inv_*: fp64 bits of 1 / S and of 1 / (S // M) for each [B, M, N] modulation
    # (token s uses row s // (S // M)); weight and bias have one row.
    row = cuda.blockIdx.x  # one CTA per row, no grid-stride loop (module doc: registers)
    if row < x.shape[0] * S:
        b = quotient(row, inv_s)
        s = row - b * S
        # 1-D row views, their addresses computed once, not at every access; unsigned
        # indices spare the wraparound of negative ones numba emits for signed.
        b, s = _u64(b), _u64(s)
        xr = x[b, s]
        xa = _ld4(xr, j1, st, n, vec)
        xc = _ld4(xr, j2, st, n, vec)
        if flags & _RES:
            rr, gr = res[b, s], gate[b, _u64(quotient(s, inv_gate))]
            xa = _add_gated(xr, rr, gr, j1, st, n, vec, xa, flags)
            xc = _add_gated(xr, rr, gr, j2, st, n, vec, xc, flags)
        if flags & _NORM:  # the same for the whole block: every thread meets the barriers
            acc = xa[0] + xa[1] + xa[2] + xa[3] + xc[0] + xc[1] + xc[2] + xc[3]
            mean = _block_sum(acc, part, runs_mean, t, nt) / _f32(n)
            var = _block_sum(_deviation(xa, j1, st, n, mean) + _deviation(xc, j2, st, n, mean),
                             part, runs_var, t, nt)
            rstd = _f32(1) / _f32(math.sqrt(var / _f32(n) + eps))
            mods = (shift[b, _u64(quotient(s, inv_shift))],
                    scale[b, _u64(quotient(s, inv_scale))], weight[b, _u64(0)], bias[b, _u64(0)])
            outr = out[b, s]
            if flags & _FP8:
                ya = _rounded4(xr, _mod4(mods, j1, st, n, vec, xa, mean, rstd, flags))
                yc = _rounded4(xr, _mod4(mods, j2, st, n, vec, xc, mean, rstd, flags))
                _out_fp8(outr, qscale[b, s], ya, yc, j1, j2, st, n, vec, part, runs_max, t, nt)
            else:
                _st4(outr, j1, st, n, vec, _mod4(mods, j1, st, n, vec, xa, mean, rstd, flags))
                _st4(outr, j2, st, n, vec, _mod4(mods, j2, st, n, vec, xc, mean, rstd, flags))


@functools.lru_cache(maxsize=None)
def _kernel(flags: int, n: int, nt: int) -> Kernel:
    """The kernel for one configuration, compiled with ``flags`` (which tensors are
    real, vector path), the row width n and the block's threads nt as constants: the
    flags' branches fold away and n, nt step the loops as immediates (module doc: the
    kernel is bound by the instructions it issues). A model has two or three."""

    @cuda.jit(**_KOPTS)
    def _adaln_kernel(x, out, res, gate, shift, scale, weight, bias, qscale, eps_bits, inv_s,
                      inv_gate, inv_shift, inv_scale):
        _rows(x, out, res, gate, shift, scale, weight, bias, qscale, flags, n, nt, eps_bits,
              inv_s, inv_gate, inv_shift, inv_scale)

    return Kernel(_adaln_kernel)


# --------------------------------------------------------------------------- reference


def _per_token(t: torch.Tensor, S: int) -> torch.Tensor:
    """[B, M, N] -> fp32 [B, S, N], token s taking row s // (S // M) (a view, no sync)."""
    B, M, N = t.shape
    return t.float()[:, :, None].expand(B, M, S // M, N).reshape(B, S, N)


def gated_residual_reference(x, y, gate=None) -> None:
    """Torch reference of :func:`gated_residual_` (same arguments, in place)."""
    upd = y.float() if gate is None else y.float() * _per_token(gate, x.shape[1])
    x.copy_(x.float() + upd)


def adaln_reference(x, *, shift=None, scale=None, weight=None, bias=None, eps=1e-6,
                    residual=None, gate=None, out=None, out_scale=None) -> torch.Tensor:
    """Torch reference of :func:`adaln_` (same arguments, same rounding points; an e4m3
    ``out``: the output rounded to x's dtype, then `quantize_rows_reference` by token)."""
    if residual is not None:
        gated_residual_reference(x, residual, gate)
    y = F.layer_norm(x.float(), x.shape[-1:], None if weight is None else weight.float(),
                     None if bias is None else bias.float(), eps)
    if scale is not None:
        y = y * (1 + _per_token(scale, x.shape[1]))
    if shift is not None:
        y = y + _per_token(shift, x.shape[1])
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.dtype == FP8_DTYPE:
        N = x.shape[-1]
        quantize_rows_reference(y.to(x.dtype).view(-1, N), out=out.view(-1, N),
                                scale=out_scale.view(-1, 1))
        return out
    out.copy_(y)
    return out


# --------------------------------------------------------------------------- checks


def _check_rows(name: str, t, ref_name: str, ref, written: bool = False) -> None:
    """t: a bf16/fp32 [B, S, N] tensor of ref's shape and device, N contiguous."""
    check_tensor(name, t, ndims=(3,), layout="[B, S, N]")
    check_float_dtype(name, t)
    if ref is not None:
        if t.shape != ref.shape:
            raise ValueError(f"{name}: expected shape {tuple(ref.shape)} (the shape of "
                             f"{ref_name}), got {tuple(t.shape)}")
        check_same_device(name, t, ref_name, ref)
    check_last_dim_contiguous(name, t)
    if written:
        check_no_overlap(name, t)


def _check_width(N: int) -> None:
    if N > MAX_N:
        raise ValueError(f"x: expected N <= {MAX_N} (a CTA holds a row: 8 values in each "
                         f"of at most 1024 threads), got N = {N}")


def _check_device(name: str, t, device, device_name: str) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of {device_name}), "
                         f"got {t.device}")


def _check_mod(name: str, t, shape, device, device_name: str) -> None:
    """t: None or a bf16/fp32 [B, M, N] tensor, M dividing S, N contiguous."""
    if t is None:
        return
    B, S, N = shape
    check_tensor(name, t, ndims=(3,), layout="[B, M, N]")
    check_float_dtype(name, t)
    if t.shape[0] != B or t.shape[2] != N or t.shape[1] < 1 or S % t.shape[1]:
        raise ValueError(f"{name}: expected shape [{B}, M, {N}] with M dividing S = {S} "
                         f"(B, S, N of x), got {tuple(t.shape)}")
    _check_device(name, t, device, device_name)
    check_last_dim_contiguous(name, t)


def _check_affine(name: str, t, N: int, device, device_name: str) -> None:
    """t: None or a bf16/fp32 [N] tensor, contiguous."""
    if t is None:
        return
    check_tensor(name, t, ndims=(1,), layout="[N]")
    check_float_dtype(name, t)
    if t.shape[0] != N:
        raise ValueError(f"{name}: expected shape [{N}] (N of x), got {tuple(t.shape)}")
    _check_device(name, t, device, device_name)
    check_last_dim_contiguous(name, t)


def _check_mods(shape, device, device_name, shift, scale, weight, bias, gate, eps) -> float:
    """The modulation (shift, scale, gate), the affine weight and bias, and eps, against
    x's shape and device; returns eps as a float."""
    for name, t in (("shift", shift), ("scale", scale), ("gate", gate)):
        _check_mod(name, t, shape, device, device_name)
    for name, t in (("weight", weight), ("bias", bias)):
        _check_affine(name, t, shape[2], device, device_name)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    return float(eps)


def _check_call(x, out, out_scale, residual, gate) -> None:
    """The row tensors: x, out (may be None; e4m3 with out_scale) and residual
    (required with a gate)."""
    _check_rows("x", x, "", None, written=residual is not None)
    _check_width(x.shape[2])
    fp8 = isinstance(out, torch.Tensor) and out.dtype == FP8_DTYPE
    if fp8:
        B, S, N = x.shape
        check_output("out", out, FP8_DTYPE, (B, S, N), "x", x, "[B, S, N]")
        if out_scale is None:
            raise ValueError(f"out_scale: expected a float32 tensor of shape [{B}, {S}, 1] "
                             "(out is float8_e4m3fn: a scale per row), got None")
        check_output("out_scale", out_scale, torch.float32, (B, S, 1), "x", x, "[B, S, 1]")
    elif out is not None:
        _check_rows("out", out, "x", x, written=True)
    if out_scale is not None and not fp8:
        raise ValueError("out_scale: expected None unless out is float8_e4m3fn (the scales "
                         f"of an fp8 output), got a tensor with out "
                         f"{'None' if out is None else out.dtype}")
    if residual is not None:
        _check_rows("residual", residual, "x", x)
    elif gate is not None:
        raise ValueError("residual: expected a [B, S, N] tensor (a gate is given), got None")


# --------------------------------------------------------------------------- launch


def _flags(residual, gate, shift, scale, weight, bias, norm: bool) -> int:
    f = _NORM if norm else 0
    for bit, t in ((_RES, residual), (_GATE, gate), (_SHIFT, shift), (_SCALE, scale),
                   (_WEIGHT, weight), (_BIAS, bias)):
        if t is not None:
            f |= bit
    return f


def _mod_args(B: int, gate, shift, scale, weight, bias) -> list:
    """Kernel args of the modulation and affine tensors, in kernel order; None where
    absent (x stands in). weight and bias [N] go as [B, 1, N] with zero strides, so
    every tensor is indexed alike."""
    return [None if t is None else array_arg(t if t.dim() == 3 else t.expand(B, 1, -1))
            for t in (gate, shift, scale, weight, bias)]


def _execute(x, out, residual, mods, eps: float, res_name="residual", out_scale=None) -> None:
    """Check overlaps, then run the kernel (or the reference on CPU). mods: (gate,
    shift, scale, weight, bias); out None = the gated residual alone; out_scale: the
    row scales of an e4m3 out."""
    gate, shift, scale, weight, bias = mods
    names = ("gate", "shift", "scale", "weight", "bias")
    if out is not None:
        check_disjoint("out", out, [("x", x), (res_name, residual), *zip(names, mods)])
    if out_scale is not None:
        check_disjoint("out_scale", out_scale, [("x", x), ("out", out), (res_name, residual),
                                                *zip(names, mods)])
    if residual is not None:
        check_disjoint("x", x, [(res_name, residual), *zip(names, mods)])
    if x.numel() == 0:
        return
    if not use_kernel(x):
        if out is None:
            gated_residual_reference(x, residual, gate)
        else:
            adaln_reference(x, shift=shift, scale=scale, weight=weight, bias=bias, eps=eps,
                            residual=residual, gate=gate, out=out, out_scale=out_scale)
        return
    xa = array_arg(x)
    S = x.shape[1]
    vec = all(t is None or vector_aligned(t) for t in (x, out, residual, *mods))
    args = [xa, xa if out is None else array_arg(out),
            xa if residual is None else array_arg(residual),
            *[xa if a is None else a for a in _mod_args(x.shape[0], *mods)],
            xa if out_scale is None else array_arg(out_scale),
            int_arg(struct.unpack("<i", struct.pack("<f", eps))[0]),
            *[int_arg(reciprocal_bits(S // M)) for M in (1, *(1 if t is None else t.shape[1]
                                                             for t in (gate, shift, scale)))]]
    flags = (_flags(residual, *mods, norm=out is not None) | (_VEC if vec else 0)
             | (_FP8 if out_scale is not None else 0))
    nt = _threads(x.shape[2])
    _kernel(flags, x.shape[2], nt).launch(x.shape[0] * x.shape[1], nt, args, x.device)


def _threads(N: int) -> int:
    # Every value of a row in some thread's registers: 192 threads at N = 1536, 640 at 5120.
    return threads_holding(-(-N // _VALUES))


# --------------------------------------------------------------------------- ops


@torch.library.custom_op("framekv::adaln_", mutates_args=("x", "out", "out_scale"))
def _adaln_op(x: torch.Tensor, out: torch.Tensor, shift: Optional[torch.Tensor],
              scale: Optional[torch.Tensor], weight: Optional[torch.Tensor],
              bias: Optional[torch.Tensor], residual: Optional[torch.Tensor],
              gate: Optional[torch.Tensor], eps: float,
              out_scale: Optional[torch.Tensor]) -> None:
    _execute(x, out, residual, (gate, shift, scale, weight, bias), eps, out_scale=out_scale)


@_adaln_op.register_fake
def _(x, out, shift, scale, weight, bias, residual, gate, eps, out_scale) -> None:
    return None


@torch.library.custom_op("framekv::gated_residual_", mutates_args=("x",))
def _gated_residual_op(x: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor]) -> None:
    _execute(x, None, y, (gate, None, None, None, None), 0.0, res_name="y")


@_gated_residual_op.register_fake
def _(x, y, gate) -> None:
    return None


def adaln_(x: torch.Tensor, *, shift: Optional[torch.Tensor] = None,
           scale: Optional[torch.Tensor] = None, weight: Optional[torch.Tensor] = None,
           bias: Optional[torch.Tensor] = None, eps: float = 1e-6,
           residual: Optional[torch.Tensor] = None, gate: Optional[torch.Tensor] = None,
           out: Optional[torch.Tensor] = None,
           out_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Adaptive LayerNorm, optionally after a gated residual; returns ``out``.

    With ``residual``: ``x <- x + gate * residual`` (fp32, rounded once to x's dtype,
    in place). Then ``out = (LN(x) * weight + bias) * (1 + scale) + shift`` in fp32
    (LN over N, fp32 mean and biased variance, ``eps``), rounded once to out's dtype;
    or, for a float8_e4m3fn ``out``, rounded to x's dtype and quantized per token as
    `framekv.ops.quantize_rows` does (``out_scale`` its scales): the input of an fp8
    GEMM, bit for bit what ``quantize_rows`` makes of the output in x's dtype.

    Args:
        x: [B, S, N] bf16 or fp32, N contiguous, other strides free (no zero strides
            when a residual is given: x is written).
        shift, scale, gate: None or [B, M, N] bf16/fp32, M dividing S (token s uses row
            s // (S // M)), N contiguous, any row strides; M may differ between them.
        weight, bias: None or [N] bf16/fp32, the LayerNorm's affine parameters.
        eps: added to the variance, a finite number >= 0.
        residual: None or [B, S, N] bf16/fp32 (required when a gate is given).
        out: None (a new contiguous tensor like x), [B, S, N] bf16/fp32, N contiguous,
            or a contiguous float8_e4m3fn [B, S, N].
        out_scale: with an e4m3 ``out``, a contiguous fp32 [B, S, 1]: each token's scale
            (its view [B * S, 1] is ``torch._scaled_mm``'s row-wise scale); else None.

    ``out`` may not overlap any other argument, nor ``x`` (when written) the others
    (the check compares memory spans, so interleaved but disjoint views of one buffer
    are refused too). Raises ValueError naming the bad argument, before anything is
    written. One kernel on torch's current stream for CUDA tensors; the torch
    reference on CPU.
    """
    _check_call(x, out, out_scale, residual, gate)
    eps = _check_mods(tuple(x.shape), x.device, "x", shift, scale, weight, bias, gate, eps)
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _adaln_op(x, out, shift, scale, weight, bias, residual, gate, eps, out_scale)
    return out


def gated_residual_(x: torch.Tensor, y: torch.Tensor, gate: Optional[torch.Tensor] = None) -> None:
    """``x <- x + gate * y`` in place: fp32 math, rounded once to x's dtype.

    x, y: [B, S, N] bf16/fp32 (each its own), N contiguous; x has no zero strides and
    does not overlap y or gate. gate: None (= 1) or [B, M, N] as in :func:`adaln_`.
    """
    _check_rows("x", x, "", None, written=True)
    _check_width(x.shape[2])
    _check_rows("y", y, "x", x)
    _check_mod("gate", gate, tuple(x.shape), x.device, "x")
    _gated_residual_op(x, y, gate)
