"""``quantize_rows``: each row of a matrix to float8 e4m3 with a scale of its own (an fp8
GEMM's activation, or a weight's output channels), optionally through GELU-tanh first.

Contract (x [M, K], rows m of K values; fp32 math)::

    v     = gelu_tanh(x) if gelu else x            # 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3)))
    a     = max_k |v[m, k]|                        # NaN left out of the maximum
    s[m]  = max(a / 448, 2^-126)                   # fp32, scale[m, 0]
    q     = e4m3(clamp(v * (1 / s[m]), -448, 448)) # nearest even; NaN -> NaN

so ``q * s`` is v to within 2^-4 |v| + 2^-10 s (e4m3: 3 mantissa bits; values under
2^-6 s are subnormal steps of 2^-9 s). The largest |v| of a row maps to 448, the top of
e4m3's range; the floor on s keeps 1 / s finite for a row of zeros (which quantizes to
zeros). A NaN stays a NaN in q; an infinite value makes its row's scale infinite, so the
row turns to zeros and NaN: a non-finite input is never hidden. ``1 / s`` is rounded
once and multiplied (kernel and reference alike), so the two agree bit for bit without
GELU.

GELU in the quantizer: on CUDA a bf16 GEMM adds its bias and applies GELU-tanh in its
epilogue (``torch._addmm_activation``); an fp8 GEMM (``torch._scaled_mm``) adds the bias
but has no GELU, so an MLP's first GEMM writes its pre-activation and the second
GEMM's quantizer applies GELU on the way in: one pass over the hidden activations
instead of two. The kernel computes the same function in another form, since
``0.5 (1 + tanh u) = 1 / (1 + e^(-2u))``::

    gelu_tanh(v) = v / (1 + 2^(v (c1 + c2 v^2)))     c1 = -2 sqrt(2/pi) / ln 2, c2 = 0.044715 c1

with the hardware's approximate exp2 and reciprocal (`_approx`: one special-function
instruction each, where torch's tanh costs a dozen and more, in a kernel bound by the
instructions it issues rather than by memory otherwise). It is within about 1e-6 of the
exact GELU relative to each value, closer than torch's fp32 formula, whose ``1 +
tanh`` cancels for negative inputs (5e-5 there); so a scale is within a few fp32 ulps
of the reference's and a value of q within one e4m3 step of it, differing only at a
rounding boundary (a small fraction of the bytes). The simulator runs the same form
with exact exp2 and division.

Tensors: x bf16 or fp32 [M, K] with a contiguous last dimension (rows any stride), out
float8_e4m3fn [M, K] contiguous (``torch._scaled_mm`` reads its first operand
row-major), scale fp32 [M, 1] contiguous (its row-wise scale layout).

Kernel: one CTA per row holding the row in registers: nt threads (whole warps, as few
as hold it), each with k <= 4 groups of eight values (so K <= `MAX_K`), group q of
thread t at values 8 (t + nt q) .. + 7: one 16-byte load of bf16 (two of fp32) and one
8-byte store of e4m3 when x and out are ``vector_aligned(t, 8)`` (K a multiple of 8),
else eight checked scalar accesses. Every load of a thread is issued before its first
value is used; groups that every thread has in the row skip the bound check. The row's
maximum is a butterfly of shuffles per warp, then one over the warps' maxima
(`warps_max`: exact, so every run gives the same bits). x is read once; nothing syncs
with the host or allocates: graph-capturable. Compiled once per (K's layout, GELU,
vector path). One file: one op (kernel, reference, validating wrapper, custom op).
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from numba import cuda
from numba import float32 as _f32
from numba import uint64 as _u64

from ._approx import exp2_approx, rcp_approx
from ._float import (E4M3_MAX, FP8_DTYPE, check_float_dtype, load_f32, load_f32x8, store_f32,
                     store_f32x8, vector_aligned)
from ._launch import HARD_MAX_THREADS, SIMULATOR, THREAD_STEP, Kernel, array_arg, use_kernel
from ._reduce import WARP, absmax, warps_max
from framekv.specs.checks import (check_disjoint, check_last_dim_contiguous, check_output,
                                 check_tensor)

__all__ = ["quantize_rows", "quantize_rows_reference", "MAX_K", "MIN_SCALE"]

_GELU, _VEC = 1, 2
_G = 8                     # values in a group: one 16-byte load of bf16, one 8-byte store
_GROUPS_MAX = 4            # groups a thread holds: 32 registers of values
MAX_K = _G * _GROUPS_MAX * HARD_MAX_THREADS
#: The smallest scale: 2^-126, the smallest normal fp32 (1 / s stays finite).
MIN_SCALE = 2.0 ** -126
_WARPS = HARD_MAX_THREADS // WARP
_BETA = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715
# GELU-tanh(v) = v / (1 + 2^(v (_C1 + _C2 v^2))): 0.5 (1 + tanh u) = 1 / (1 + e^(-2u))
_C1 = -2.0 * _BETA / math.log(2.0)
_C2 = _C1 * _KAPPA


def _layout(K: int) -> tuple[int, int]:
    """(nt, k): threads of a row's CTA (whole warps, as few as hold the row in at most
    `_GROUPS_MAX` groups each) and groups of eight per thread, for rows of K."""
    groups = -(-K // _G)
    least = -(-groups // _GROUPS_MAX)
    nt = max(THREAD_STEP, -(-least // THREAD_STEP) * THREAD_STEP)
    return nt, -(-groups // nt)


@cuda.jit(device=True, **({} if SIMULATOR else {"forceinline": True}))
def _gelu(v):
    """GELU-tanh of an fp32 value as ``v * sigmoid(2u)`` (module doc): one approximate
    exp2 and one approximate reciprocal."""
    e = exp2_approx(v * (_f32(_C1) + _f32(_C2) * (v * v)))
    return v * rcp_approx(_f32(1) + e)


@cuda.jit(device=True, **({} if SIMULATOR else {"forceinline": True}))
def _load8(row, j, n, vec, full):
    """Values j .. j + 7 of a 1-D row as float32, 0 past its end n; ``vec``: one
    access (n a multiple of 8, the row aligned: all eight in or all out); ``full``:
    known to be in the row (no check)."""
    if vec or full:
        if full or j < n:
            return load_f32x8(row, (j,))
        z = _f32(0)
        return (z, z, z, z, z, z, z, z)
    return (load_f32(row, (j,)) if j < n else _f32(0),
            load_f32(row, (j + 1,)) if j + 1 < n else _f32(0),
            load_f32(row, (j + 2,)) if j + 2 < n else _f32(0),
            load_f32(row, (j + 3,)) if j + 3 < n else _f32(0),
            load_f32(row, (j + 4,)) if j + 4 < n else _f32(0),
            load_f32(row, (j + 5,)) if j + 5 < n else _f32(0),
            load_f32(row, (j + 6,)) if j + 6 < n else _f32(0),
            load_f32(row, (j + 7,)) if j + 7 < n else _f32(0))


@cuda.jit(device=True, **({} if SIMULATOR else {"forceinline": True}))
def _store8(row, j, n, vec, full, v, b, inv):
    """v[b .. b + 7] * inv to values j .. j + 7 of a 1-D row, rounded to its format,
    none past its end n (``vec``, ``full``: as `_load8`)."""
    if vec or full:
        if full or j < n:
            store_f32x8(row, (j,), (v[b] * inv, v[b + 1] * inv, v[b + 2] * inv,
                                    v[b + 3] * inv, v[b + 4] * inv, v[b + 5] * inv,
                                    v[b + 6] * inv, v[b + 7] * inv))
        return
    for i in range(_G):
        if j + i < n:
            store_f32(row, (j + i,), v[b + i] * inv)


@functools.lru_cache(maxsize=None)
def _kernel(flags: int, n: int, nt: int, k: int) -> Kernel:
    """The kernel for rows of n values over nt threads of k groups, ``flags`` (GELU,
    vector path) compiled in as constants."""
    vec, act = (flags & _VEC) != 0, (flags & _GELU) != 0
    vals = _G * k
    full = n // (_G * nt)  # groups q < full are in the row for every thread

    @cuda.jit
    def _quant_rows_kernel(x, out, scale):
        # x: [M, n] float bits; out: [M, n] int8 (e4m3 bits); scale: [M, 1] int32 (fp32
        # bits); one CTA per row (blockIdx.x), nt threads.
        part = cuda.shared.array(HARD_MAX_THREADS, _f32)  # the simulator's maxima only
        runs = cuda.shared.array(_WARPS, _f32)
        v = cuda.local.array(vals, _f32)  # constant indices once unrolled: registers
        t = cuda.threadIdx.x
        m = _u64(cuda.blockIdx.x)
        xr, outr = x[m], out[m]
        for q in range(k):  # every load issued before the first value is used
            y = _load8(xr, _G * (t + nt * q), n, vec, q < full)
            for i in range(_G):
                v[_G * q + i] = y[i]
        top = _f32(0)
        for i in range(vals):
            a = _gelu(v[i]) if act else v[i]
            v[i] = a
            top = absmax(top, a)  # a NaN left out of the maximum
        top = warps_max(top, part, runs, t, nt, 0, (nt + WARP - 1) >> 5)
        s = top / _f32(E4M3_MAX)
        if s < _f32(MIN_SCALE):
            s = _f32(MIN_SCALE)
        inv = _f32(1) / s
        for q in range(k):
            _store8(outr, _G * (t + nt * q), n, vec, q < full, v, _G * q, inv)
        if t == 0:
            store_f32(scale, (m, _u64(0)), s)

    return Kernel(_quant_rows_kernel)


# --------------------------------------------------------------------------- reference


def quantize_rows_reference(x, *, gelu=False, out=None, scale=None):
    """Torch reference of :func:`quantize_rows` (same arguments and results)."""
    v = x.float()
    if gelu:
        v = F.gelu(v, approximate="tanh")
    top = v.abs().nan_to_num(nan=0.0, posinf=math.inf).amax(dim=-1, keepdim=True)   # [M, 1]
    # a true division (torch's CUDA divide by a Python number multiplies by its
    # reciprocal, which can differ from the kernel's quotient in the last bit)
    s = torch.div(top, top.new_full((), E4M3_MAX)).clamp_min(MIN_SCALE)
    q = (v * (1.0 / s)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)
    if out is None:
        out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    if scale is None:
        scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    out.copy_(q)
    scale.copy_(s)
    return out, scale


# --------------------------------------------------------------------------- op


def _execute(x, out, scale, gelu: bool) -> None:
    if x.shape[0] == 0:
        return
    if not use_kernel(x):
        quantize_rows_reference(x, gelu=gelu, out=out, scale=scale)
        return
    M, K = x.shape
    nt, k = _layout(K)
    vec = vector_aligned(x, _G) and vector_aligned(out, _G)
    flags = (_GELU if gelu else 0) | (_VEC if vec else 0)
    args = [array_arg(x), array_arg(out), array_arg(scale)]
    _kernel(flags, K, nt, k).launch(M, nt, args, x.device)


@torch.library.custom_op("framekv::quantize_rows", mutates_args=("out", "scale"))
def _quantize_rows_op(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor,
                      gelu: bool) -> None:
    _execute(x, out, scale, gelu)


@_quantize_rows_op.register_fake
def _(x, out, scale, gelu) -> None:
    return None


def _check(x, out, scale, gelu) -> None:
    check_tensor("x", x, ndims=(2,), layout="[M, K]")
    check_float_dtype("x", x)
    check_last_dim_contiguous("x", x)
    M, K = x.shape
    if not 1 <= K <= MAX_K:
        raise ValueError(f"x: expected 1 <= K <= {MAX_K} (a CTA holds a row: 32 values in "
                         f"each of at most 1024 threads), got K = {K}")
    if not isinstance(gelu, bool):
        raise ValueError(f"gelu: expected True or False, got {gelu!r}")
    check_output("out", out, FP8_DTYPE, (M, K), "x", x)
    check_output("scale", scale, torch.float32, (M, 1), "x", x)
    check_disjoint("out", out, [("x", x), ("scale", scale)])
    check_disjoint("scale", scale, [("x", x)])


def quantize_rows(x: torch.Tensor, *, gelu: bool = False, out: Optional[torch.Tensor] = None,
                  scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` (through GELU-tanh when ``gelu``) as e4m3 with a per-row fp32
    scale: returns ``(out, scale)``, ``out * scale`` ≈ the row (module doc).

    Args:
        x: [M, K] bf16 or fp32, 1 <= K <= `MAX_K`, last dimension contiguous (rows any
            stride).
        gelu: apply GELU-tanh (fp32) before quantizing.
        out: None (a new tensor) or a contiguous float8_e4m3fn [M, K] on x's device.
        scale: None (a new tensor) or a contiguous fp32 [M, 1] on x's device.

    Raises ValueError naming the bad argument before anything is written. One kernel on
    torch's current stream for CUDA tensors (no host sync, capturable); the torch
    reference on CPU.
    """
    if isinstance(x, torch.Tensor) and x.dim() == 2:
        if out is None:
            out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
        if scale is None:
            scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    _check(x, out, scale, gelu)
    _quantize_rows_op(x, out, scale, gelu)
    return out, scale
