"""Sums across the threads of a CUDA block, for kernels that hold a row in registers.

``segment_total(v, part, t, nt, size)``: the sum of ``v`` over the aligned segment of
``size`` lanes (a power of two <= 32) that holds thread ``t``, returned to every lane
of the segment. On the GPU it is a butterfly of warp shuffles (``size`` dividing the
warp, so every lane of a warp takes the same shuffles: the caller passes a size that
is uniform over the block); every lane ends with the same bits (each step adds the
same two values in either order). Shuffles, not a serial loop over shared memory: in
a LayerNorm of one row per CTA such a loop costs more than the rest of the kernel
together, the shuffles next to nothing (docs/benchmarks.md).

``segment_max`` and ``warps_max`` are the same two with the maximum in place of the sum,
for values that are never NaN (lanes could disagree over one); a maximum is exact, so
every lane ends with the same bits whatever the order. ``absmax(top, a)`` is a thread's
own step towards one: the larger of ``top`` (never NaN) and ``|a|``, a NaN ``a`` left
out (IEEE maxNum: one instruction on the GPU, the absolute value an operand modifier).

Under numba's CUDA simulator, which has no shuffles, the same sum goes through
``part`` (a shared array of one float per thread) between two barriers, in a fixed
order; every thread of the block must call it (it does on the GPU too, by contract).
Sums may differ from the GPU's in the last bit (another order), never run to run.

``warps_total(v, part, runs, t, nt, w0, w1)``: the sum of ``v`` over the whole warps
``w0 .. w1 - 1`` that hold thread t (a group of a block, or all of it), returned to
each of their lanes: each warp's `segment_total` goes to ``runs[warp]``, one barrier,
then lane k of every warp takes warp ``w0 + k``'s sum and one more butterfly adds them
(a fixed order; a serial loop over the warps' sums would cost every thread
instructions in proportion to the warps, in kernels bound by the instructions they
issue). Every thread of the block calls it; ``runs`` holds one float per warp and
serves one sum.
"""
from __future__ import annotations

from numba import cuda
from numba import float32 as _f32

from ._launch import SIMULATOR

__all__ = ["segment_total", "warps_total", "segment_max", "warps_max", "absmax", "WARP"]

WARP = 32

if SIMULATOR:

    @cuda.jit(device=True)
    def segment_total(v, part, t, nt, size):
        """Sum of v over t's aligned segment of ``size`` lanes (see the module doc)."""
        part[t] = v
        cuda.syncthreads()
        first = t - t % size
        acc = _f32(0)
        for k in range(first, min(first + size, nt)):
            acc += part[k]
        cuda.syncthreads()
        return acc

    @cuda.jit(device=True)
    def segment_max(v, part, t, nt, size):
        """Max of v (never NaN) over t's aligned segment of ``size`` lanes."""
        part[t] = v
        cuda.syncthreads()
        first = t - t % size
        top = v
        for k in range(first, min(first + size, nt)):
            top = max(top, part[k])
        cuda.syncthreads()
        return top

    @cuda.jit(device=True)
    def absmax(top, a):
        """max(top, |a|), a NaN a left out (module doc)."""
        a = abs(a)
        return a if a > top else top

else:
    from numba.cuda import libdevice

    @cuda.jit(device=True, forceinline=True)
    def absmax(top, a):
        """max(top, |a|), a NaN a left out (module doc)."""
        return libdevice.fmaxf(top, abs(a))

    @cuda.jit(device=True, forceinline=True)
    def segment_total(v, part, t, nt, size):
        """Sum of v over t's aligned segment of ``size`` lanes (see the module doc)."""
        m = size // 2
        while m > 0:
            v += cuda.shfl_xor_sync(0xFFFFFFFF, v, m)
            m //= 2
        return v

    @cuda.jit(device=True, forceinline=True)
    def segment_max(v, part, t, nt, size):
        """Max of v (never NaN) over t's aligned segment of ``size`` lanes."""
        m = size // 2
        while m > 0:
            v = max(v, cuda.shfl_xor_sync(0xFFFFFFFF, v, m))
            m //= 2
        return v


@cuda.jit(device=True, **({} if SIMULATOR else {"forceinline": True}))
def warps_total(v, part, runs, t, nt, w0, w1):
    """Sum of v over the warps w0 .. w1 - 1 holding thread t (see the module doc)."""
    w = segment_total(v, part, t, nt, WARP)
    if (t & (WARP - 1)) == 0:
        runs[t >> 5] = w
    cuda.syncthreads()
    lane = t & (WARP - 1)
    return segment_total(runs[w0 + lane] if w0 + lane < w1 else _f32(0), part, t, nt, WARP)


@cuda.jit(device=True, **({} if SIMULATOR else {"forceinline": True}))
def warps_max(v, part, runs, t, nt, w0, w1):
    """Max of v (never NaN) over the warps w0 .. w1 - 1 holding thread t, returned to
    each of their lanes (`warps_total`'s order, with the maximum)."""
    top = segment_max(v, part, t, nt, WARP)
    if (t & (WARP - 1)) == 0:
        runs[t >> 5] = top
    cuda.syncthreads()
    k = w0 + (t & (WARP - 1))
    return segment_max(runs[k] if k < w1 else runs[w0], part, t, nt, WARP)
