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
GELU; with it, tanh may differ in the last fp32 bit between the device's math library
and torch's, and q then by one e4m3 step at a rounding boundary.

GELU in the quantizer: on CUDA a bf16 GEMM adds its bias and applies GELU-tanh in its
epilogue (``torch._addmm_activation``); an fp8 GEMM (``torch._scaled_mm``) adds the bias
but has no GELU, so an MLP's first GEMM writes its pre-activation and the second
GEMM's quantizer applies GELU on the way in: one pass over the hidden activations
instead of two.

Tensors: x bf16 or fp32 [M, K] with a contiguous last dimension (rows any stride), out
float8_e4m3fn [M, K] contiguous (``torch._scaled_mm`` reads its first operand
row-major), scale fp32 [M, 1] contiguous (its row-wise scale layout).

Kernel: one CTA per row holding the row in registers: nt threads (whole warps, at most
1024), each with k groups of four values (k <= 8, so K <= `MAX_K`), group q of thread t
at values 4 (t + nt q) .. + 3, one 8- or 16-byte load and one 4-byte store of e4m3 when
x and out are `vector_aligned` (K a multiple of 4), else four checked scalar accesses.
The row's maximum is a butterfly of shuffles per warp, then one over the warps' maxima
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

from ._float import (E4M3_MAX, FP8_DTYPE, check_float_dtype, load_f32, load_f32x4, store_f32,
                     store_f32x4, vector_aligned)
from ._launch import (HARD_MAX_THREADS, SIMULATOR, THREAD_STEP, Kernel, array_arg,
                      use_kernel)
from ._reduce import WARP, warps_max
from framekv.specs.checks import (check_disjoint, check_last_dim_contiguous, check_no_overlap,
                                 check_same_device, check_tensor)

__all__ = ["quantize_rows", "quantize_rows_reference", "MAX_K", "MIN_SCALE"]

_GELU, _VEC = 1, 2
_GROUPS = 4                # groups of four a thread holds once the row needs many threads
_GROUPS_MAX = 8            # ... and at most: 32 registers of values
MAX_K = 4 * _GROUPS_MAX * HARD_MAX_THREADS
#: The smallest scale: 2^-126, the smallest normal fp32 (1 / s stays finite).
MIN_SCALE = 2.0 ** -126
_MAX_THREADS = 8 if SIMULATOR else HARD_MAX_THREADS  # the simulator: small blocks, long loops
_WARPS = HARD_MAX_THREADS // WARP
_BETA = math.sqrt(2.0 / math.pi)
_KAPPA = 0.044715


def _layout(K: int) -> tuple[int, int]:
    """(nt, k): threads of a row's CTA and groups of four per thread for rows of K."""
    groups = -(-K // 4)
    want = -(-groups // _GROUPS)
    nt = min(_MAX_THREADS, max(THREAD_STEP, -(-want // THREAD_STEP) * THREAD_STEP))
    return nt, -(-groups // nt)


@cuda.jit(device=True, **({} if SIMULATOR else {"forceinline": True}))
def _gelu(v):
    """GELU-tanh of an fp32 value, torch's formula in torch's order."""
    cube = v * v * v
    inner = _f32(_BETA) * (v + _f32(_KAPPA) * cube)
    return _f32(0.5) * v * (_f32(1) + _f32(math.tanh(inner)))


@cuda.jit(device=True, **({} if SIMULATOR else {"forceinline": True}))
def _load4(row, j, n, vec):
    """Values j .. j + 3 of a 1-D row as float32, 0 past its end n; ``vec``: one
    access (n a multiple of 4, the row aligned: all four in or all out)."""
    if vec:
        if j < n:
            return load_f32x4(row, (j,))
        return (_f32(0), _f32(0), _f32(0), _f32(0))
    return (load_f32(row, (j,)) if j < n else _f32(0),
            load_f32(row, (j + 1,)) if j + 1 < n else _f32(0),
            load_f32(row, (j + 2,)) if j + 2 < n else _f32(0),
            load_f32(row, (j + 3,)) if j + 3 < n else _f32(0))


@cuda.jit(device=True, **({} if SIMULATOR else {"forceinline": True}))
def _store4(row, j, n, vec, y):
    """Four floats y to values j .. j + 3 of a 1-D row, rounded to its format, none
    past its end n (``vec``: one access, as `_load4`)."""
    if vec and j < n:
        store_f32x4(row, (j,), y)
    elif not vec:
        for i in range(4):
            if j + i < n:
                store_f32(row, (j + i,), y[i])


@functools.lru_cache(maxsize=None)
def _kernel(flags: int, n: int, nt: int, k: int) -> Kernel:
    """The kernel for rows of n values over nt threads of k groups, ``flags`` (GELU,
    vector path) compiled in as constants."""
    vec, act = (flags & _VEC) != 0, (flags & _GELU) != 0
    vals = 4 * k

    @cuda.jit
    def _quant_rows_kernel(x, out, scale):
        # x: [M, n] float bits; out: [M, n] int8 (e4m3 bits); scale: [M, 1] int32 (fp32
        # bits); one CTA per row (blockIdx.x), nt threads.
        part = cuda.shared.array(HARD_MAX_THREADS, _f32)  # the simulator's maxima only
        runs = cuda.shared.array(_WARPS, _f32)
        v = cuda.local.array(vals, _f32)
        t = cuda.threadIdx.x
        m = _u64(cuda.blockIdx.x)
        xr, outr = x[m], out[m]
        top = _f32(0)
        for q in range(k):
            y = _load4(xr, 4 * (t + nt * q), n, vec)
            for i in range(4):
                a = _gelu(y[i]) if act else y[i]
                v[4 * q + i] = a
                a = abs(a)
                if a > top:  # a NaN compares false: left out of the maximum
                    top = a
        top = warps_max(top, part, runs, t, nt, 0, (nt + WARP - 1) >> 5)
        s = top / _f32(E4M3_MAX)
        if s < _f32(MIN_SCALE):
            s = _f32(MIN_SCALE)
        inv = _f32(1) / s
        for q in range(k):
            j = 4 * (t + nt * q)
            _store4(outr, j, n, vec, (v[4 * q] * inv, v[4 * q + 1] * inv, v[4 * q + 2] * inv,
                                      v[4 * q + 3] * inv))
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
    vec = vector_aligned(x) and vector_aligned(out)
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
    for name, t, dtype, shape in (("out", out, FP8_DTYPE, (M, K)),
                                  ("scale", scale, torch.float32, (M, 1))):
        check_tensor(name, t, ndims=(2,), layout=f"[{shape[0]}, {shape[1]}]")
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name}: expected a {dtype} tensor of shape {list(shape)}, got "
                             f"{t.dtype} of shape {list(t.shape)}")
        check_same_device(name, t, "x", x)
        if not t.is_contiguous():
            raise ValueError(f"{name}: expected a contiguous tensor, got strides "
                             f"{tuple(t.stride())}")
        check_no_overlap(name, t)
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
