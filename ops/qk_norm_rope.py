"""``qk_norm_rope_stage_``: QK RMSNorm and 3-axis rope of a packed QKV tensor, in place,
optionally staging normed K and raw V into pool slots (fp8 e4m3 ones quantized, with
statistics) and writing an fp8 copy of Q, in one kernel.

Contract. ``qkv`` is ``[B, S, H + 2*H_kv, D]`` (q heads, k heads, v heads), bf16 or
fp32, D even and contiguous, other strides free. Each q and k vector is RMS-normed,
``x * rsqrt(mean(x^2) + eps) * w``, then rotated:

- ``norm="head"``: the mean is over D of each head, weights ``[D]`` (per-head QK norm);
  ``norm="all"``: over all heads of q (H*D) and of k (H_kv*D), weights ``[H*D]`` and
  ``[H_kv*D]`` (the norm over the projection, as Wan's).
- rope (`RopeGrid`; None: no rotation): token s of sequence b, with
  ``t = s + token_offset``, sits at frame ``frame0[b] + t // (h*w)``, row
  ``(t % (h*w)) // w``, col ``t % w``; pair i turns by ``position * inv_freq[i]``, its
  position the one of its axis (the first ``axes[0]`` pairs the frame, the next
  ``axes[1]`` the row, the rest the col). ``style="interleaved"`` pairs dims
  (2i, 2i+1), ``"half"`` pairs (i, i + D/2); ``(x0, x1) -> (x0 c - x1 s, x0 s + x1 c)``.

Precision: statistics, norm and rotation in fp32 with one rounding, at the store (no
rounding between norm and rope); angles in fp64 and cos/sin of fp64 rounded to fp32,
exactly as the torch paths build their tables (positions grow over a long rollout).
``frame0`` is a device tensor, so a captured CUDA graph replays for every chunk.

Staging (``k_pool, v_pool`` ``[slots, H_kv, D]`` with ``dst``, ``dst2``, ``src_rows``, the
semantics of `scatter_kv_slots_`): rows are ``qkv[:, :tokens]`` flattened to
``[B*tokens]`` (row r = sequence ``r // tokens``, token ``r % tokens``). Q is normed and
rotated in place for all S tokens; for every entry e the normed, rotated K row and the
raw V row of source row ``src_rows[e]`` (or e) go to slots ``dst[e]`` and ``dst2[e]``
(negative slots skipped, rows outside ``[0, B*tokens)`` skip the entry). K in ``qkv`` is
NOT written: attention reads K from the pool, and leaving packed K raw lets the entries
of one launch recompute norm and rope from it while no block of the launch writes it.
Without pools, Q and K are normed and rotated in place; V is never touched.

fp8 (``torch.float8_e4m3fn`` pools; ``kv_scale`` fp32 [2, H_kv], K scales in row 0, V in
row 1, given iff the pools are fp8, with ``kv_amax`` fp32 [2, H_kv] and ``saturated``
int64 [2]): each value is stored as ``e4m3(clamp(x * (1 / s), -448, 448))`` with s its
head's scale, ``1 / s`` the fp32 reciprocal of the fp32 scale (torch's
``torch.reciprocal``), rounded to nearest even; ``x`` is fp32: K's normed, rotated value
before any rounding to qkv's dtype, V's raw value widened exactly. inf saturates to
+-448; every NaN becomes the byte 0x7F. The statistics count per staged entry (row in
range, a slot >= 0): an entry with two slots counts once, two entries of one row twice;
``saturated[kv]`` grows by the values with ``|x * (1 / s)| > 448`` (inf counts, NaN does
not), ``kv_amax[kv, h]`` rises to the entries' max ``|x|`` (NaN ignored; kv_amax holds
values >= 0). Both are sums and maxima, so any order gives the same bits (graph replays
too). With ``q_out`` (fp8 [B, T, H, D], D contiguous; with ``q_scale`` fp32 [H] and
``q_saturated`` int64 [1]), Q of the T real tokens is also quantized the same way, from
its fp32 value, and its saturated values counted (padding rows are not); Q in qkv is
written as without it.

Kernel: one launch, one CTA per work item (no grid-stride loop: around one the compiler
keeps every hoisted address live, and registers bound the CTAs per SM): items [0, B*S)
are the Q rows of the tokens, the next ones the K rows (tokens in place, or pool
entries: the CTA of an entry also copies its raw V heads). A CTA holds one section of
one token in registers: a thread takes 8 values of one head (columns 8j .. 8j + 7
interleaved, 4j .. 4j + 3 and D/2 + 4j .. + 3 half-split: its pairs are whole either
way), in two 4-value accesses when D % 8 == 0 and every tensor is `vector_aligned`, else
masked scalar ones; so ``max(H, H_kv) * D <= MAX_HEAD_VALUES`` (8192). A Q or K CTA
first has its threads compute the token's cos/sin of the D/2 pairs into shared memory
(each angle once, reused over the heads), sums the squares of each norm group (a head,
or all heads) in a fixed order (warp shuffles within a head of at most 32 lanes, else
warp sums then a butterfly over the group's warps; `_reduce`; one barrier, which also
publishes the tables; no atomics, so bit-identical results on every run, graph replay
included), then scales, weighs, rotates and stores from registers: every byte of qkv is
read once. An entry's CTA first copies its raw V heads (their stores drain while K is
normed; a CTA of their own cost more in index and entry work than the copy). Floats move
through `_float`'s accessors on raw bits; e4m3 stores are the hardware's saturating
conversion (sm_89+).

fp8 statistics stay off the memory system: a thread quantizes its 8 values in
registers and keeps their max |x| and saturated count; the lanes of a head combine
them with warp shuffles (`_stat_lanes`: a head's lanes, a warp of a wide head, or each
lane alone where a head's lanes are no power of two), and one lane publishes: an
atomic max on the fp32 bits as int32 (values >= 0 order as their bits), only when its
max exceeds the value it reads (so once the running max settles, calls issue almost
none), and an atomic add only when it counted something. Lanes past the heads stay in
for the shuffles, with zeros.

The kernel is bound by the instructions it issues, not by memory (its profile is in
docs/benchmarks.md). So heads are 1-D views taken with unsigned indices (no per-access
stride products, no wraparound code), a thread's head and the rope grid's divisions
are 32-bit, sin and cos share one fp64 range reduction, and bf16 rounds in one
hardware instruction (`_float`). And the kernel is compiled once per configuration
(`_kernel`: head counts, D, norm and rope style, the rope grid, which lists are
present, vector access, fp8 pools, q_out), those values constants: the branches of the
absent features fold away and the divisions by D and by the grid become multiplies. A model has one
configuration, so it costs one compile. What a call costs beyond a copy of its bytes
is the index and table work of one token per CTA.

One file: one op, as every op of this package is (kernel, torch reference, validating
wrapper, custom op); its length is the kernel's device functions and the checks of
nineteen arguments, the rope grid's six fields among them.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import struct
from typing import Optional

import numpy as np
import torch
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from ._float import (E4M3_MAX, FLOAT_DTYPES, FP8_DTYPE, f32_bits, load_f32, load_f32x4, quotient,
                     reciprocal_bits, store_f32, store_f32x4, vector_aligned)
from ._launch import (HARD_MAX_THREADS, SIMULATOR, Kernel, array_arg, int_arg, threads_holding,
                      use_kernel)
from ._reduce import WARP, segment_total, warps_total
from framekv.specs.checks import check_last_dim_contiguous, check_no_overlap, check_tensor
from .advance_commit import check_int
from .scatter_kv_slots import _check_pools, _check_slots, scatter_kv_slots_reference

__all__ = ["RopeGrid", "MAX_HEAD_VALUES", "q_bound", "qk_norm_rope_stage_",
           "qk_norm_rope_stage_reference"]

_MAX_PAIRS = 256    # D <= 512: one token's cos/sin tables live in shared memory
_VALUES = 8         # values of one head a thread holds in registers (two groups of four)
MAX_HEAD_VALUES = _VALUES * HARD_MAX_THREADS  # max(H, H_kv) * D: a CTA holds a token's q
_WARPS = HARD_MAX_THREADS // WARP
_MAX_POSITION = 2**31 - 1  # token index + offset: the kernel divides it in 32 bits
# The simulator's statistics go through shared memory (no shuffles); the GPU's do not.
_STAT_SLOTS = HARD_MAX_THREADS if SIMULATOR else 1
_NORMS = ("head", "all")
_STYLES = ("interleaved", "half")

if SIMULATOR:
    _device = cuda.jit(device=True)

    def _as_f64(bits):
        """int64 bits as float64."""
        return np.int64(bits).view(np.float64)

    _KOPTS = {}  # the simulator takes no register bound

    def _sincos(a):
        """(sin a, cos a) of a float64."""
        return math.sin(a), math.cos(a)
else:
    from numba.cuda import libdevice

    _device = cuda.jit(device=True, forceinline=True)

    # No fp64 array argument exists (tensors arrive as raw words): reinterpret the bits.
    _as_f64 = libdevice.longlong_as_double
    # sin and cos of one angle share their range reduction: half the fp64 work of two
    # calls, which a Q or K block does for its token's D/2 pairs before its first store.
    _sincos = libdevice.sincos
    # 62 registers unbounded (5 CTAs of 192 threads per SM); 48 spill 20 bytes (7 CTAs).
    _KOPTS = {"max_registers": 48}


@dataclasses.dataclass(frozen=True, eq=False)
class RopeGrid:
    """The rope of a chunk of video tokens (see the module docstring).

    Attributes:
        inv_freq: fp64 [D/2] inverse frequency of each pair, the axis parts concatenated.
        axes: pairs per axis (frame, row, col), summing to D/2.
        grid: (h, w) the latent patch grid of a frame.
        frame0: int64 [B] device tensor, rope frame of each sequence's first token's frame.
        style: "interleaved" (pairs 2i, 2i+1) or "half" (pairs i, i + D/2).
        token_offset: index of the first token within the chunk (sharded sequences).
    """

    inv_freq: torch.Tensor
    axes: tuple
    grid: tuple
    frame0: torch.Tensor
    style: str = "interleaved"
    token_offset: int = 0


def q_bound(q_weight: torch.Tensor, norm: str, head_dim: int) -> float:
    """A bound on every |q| value this op's QK norm and rope can produce with
    ``q_weight``: an RMSNorm over n values (n = ``head_dim`` for ``norm="head"``, the
    length of ``q_weight`` for "all") gives |x_i| / rms(x) <= sqrt(n), so |q| <=
    sqrt(n) * max|w|; rope turns pairs, and a pair's norm is within that bound too.
    Raised by 2^-8 for fp32 rounding. Synchronises (one host read)."""
    _check_norm(norm)
    n = head_dim if norm == "head" else q_weight.numel()
    return math.sqrt(n) * float(q_weight.detach().abs().max()) * (1 + 2.0 ** -8)


# --- kernel -----------------------------------------------------------------------------

@_device
def _rope_table(cos_t, sin_t, inv_freq, frame0, b, s, offset, gh, gw, n_f, n_fh):
    """cos/sin of token s of sequence b for every pair, into shared memory."""
    t = s + offset  # < 2^31 (checked): 32-bit divisions, not 64-bit ones
    hw = gh * gw
    frame = int64(uint32(t) // uint32(hw))
    rem = t - frame * hw
    row = int64(uint32(rem) // uint32(gw))
    col = rem - row * gw
    frame += frame0[b]
    for i in range(cuda.threadIdx.x, inv_freq.shape[0], cuda.blockDim.x):
        pos = frame if i < n_f else (row if i < n_fh else col)
        sc = _sincos(float64(pos) * _as_f64(inv_freq[i]))
        cos_t[i] = float32(sc[1])
        sin_t[i] = float32(sc[0])


@_device
def _ld4(row, c, lim, vec):
    """Columns c .. c + 3 of one head's 1-D ``row`` [D] as float32, 0 from column lim
    on; ``vec``: one access, all four in or all out."""
    z = float32(0.0)
    if vec:
        if c < lim:
            return load_f32x4(row, (c,))
        return (z, z, z, z)
    return (load_f32(row, (c,)) if c < lim else z,
            load_f32(row, (c + 1,)) if c + 1 < lim else z,
            load_f32(row, (c + 2,)) if c + 2 < lim else z,
            load_f32(row, (c + 3,)) if c + 3 < lim else z)


@_device
def _w4(w, i, lim, vec):
    """Weights i .. i + 3 of the 1-D ``w`` as float32, 0 from index lim on."""
    z = float32(0.0)
    if vec:
        if i < lim:
            return load_f32x4(w, (i,))
        return (z, z, z, z)
    return (load_f32(w, (i,)) if i < lim else z, load_f32(w, (i + 1,)) if i + 1 < lim else z,
            load_f32(w, (i + 2,)) if i + 2 < lim else z,
            load_f32(w, (i + 3,)) if i + 3 < lim else z)


@_device
def _st4(row, c, lim, vec, v):
    if vec:
        if c < lim:
            store_f32x4(row, (c,), v)
        return
    for k in range(4):
        if c + k < lim:
            store_f32(row, (c + k,), v[k])


@_device
def _group_sum(v, part, runs, t, nt, size):
    """Sum of v over t's group, the aligned ``size`` threads ``t // size`` (size uniform
    over the block), in a fixed order. Every thread of the block calls it, and it
    publishes what the block wrote to shared memory before (a barrier on every path)."""
    if size <= WARP and WARP % size == 0:  # a head within a warp: shuffles alone
        total = segment_total(v, part, t, nt, size)
        cuda.syncthreads()
        return total
    g0 = t - uint32(t) % uint32(size)
    end = min(g0 + size, nt)
    if size % WARP == 0:  # whole warps
        return warps_total(v, part, runs, t, nt, g0 >> 5, (end + WARP - 1) >> 5)
    total = float32(0.0)
    part[t] = v  # any other size (a head dim not a multiple of 64): through shared memory
    cuda.syncthreads()
    for k in range(g0, end):
        total += part[k]
    return total


@_device
def _sq4(a):
    return a[0] * a[0] + a[1] * a[1] + a[2] * a[2] + a[3] * a[3]


@_device
def _scale4(a, rs, w):
    return (a[0] * rs * w[0], a[1] * rs * w[1], a[2] * rs * w[2], a[3] * rs * w[3])


@_device
def _turn(x0, x1, c, s):
    return x0 * c - x1 * s, x0 * s + x1 * c


@_device
def _rotate(a, c, i, half, cos_t, sin_t):
    """Rotate this thread's pairs i .. i + 3 (i = 4j): (a0, a1), (a2, a3), (c0, c1),
    (c2, c3) interleaved, or (a_m, c_m) half-split. Pairs past D/2 read table entries
    that are never stored (their values are not either)."""
    if half:
        r0 = _turn(a[0], c[0], cos_t[i], sin_t[i])
        r1 = _turn(a[1], c[1], cos_t[i + 1], sin_t[i + 1])
        r2 = _turn(a[2], c[2], cos_t[i + 2], sin_t[i + 2])
        r3 = _turn(a[3], c[3], cos_t[i + 3], sin_t[i + 3])
        return (r0[0], r1[0], r2[0], r3[0]), (r0[1], r1[1], r2[1], r3[1])
    r0 = _turn(a[0], a[1], cos_t[i], sin_t[i])
    r1 = _turn(a[2], a[3], cos_t[i + 1], sin_t[i + 1])
    r2 = _turn(c[0], c[1], cos_t[i + 2], sin_t[i + 2])
    r3 = _turn(c[2], c[3], cos_t[i + 3], sin_t[i + 3])
    return (r0[0], r0[1], r1[0], r1[1]), (r2[0], r2[1], r3[0], r3[1])


@_device
def _lane_head(t, tph):
    """The head of thread t, ``tph`` threads a head: a 32-bit division (t < 1024)."""
    return int64(uint32(t) // uint32(tph))


@_device
def _slots(j, D, half):
    """(first column of this thread's first group, its bound, of its second group):
    columns 8j .. 8j + 7 interleaved; 4j .. 4j + 3 and D/2 + 4j .. + 3 half-split."""
    if half:
        return 4 * j, D // 2, D // 2 + 4 * j
    return 8 * j, D, 8 * j + 4


@_device
def _lane(D, half):
    """(head, j, c1, lim1, c2) of this thread: the head it holds 8 values of, its index
    j among the head's threads, and its columns (`_slots`)."""
    tph = (D + _VALUES - 1) // _VALUES
    head = _lane_head(cuda.threadIdx.x, tph)
    j = cuda.threadIdx.x - head * tph
    c1, lim1, c2 = _slots(j, D, half)
    return head, j, c1, lim1, c2


@_device
def _normed(src, h0, nh, D, w, per_head, half, has_rope, eps, cos_t, sin_t, part, runs,
            vec):
    """(head, a, c): this thread's 8 values of head ``h0 + head`` of token row ``src``
    [heads, D], RMS-normed and rotated in fp32 (columns c1.. in a, c2.. in c: `_lane`);
    the block covers heads h0 .. h0 + nh, and a lane past them holds zeros. Every
    thread takes the group sum's barrier."""
    t = cuda.threadIdx.x
    tph = (D + _VALUES - 1) // _VALUES
    head, j, c1, lim1, c2 = _lane(D, half)
    active = head < nh
    z = float32(0.0)
    # Views of this thread's head; unsigned indices spare numba's wraparound code.
    hv = src[uint64(h0 + head if active else h0)]
    a = _ld4(hv, c1, lim1, vec) if active else (z, z, z, z)
    c = _ld4(hv, c2, D, vec) if active else (z, z, z, z)
    total = _group_sum(_sq4(a) + _sq4(c), part, runs, t, cuda.blockDim.x,
                       tph if per_head else nh * tph)
    if active:
        rs = float32(1.0) / float32(math.sqrt(total / float32(D if per_head else nh * D)
                                              + eps))
        wb = 0 if per_head else head * D
        a = _scale4(a, rs, _w4(w, wb + c1, wb + lim1, vec))
        c = _scale4(c, rs, _w4(w, wb + c2, wb + D, vec))
        if has_rope:
            a, c = _rotate(a, c, 4 * j, half, cos_t, sin_t)
    return head, a, c


@_device
def _put(out, oh, D, half, vec, a, c):
    """Store this thread's values a, c (`_normed`) to head ``oh`` of ``out`` [heads, D],
    rounded to its format (e4m3 saturates)."""
    _, _, c1, lim1, c2 = _lane(D, half)
    o = out[uint64(oh)]
    _st4(o, c1, lim1, vec, a)
    _st4(o, c2, D, vec, c)


@_device
def _mul4(a, x):
    return a[0] * x, a[1] * x, a[2] * x, a[3] * x


@_device
def _amax4(a, m):
    """max(m, |a_k|): a NaN's comparison is false, so NaN is ignored."""
    for k in range(4):
        x = abs(a[k])
        if x > m:
            m = x
    return m


@_device
def _over4(a):
    """How many of |a_k| exceed e4m3's 448 (inf counts, NaN does not)."""
    n = 0
    for k in range(4):
        if abs(a[k]) > float32(E4M3_MAX):
            n += 1
    return n


if SIMULATOR:
    @cuda.jit(device=True)
    def _segment_stats(m, n, sf, si, t, size):
        """(max m, sum n) over t's aligned segment of ``size`` lanes, to every lane: the
        simulator has no shuffles, so through shared memory between two barriers."""
        sf[t] = m
        si[t] = n
        cuda.syncthreads()
        first = t - t % size
        for k in range(first, min(first + size, cuda.blockDim.x)):
            m = sf[k] if sf[k] > m else m
            n = int32(n + (si[k] if k != t else 0))
        cuda.syncthreads()
        return m, n
else:
    @cuda.jit(device=True, forceinline=True)
    def _segment_stats(m, n, sf, si, t, size):
        """(max m, sum n) over t's aligned segment of ``size`` lanes (a power of two <=
        32, uniform over the block), to every lane: a butterfly of warp shuffles."""
        k = size // 2
        while k > 0:
            o = cuda.shfl_xor_sync(0xFFFFFFFF, m, k)
            m = o if o > m else m
            n = int32(n + cuda.shfl_xor_sync(0xFFFFFFFF, n, k))
            k //= 2
        return m, n


@_device
def _fp8_put(o1, put1, o2, put2, head, nh, D, half, vec, a, c, scales, amax, sat, kv,
             keep_max, sg, sf, si):
    """Quantize this thread's fp32 values a, c of head ``head`` (`_normed`, or raw V) by
    ``1 / scales[head]`` (an fp32 reciprocal, as torch's) and store them as e4m3 to head
    ``head`` of o1 (put1) and o2 (put2); add the count of |x / s| > 448 to sat[kv] and,
    with keep_max, the max |x| to amax[head] (int32 bits of fp32: `f32_bits`). Per
    segment of sg lanes one lane publishes, with one atomic each, and only what changes
    something. Every thread of the block calls it (lanes past the nh heads hold zeros
    and store nothing)."""
    t = cuda.threadIdx.x
    active = head < nh
    inv = float32(1.0) / (load_f32(scales, (head,)) if active else float32(1.0))
    qa, qc = _mul4(a, inv), _mul4(c, inv)
    if active and put1:
        _put(o1, head, D, half, vec, qa, qc)
    if active and put2:
        _put(o2, head, D, half, vec, qa, qc)
    m, n = _segment_stats(_amax4(c, _amax4(a, float32(0.0))), int32(_over4(qa) + _over4(qc)),
                          sf, si, t, sg)
    if active and t % sg == 0:
        # amax only grows: a lane whose max is not above the value it reads has nothing
        # to publish, so once the running max settles the atomics stop.
        if keep_max and m > load_f32(amax, (head,)):
            cuda.atomic.max(amax, head, f32_bits(m))
        if n > 0:
            cuda.atomic.add(sat, kv, int64(n))


@_device
def _stage_v(src, h0, nh, D, v_pool, d1, d2, half, vec, fp8, scales, amax, sat, sg, sf,
             si):
    """Raw V heads h0 .. h0 + nh of one token row to slots d1 / d2 (skipped when
    negative), same lanes as the norm (8 values a thread); fp8: quantized, with the
    statistics (`_fp8_put`, every thread of the block)."""
    head, _, c1, lim1, c2 = _lane(D, half)
    active = head < nh
    if not (active or fp8):
        return
    z = float32(0.0)
    hv = src[uint64(h0 + head if active else h0)]
    a = _ld4(hv, c1, lim1, vec) if active else (z, z, z, z)
    c = _ld4(hv, c2, D, vec) if active else (z, z, z, z)
    o1, o2 = v_pool[uint64(max(d1, 0))], v_pool[uint64(max(d2, 0))]
    if fp8:
        _fp8_put(o1, d1 >= 0, o2, d2 >= 0, head, nh, D, half, vec, a, c, scales, amax, sat,
                 1, True, sg, sf, si)
        return
    if d1 >= 0:
        _put(o1, head, D, half, vec, a, c)
    if d2 >= 0:
        _put(o2, head, D, half, vec, a, c)


@_device
def _entry(e, has_src_rows, has_dst2, dst, dst2, src_rows, rows):
    """(source row, slot 1, slot 2, skip) of pool entry e."""
    r = src_rows[e] if has_src_rows else e
    d1 = dst[e]
    d2 = dst2[e] if has_dst2 else -1
    return r, d1, d2, r < 0 or r >= rows or (d1 < 0 and d2 < 0)


@_device
def _stage_k(row, H, Hkv, D, k_w, per_head, half, has_rope, eps, cos_t, sin_t, part, runs,
             vec, k_pool, d1, d2, fp8, scales, amax, sat, sg, sf, si):
    """Normed, rotated K heads of one token row to slots d1 / d2 (skipped when
    negative); fp8: quantized, with the statistics."""
    head, a, c = _normed(row, H, Hkv, D, k_w, per_head, half, has_rope, eps, cos_t, sin_t,
                         part, runs, vec)
    k1, k2 = k_pool[uint64(max(d1, 0))], k_pool[uint64(max(d2, 0))]
    if fp8:
        _fp8_put(k1, d1 >= 0, k2, d2 >= 0, head, Hkv, D, half, vec, a, c, scales, amax, sat,
                 0, True, sg, sf, si)
    elif head < Hkv:
        if d1 >= 0:
            _put(k1, head, D, half, vec, a, c)
        if d2 >= 0:
            _put(k2, head, D, half, vec, a, c)


@_device
def _stage_q(row, H, D, q_w, per_head, half, has_rope, eps, cos_t, sin_t, part, runs, vec,
             q_out, q_fp8, q_scale, amax, q_sat, sg, sf, si):
    """Normed, rotated Q heads of one token row in place; q_fp8: also quantized into
    ``q_out`` [H, D], the saturated ones counted (``amax``: a stand-in, unread)."""
    head, a, c = _normed(row, 0, H, D, q_w, per_head, half, has_rope, eps, cos_t, sin_t,
                         part, runs, vec)
    if head < H:
        _put(row, head, D, half, vec, a, c)
    if q_fp8:
        _fp8_put(q_out, True, q_out, False, head, H, D, half, vec, a, c, q_scale, amax, q_sat,
                 0, False, sg, sf, si)


@_device
def _items(qkv, q_w, k_w, inv_freq, frame0, k_pool, v_pool, dst, dst2, src_rows, kv_scale,
           kv_amax, saturated, q_out, q_scale, q_sat, H, Hkv, D, per_head, half, has_rope,
           has_pools, has_dst2, has_src_rows, fp8, q_fp8, sg, gh, gw, n_f, n_fh, offset,
           eps_bits, T, vec, inv_s, inv_t):
    # qkv: [B, S, H + 2 Hkv, D] float bits; q_w, k_w: [D] or [heads*D] float bits;
    # inv_freq: [D/2] fp64 bits; frame0: [B] int64; pools [slots, Hkv, D]; lists [E]
    # int64; kv_scale, kv_amax [2, Hkv] fp32 bits; saturated [2], q_sat [1] int64;
    # q_out [B, T, H, D] e4m3 bits; q_scale [H] fp32 bits. Absent tensors are stand-ins
    # the flags keep unread. Items: the B*S Q rows, then the K rows (pool entries, each
    # also staging its raw V; or tokens in place).
    cos_t = cuda.shared.array(_MAX_PAIRS, float32)
    sin_t = cuda.shared.array(_MAX_PAIRS, float32)
    part = cuda.shared.array(HARD_MAX_THREADS, float32)
    runs = cuda.shared.array(_WARPS, float32)
    sf = cuda.shared.array(_STAT_SLOTS, float32)
    si = cuda.shared.array(_STAT_SLOTS, int32)
    eps = float32(_as_f64(eps_bits))
    S = qkv.shape[1]
    n_q = qkv.shape[0] * S
    n_k = dst.shape[0] if has_pools else n_q
    item = cuda.blockIdx.x  # one CTA per item, no grid-stride loop (module doc: registers)
    if item < n_q + n_k:
        kind = 0 if item < n_q else 1  # Q, K (and V)
        r = item - n_q if kind == 1 else item
        d1 = -1
        d2 = -1
        if kind > 0 and has_pools:
            r, d1, d2, skip = _entry(r, has_src_rows, has_dst2, dst, dst2, src_rows,
                                     qkv.shape[0] * T)
            if skip:
                return  # block-uniform: no barrier is skipped by part of a block
        pooled = kind > 0 and has_pools
        L = T if pooled else S
        b = quotient(r, inv_t if pooled else inv_s)  # r // L
        s = r - b * L
        row = qkv[uint64(b), uint64(s)]
        if pooled:  # V first: its stores drain while K is normed and rotated
            _stage_v(row, H + Hkv, Hkv, D, v_pool, d1, d2, half, vec, fp8, kv_scale[1],
                     kv_amax[1], saturated, sg, sf, si)
        if has_rope:  # made visible by the first barrier of the group sum
            _rope_table(cos_t, sin_t, inv_freq, frame0, b, s, offset, gh, gw, n_f, n_fh)
        if kind == 0:  # q_out holds the T real tokens: padding rows are not quantized
            qs = s if s < T else T - 1
            _stage_q(row, H, D, q_w, per_head, half, has_rope, eps, cos_t, sin_t, part, runs,
                     vec, q_out[uint64(b), uint64(qs)], q_fp8 and s < T, q_scale, kv_amax[0],
                     q_sat, sg, sf, si)
        elif has_pools:
            _stage_k(row, H, Hkv, D, k_w, per_head, half, has_rope, eps, cos_t, sin_t, part,
                     runs, vec, k_pool, d1, d2, fp8, kv_scale[0], kv_amax[0], saturated, sg,
                     sf, si)
        else:
            head, a, c = _normed(row, H, Hkv, D, k_w, per_head, half, has_rope, eps, cos_t,
                                 sin_t, part, runs, vec)
            if head < Hkv:
                _put(row, H + head, D, half, vec, a, c)


def _stat_lanes(D: int) -> int:
    """Lanes whose statistics one lane publishes (`_fp8_put`): a head's, where its
    threads are a power of two within a warp; else whole warps of a head; else one."""
    tph = -(-D // _VALUES)
    if tph <= WARP and WARP % tph == 0:
        return tph
    return WARP if tph % WARP == 0 else 1


@functools.lru_cache(maxsize=None)
def _compiled(config: tuple) -> Kernel:
    (H, Hkv, D, per_head, half, has_rope, has_pools, has_dst2, has_src_rows, gh, gw, n_f,
     n_fh, vec, fp8, q_fp8) = config
    sg = _stat_lanes(D)

    @cuda.jit(**_KOPTS)
    def _qk_norm_rope_kernel(qkv, q_w, k_w, inv_freq, frame0, k_pool, v_pool, dst, dst2,
                             src_rows, kv_scale, kv_amax, saturated, q_out, q_scale, q_sat,
                             offset, eps_bits, T, inv_s, inv_t):
        _items(qkv, q_w, k_w, inv_freq, frame0, k_pool, v_pool, dst, dst2, src_rows,
               kv_scale, kv_amax, saturated, q_out, q_scale, q_sat, H, Hkv, D, per_head,
               half, has_rope, has_pools, has_dst2, has_src_rows, fp8, q_fp8, sg, gh, gw,
               n_f, n_fh, offset, eps_bits, T, vec, inv_s, inv_t)

    return Kernel(_qk_norm_rope_kernel)


def _kernel(config: tuple) -> Kernel:
    """The kernel for one configuration ``(H, Hkv, D, per_head, half, has_rope,
    has_pools, has_dst2, has_src_rows, gh, gw, n_f, n_fh, vec, fp8, q_fp8)`` (fp8: the
    pools are e4m3; q_fp8: a q_out is written; both False when left out), compiled with
    those as constants: the flags' branches fold away, and the divisions by D and the
    grid become multiplies (module doc: the kernel is bound by the instructions it
    issues). A model has one configuration; tests a few dozen."""
    return _compiled(tuple(config) + (False, False)[len(config) - 14:])


# --- torch reference ----------------------------------------------------------------------

def _rope_cos_sin(rope: RopeGrid, B: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos, sin [B, S, 1, D/2] of every (token, pair): fp64 angles."""
    dev = rope.inv_freq.device
    gh, gw = rope.grid
    t = torch.arange(S, device=dev, dtype=torch.int64) + rope.token_offset       # [S]
    frame = rope.frame0.to(torch.int64)[:, None] + t // (gh * gw)                # [B, S]
    row, col = (t % (gh * gw)) // gw, t % gw                                     # [S]
    n_f, n_h, n_w = rope.axes
    pos = torch.cat([frame[..., None].expand(B, S, n_f),
                     row[None, :, None].expand(B, S, n_h),
                     col[None, :, None].expand(B, S, n_w)], dim=-1)               # [B, S, D/2]
    angles = pos.to(torch.float64) * rope.inv_freq
    return angles.cos().float()[:, :, None], angles.sin().float()[:, :, None]


def _norm_rope_reference(x, weight, norm, eps, cos_sin, style) -> torch.Tensor:
    """fp32 norm + rope of x [B, S, heads, D]."""
    B, S, nh, D = x.shape
    xf = x.float()
    if norm == "head":
        ms = xf.pow(2).mean(-1, keepdim=True)                                    # [B, S, h, 1]
        w = weight.float()
    else:
        ms = xf.flatten(2).pow(2).mean(-1)[:, :, None, None]                     # [B, S, 1, 1]
        w = weight.float().view(nh, D)
    y = xf * torch.rsqrt(ms + eps) * w
    if cos_sin is None:
        return y
    c, s = cos_sin
    x0, x1 = (y[..., 0::2], y[..., 1::2]) if style == "interleaved" else y.chunk(2, dim=-1)
    r0, r1 = x0 * c - x1 * s, x0 * s + x1 * c
    if style == "interleaved":
        return torch.stack([r0, r1], dim=-1).flatten(-2)
    return torch.cat([r0, r1], dim=-1)


def _fp8_reference(x, scale) -> torch.Tensor:
    """fp32 ``x`` [..., heads, D] as e4m3 under per-head ``scale`` fp32 [heads]:
    ``e4m3(clamp(x * reciprocal(scale), -448, 448))``, every NaN the byte 0x7F."""
    y = x * torch.reciprocal(scale)[:, None]
    y = torch.where(torch.isnan(y), float("nan"), y.clamp(-E4M3_MAX, E4M3_MAX))
    return y.to(FP8_DTYPE)


def _stats_reference(x, scale, amax, saturated) -> None:
    """Add the count of ``|x * reciprocal(scale)| > 448`` (inf counts, NaN does not) of
    fp32 ``x`` [N, heads, D] to ``saturated`` [1] and, unless amax is None, raise
    ``amax`` [heads] to the max |x| per head (NaN ignored), in place."""
    if x.numel() == 0:
        return
    y = x * torch.reciprocal(scale)[:, None]
    saturated.add_((y.abs() > E4M3_MAX).sum())
    if amax is not None:
        mag = x.abs()
        mag = torch.where(torch.isnan(mag), 0.0, mag).amax(dim=(0, 2))
        amax.copy_(torch.maximum(amax, mag))


def _staged_rows(rows: int, dst, dst2, src_rows) -> torch.Tensor:
    """The source row of every staged entry (a row in [0, rows), a slot >= 0), one per
    entry: what the statistics count."""
    E = dst.shape[0]
    r = src_rows if src_rows is not None else torch.arange(E, device=dst.device)
    some = dst >= 0 if dst2 is None else (dst >= 0) | (dst2 >= 0)
    return r[(r >= 0) & (r < rows) & some]


def _stage_fp8_reference(k_pool, v_pool, k_rows, v_rows, dst, dst2, src_rows, kv_scale,
                         kv_amax, saturated) -> None:
    """Quantize fp32 K and V rows [B*T, Hkv, D], count what the staged entries hold, and
    scatter the bytes."""
    staged = _staged_rows(k_rows.shape[0], dst, dst2, src_rows)
    out = []
    for kv, x in enumerate((k_rows, v_rows)):
        _stats_reference(x[staged], kv_scale[kv], kv_amax[kv], saturated[kv:kv + 1])
        out.append(_fp8_reference(x, kv_scale[kv]).view(torch.uint8))
    scatter_kv_slots_reference(k_pool.view(torch.uint8), v_pool.view(torch.uint8), *out, dst,
                               dst2, src_rows)


def qk_norm_rope_stage_reference(qkv, q_weight, k_weight, *, num_heads, num_kv_heads,
                                 norm="head", eps=1e-6, rope=None, k_pool=None, v_pool=None,
                                 dst=None, dst2=None, src_rows=None, tokens=None,
                                 kv_scale=None, kv_amax=None, saturated=None, q_out=None,
                                 q_scale=None, q_saturated=None) -> None:
    """Torch reference of :func:`qk_norm_rope_stage_` (same arguments, in place, fp32
    math; fp8 pools and q_out quantized from the fp32 values). Used on CPU and by tests;
    it synchronises on CUDA (boolean masks)."""
    H, Hkv = num_heads, num_kv_heads
    B, S, _, D = qkv.shape
    cs = _rope_cos_sin(rope, B, S) if rope is not None else None
    style = rope.style if rope is not None else "interleaved"
    q = _norm_rope_reference(qkv[:, :, :H], q_weight, norm, eps, cs, style)
    k = _norm_rope_reference(qkv[:, :, H:H + Hkv], k_weight, norm, eps, cs, style)
    qkv[:, :, :H] = q.to(qkv.dtype)
    T = S if tokens is None else tokens
    if q_out is not None:
        q_real = q[:, :T]
        _stats_reference(q_real.reshape(B * T, H, D), q_scale, None, q_saturated)
        q_out.view(torch.uint8).copy_(_fp8_reference(q_real, q_scale).view(torch.uint8))
    if k_pool is None:
        qkv[:, :, H:H + Hkv] = k.to(qkv.dtype)
        return
    k_rows = k[:, :T].reshape(B * T, Hkv, D)
    v_rows = qkv[:, :T, H + Hkv:].reshape(B * T, Hkv, D)
    if kv_scale is not None:
        _stage_fp8_reference(k_pool, v_pool, k_rows, v_rows.float(), dst, dst2, src_rows,
                             kv_scale, kv_amax, saturated)
        return
    scatter_kv_slots_reference(k_pool, v_pool, k_rows.to(qkv.dtype), v_rows, dst, dst2,
                               src_rows)


# --- validation ---------------------------------------------------------------------------

def _check_head_dim(name: str, D: int) -> None:
    if D < 2 or D % 2 or D > 2 * _MAX_PAIRS:
        raise ValueError(f"{name}: expected an even head dim D in [2, {2 * _MAX_PAIRS}], "
                         f"got {D}")


def _check_width(H: int, Hkv: int, D: int, name: str) -> None:
    if max(H, Hkv) * (-(-D // _VALUES) * _VALUES) > MAX_HEAD_VALUES:
        raise ValueError(f"{name}: expected max(num_heads, num_kv_heads) * D <= "
                         f"{MAX_HEAD_VALUES} (a CTA holds a token's q or k: 8 values in each "
                         f"of at most 1024 threads), got {max(H, Hkv)} * {D}")


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}: expected dtype torch.bfloat16 or torch.float32, "
                         f"got {t.dtype}")


def _check_device(name: str, t: torch.Tensor, device, ref_name: str) -> None:
    if t.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of {ref_name}), "
                         f"got {t.device}")


def _check_qkv(qkv, H: int, Hkv: int) -> int:
    """Validate the packed tensor; return D."""
    check_tensor("qkv", qkv, ndims=(4,), layout="[B, S, H + 2*H_kv, D]")
    _check_float("qkv", qkv)
    if qkv.shape[2] != H + 2 * Hkv:
        raise ValueError(f"qkv: expected {H + 2 * Hkv} heads in dim 2 (num_heads + 2 * "
                         f"num_kv_heads), got shape {tuple(qkv.shape)}")
    _check_head_dim("qkv", qkv.shape[3])
    _check_width(H, Hkv, qkv.shape[3], "qkv")
    check_last_dim_contiguous("qkv", qkv)
    check_no_overlap("qkv", qkv)
    return qkv.shape[3]


def _check_norm(norm) -> None:
    if norm not in _NORMS:
        raise ValueError(f"norm: expected one of {_NORMS}, got {norm!r}")


def _check_weights(q_weight, k_weight, norm, H, Hkv, D, device, ref_name) -> None:
    for name, w, heads in (("q_weight", q_weight, H), ("k_weight", k_weight, Hkv)):
        n = D if norm == "head" else heads * D
        check_tensor(name, w, ndims=(1,), layout=f"[{n}]")
        _check_float(name, w)
        if w.shape[0] != n:
            raise ValueError(f"{name}: expected length {n} (D for norm='head', heads * D "
                             f"for norm='all'), got {w.shape[0]}")
        _check_device(name, w, device, ref_name)


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (
            math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    return float(eps)


def _check_ints(name: str, value, count: int, lo: int) -> tuple:
    if not isinstance(value, (tuple, list)) or len(value) != count:
        raise ValueError(f"{name}: expected {count} integers >= {lo}, got {value!r}")
    return tuple(check_int(name, v, lo) for v in value)


def _check_rope(rope, D: int, device, ref_name: str) -> None:
    if rope is None:
        return
    if not isinstance(rope, RopeGrid):
        raise ValueError(f"rope: expected a RopeGrid or None, got {type(rope).__name__}")
    check_tensor("rope.inv_freq", rope.inv_freq, ndims=(1,), layout="[D/2]")
    if rope.inv_freq.dtype != torch.float64 or rope.inv_freq.shape[0] != D // 2:
        raise ValueError(f"rope.inv_freq: expected torch.float64 [{D // 2}] (D/2), got "
                         f"{rope.inv_freq.dtype} {list(rope.inv_freq.shape)}")
    _check_device("rope.inv_freq", rope.inv_freq, device, ref_name)
    if sum(_check_ints("rope.axes", rope.axes, 3, 0)) != D // 2:
        raise ValueError(f"rope.axes: expected pairs per axis summing to {D // 2} (D/2), "
                         f"got {tuple(rope.axes)}")
    _check_ints("rope.grid", rope.grid, 2, 1)
    check_tensor("rope.frame0", rope.frame0, ndims=(1,), layout="[B]")
    if rope.frame0.dtype != torch.int64:
        raise ValueError(f"rope.frame0: expected dtype torch.int64, got {rope.frame0.dtype}")
    _check_device("rope.frame0", rope.frame0, device, ref_name)
    if rope.style not in _STYLES:
        raise ValueError(f"rope.style: expected one of {_STYLES}, got {rope.style!r}")
    check_int("rope.token_offset", rope.token_offset, 0)


def _check_staging(k_pool, v_pool, dst, dst2, src_rows, Hkv, D, dtype, device,
                   ref_name) -> bool:
    """Validate the pools and slot lists (all or nothing); True when staging."""
    trio = (("k_pool", k_pool), ("v_pool", v_pool), ("dst", dst))
    given = [name for name, t in trio if t is not None]
    if not given:
        for name, t in (("dst2", dst2), ("src_rows", src_rows)):
            if t is not None:
                raise ValueError(f"{name}: expected None (no k_pool, v_pool, dst: no "
                                 f"staging), got a {type(t).__name__}")
        return False
    if len(given) < 3:
        missing = next(name for name, t in trio if t is None)
        raise ValueError(f"{missing}: expected a tensor (staging takes k_pool, v_pool and "
                         f"dst together; given: {', '.join(given)}), got None")
    _check_pools(k_pool, v_pool)
    if k_pool.dtype not in (dtype, FP8_DTYPE):
        raise ValueError(f"k_pool: expected dtype {dtype} (the dtype of qkv) or "
                         f"{FP8_DTYPE}, got {k_pool.dtype}")
    if tuple(k_pool.shape[1:]) != (Hkv, D):
        raise ValueError(f"k_pool: expected shape [slots, {Hkv}, {D}] (num_kv_heads, D), "
                         f"got {tuple(k_pool.shape)}")
    _check_device("k_pool", k_pool, device, ref_name)
    _check_slots(k_pool, dst, dst2, src_rows)
    return True


def _check_small(name, t, dtype, shape, what, device, ref_name, written=False) -> None:
    """A small tensor of ``dtype`` and ``shape`` (``what`` names its dimensions)."""
    check_tensor(name, t, ndims=(len(shape),), layout=f"{list(shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)} ({what}), got "
                         f"{list(t.shape)}")
    _check_device(name, t, device, ref_name)
    if written:
        check_no_overlap(name, t)


def _check_together(names, values) -> bool:
    """All of ``values`` given or none; True when given."""
    given = [n for n, v in zip(names, values) if v is not None]
    if given and len(given) < len(names):
        missing = next(n for n, v in zip(names, values) if v is None)
        raise ValueError(f"{missing}: expected a tensor ({', '.join(names)} go together; "
                         f"given: {', '.join(given)}), got None")
    return bool(given)


def _check_kv_quant(kv_scale, kv_amax, saturated, k_pool, Hkv, device, ref_name) -> bool:
    """Validate the fp8 pools' scales and statistics; True when the pools are fp8."""
    names, values = ("kv_scale", "kv_amax", "saturated"), (kv_scale, kv_amax, saturated)
    fp8 = k_pool is not None and k_pool.dtype == FP8_DTYPE
    if not fp8:
        for name, t in zip(names, values):
            if t is not None:
                raise ValueError(f"{name}: expected None (the pools are not {FP8_DTYPE}), "
                                 f"got a {type(t).__name__}")
        return False
    for name, t in zip(names, values):
        if t is None:
            raise ValueError(f"{name}: expected a tensor (the pools are {FP8_DTYPE}), "
                             f"got None")
    _check_small("kv_scale", kv_scale, torch.float32, (2, Hkv), "K and V, num_kv_heads",
                 device, ref_name)
    _check_small("kv_amax", kv_amax, torch.float32, (2, Hkv), "K and V, num_kv_heads",
                 device, ref_name, written=True)
    _check_small("saturated", saturated, torch.int64, (2,), "K and V", device, ref_name,
                 written=True)
    return True


def _check_q_out(q_out, q_scale, q_saturated, qkv, H, T, ref_name) -> bool:
    """Validate the quantized Q output (the T real tokens); True when given."""
    if not _check_together(("q_out", "q_scale", "q_saturated"), (q_out, q_scale, q_saturated)):
        return False
    B, _, _, D = qkv.shape
    check_tensor("q_out", q_out, ndims=(4,), layout="[B, T, H, D]")
    if q_out.dtype != FP8_DTYPE:
        raise ValueError(f"q_out: expected dtype {FP8_DTYPE}, got {q_out.dtype}")
    if tuple(q_out.shape) != (B, T, H, D):
        raise ValueError(f"q_out: expected shape {[B, T, H, D]} (B of qkv, the tokens, "
                         f"num_heads, D), got {list(q_out.shape)}")
    _check_device("q_out", q_out, qkv.device, ref_name)
    check_last_dim_contiguous("q_out", q_out)
    check_no_overlap("q_out", q_out)
    _check_small("q_scale", q_scale, torch.float32, (H,), "num_heads", qkv.device, ref_name)
    _check_small("q_saturated", q_saturated, torch.int64, (1,), "one counter", qkv.device,
                 ref_name, written=True)
    return True


def _check_fit(qkv, rope, dst, src_rows, tokens, staging: bool) -> int:
    """Checks that pair qkv's B and S with the rest; returns tokens (T)."""
    B, S = qkv.shape[0], qkv.shape[1]
    if rope is not None and rope.frame0.shape[0] != B:
        raise ValueError(f"rope.frame0: expected length {B} (B, the sequences of qkv), "
                         f"got {rope.frame0.shape[0]}")
    if rope is not None and rope.token_offset + S > _MAX_POSITION:
        raise ValueError(f"rope.token_offset: expected at most {_MAX_POSITION - S} (token "
                         f"indices stay below 2^31 with S = {S}), got {rope.token_offset}")
    T = S if tokens is None else check_int("tokens", tokens, 1)
    if T > S:
        raise ValueError(f"tokens: expected an integer in [1, {S}] (S of qkv), got {T}")
    if staging and src_rows is None and dst.shape[0] != B * T:
        raise ValueError(f"dst: expected length {B * T} (B * tokens, the rows, since "
                         f"src_rows is not given), got {dst.shape[0]}")
    return T


# --- launch -------------------------------------------------------------------------------

def _array_args(q_weight, k_weight, rope, pools, lists, filler) -> list:
    """Kernel arrays after qkv; absent tensors become stand-ins the kernel never reads
    (``pools``: a 3-D tensor of qkv's dtype; ``filler``: an int64 tensor)."""
    inv_freq, frame0 = (rope.inv_freq, rope.frame0) if rope is not None else (filler, filler)
    dst, dst2, src_rows = lists
    dst = dst if dst is not None else filler
    return [array_arg(q_weight), array_arg(k_weight), array_arg(inv_freq), array_arg(frame0),
            array_arg(pools[0]), array_arg(pools[1]), array_arg(dst),
            array_arg(dst2 if dst2 is not None else dst),
            array_arg(src_rows if src_rows is not None else dst)]


def _quant_args(quant, qkv) -> list:
    """Kernel arrays of (kv_scale, kv_amax, saturated, q_out, q_scale, q_saturated);
    absent ones become stand-ins of their kernel types that the flags keep unread
    (fp32 [2, 1], int64 [2], q_out's: qkv, whose stores then type as qkv's)."""
    f32 = torch.zeros(2, 1, dtype=torch.float32, device=qkv.device)
    i64 = torch.zeros(2, dtype=torch.int64, device=qkv.device)
    kv_scale, kv_amax, saturated, q_out, q_scale, q_saturated = (
        t if t is not None else d for t, d in zip(quant, (f32, f32, i64, qkv, f32[0], i64)))
    return [array_arg(t) for t in (kv_scale, kv_amax, saturated, q_out, q_scale, q_saturated)]


def _config(H, Hkv, D, norm, rope, staging, lists, vec, fp8, q_fp8) -> tuple:
    """`_kernel`'s configuration."""
    gh, gw = rope.grid if rope is not None else (1, 1)
    n_f, n_h, _ = rope.axes if rope is not None else (0, 0, 0)
    return (int(H), int(Hkv), int(D), norm == "head",
            rope is not None and rope.style == "half", rope is not None, bool(staging),
            lists[1] is not None, lists[2] is not None, int(gh), int(gw), int(n_f),
            int(n_f + n_h), bool(vec), bool(fp8), bool(q_fp8))


def _scalar_args(eps, rope) -> list:
    """The kernel's runtime integers between the arrays and T: token offset, eps bits."""
    eps_bits = struct.unpack("<q", struct.pack("<d", eps))[0]  # fp64 bits in an int64
    return [int_arg(int(rope.token_offset) if rope is not None else 0), int_arg(eps_bits)]


def _block(H: int, Hkv: int, D: int) -> int:
    """Threads of a CTA: 8 values of a head each, the most heads of a section at once."""
    return threads_holding(max(H, Hkv) * -(-D // _VALUES))


def _reference(qkv, q_weight, k_weight, H, Hkv, norm, eps, rope, pools, lists, T,
               quant) -> None:
    names = ("kv_scale", "kv_amax", "saturated", "q_out", "q_scale", "q_saturated")
    qk_norm_rope_stage_reference(qkv, q_weight, k_weight, num_heads=H, num_kv_heads=Hkv,
                                 norm=norm, eps=eps, rope=rope, k_pool=pools[0],
                                 v_pool=pools[1], dst=lists[0], dst2=lists[1],
                                 src_rows=lists[2], tokens=T, **dict(zip(names, quant)))


def _run(qkv, q_weight, k_weight, H, Hkv, norm, eps, rope, pools, lists, T, quant) -> None:
    if qkv.numel() == 0:
        return
    if not use_kernel(qkv):
        _reference(qkv, q_weight, k_weight, H, Hkv, norm, eps, rope, pools, lists, T, quant)
        return
    staging = pools[0] is not None
    fp8, q_fp8 = quant[0] is not None, quant[3] is not None
    filler = torch.empty(0, dtype=torch.int64, device=qkv.device)
    arrays = _array_args(q_weight, k_weight, rope, pools if staging else (qkv[0], qkv[0]),
                         lists, filler)
    D = qkv.shape[3]
    vec = D % _VALUES == 0 and all(t is None or vector_aligned(t) for t in
                                   (qkv, q_weight, k_weight, quant[3],
                                    *(pools if staging else ())))
    # Items: Q rows, then K rows or entries (an entry's CTA stages its V too).
    n_entries = lists[0].shape[0] if staging else qkv.shape[0] * qkv.shape[1]
    kernel = _kernel(_config(H, Hkv, D, norm, rope, staging, lists, vec, fp8, q_fp8))
    kernel.launch(qkv.shape[0] * qkv.shape[1] + n_entries, _block(H, Hkv, D),
                  [array_arg(qkv), *arrays, *_quant_args(quant, qkv),
                   *_scalar_args(eps, rope), int_arg(T),
                   int_arg(reciprocal_bits(qkv.shape[1])), int_arg(reciprocal_bits(T))],
                  qkv.device)


@torch.library.custom_op("framekv::qk_norm_rope_stage_",
                         mutates_args=("qkv", "k_pool", "v_pool", "kv_amax", "saturated",
                                       "q_out", "q_saturated"))
def _qk_norm_rope_op(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     num_heads: int, num_kv_heads: int, norm: str, eps: float,
                     inv_freq: Optional[torch.Tensor], frame0: Optional[torch.Tensor],
                     axes: list[int], grid: list[int], style: str, token_offset: int,
                     k_pool: Optional[torch.Tensor], v_pool: Optional[torch.Tensor],
                     dst: Optional[torch.Tensor], dst2: Optional[torch.Tensor],
                     src_rows: Optional[torch.Tensor], tokens: int,
                     kv_scale: Optional[torch.Tensor], kv_amax: Optional[torch.Tensor],
                     saturated: Optional[torch.Tensor], q_out: Optional[torch.Tensor],
                     q_scale: Optional[torch.Tensor],
                     q_saturated: Optional[torch.Tensor]) -> None:
    # A RopeGrid is no schema type: the op takes its fields and rebuilds it.
    rope = None if inv_freq is None else RopeGrid(inv_freq, tuple(axes), tuple(grid), frame0,
                                                  style, token_offset)
    _run(qkv, q_weight, k_weight, num_heads, num_kv_heads, norm, eps, rope,
         (k_pool, v_pool), (dst, dst2, src_rows), tokens,
         (kv_scale, kv_amax, saturated, q_out, q_scale, q_saturated))


@_qk_norm_rope_op.register_fake
def _(qkv, q_weight, k_weight, num_heads, num_kv_heads, norm, eps, inv_freq, frame0, axes,
      grid, style, token_offset, k_pool, v_pool, dst, dst2, src_rows, tokens, kv_scale,
      kv_amax, saturated, q_out, q_scale, q_saturated) -> None:
    return None


def _rope_fields(rope) -> tuple:
    """The custom op's rope arguments (inv_freq None: no rope)."""
    if rope is None:
        return None, None, [0, 0, 0], [1, 1], "interleaved", 0
    return (rope.inv_freq, rope.frame0, [int(a) for a in rope.axes],
            [int(g) for g in rope.grid], rope.style, int(rope.token_offset))


# --- public API -----------------------------------------------------------------------------

def qk_norm_rope_stage_(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, *,
                        num_heads: int, num_kv_heads: int, norm: str = "head",
                        eps: float = 1e-6, rope: Optional[RopeGrid] = None,
                        k_pool: Optional[torch.Tensor] = None,
                        v_pool: Optional[torch.Tensor] = None,
                        dst: Optional[torch.Tensor] = None, dst2: Optional[torch.Tensor] = None,
                        src_rows: Optional[torch.Tensor] = None,
                        tokens: Optional[int] = None,
                        kv_scale: Optional[torch.Tensor] = None,
                        kv_amax: Optional[torch.Tensor] = None,
                        saturated: Optional[torch.Tensor] = None,
                        q_out: Optional[torch.Tensor] = None,
                        q_scale: Optional[torch.Tensor] = None,
                        q_saturated: Optional[torch.Tensor] = None) -> None:
    """RMS-norm and rotate the q and k heads of packed ``qkv`` in place, or (with pools)
    Q in place and normed K plus raw V into pool slots; see the module docstring.

    Args:
        qkv: [B, S, num_heads + 2*num_kv_heads, D] bf16 or fp32, D even (<= 512) and
            contiguous, other strides free.
        q_weight, k_weight: bf16 or fp32 norm weights, [D] (norm="head") or [H*D] and
            [H_kv*D] (norm="all").
        norm: "head" (mean over each head) or "all" (over all heads of q, of k).
        eps: added to the mean square.
        rope: a `RopeGrid`, or None for no rotation.
        k_pool, v_pool: [slots, num_kv_heads, D] of qkv's dtype or torch.float8_e4m3fn
            (given with dst, or none).
        dst, dst2, src_rows: int64 [E] slot lists, as `scatter_kv_slots_` takes them,
            over the B*tokens rows of ``qkv[:, :tokens]``; without src_rows, E = B*tokens.
        tokens: tokens per sequence that are rows (default S), in [1, S].
        kv_scale: fp32 [2, num_kv_heads], K (row 0) and V (row 1) scales per head;
            given iff the pools are fp8.
        kv_amax: fp32 [2, num_kv_heads], running max of |x| per head (raised in place);
            saturated: int64 [2], running counts of saturated K and V values (added to).
            Both given with kv_scale.
        q_out: fp8 e4m3 [B, S, num_heads, D] (D contiguous, other strides free): Q
            quantized by ``q_scale`` fp32 [num_heads], its saturated values counted in
            ``q_saturated`` int64 [1]; the three go together (Q in qkv is written too).

    Slot ids are not range-checked on the device (as `scatter_kv_slots_`); nor are the
    scales (a scale of 0 or a NaN quantizes to NaN or +-448). Raises ValueError naming
    the bad argument, before anything is written. One kernel on torch's current stream
    for CUDA tensors (fp8 needs sm_89+); the torch reference on CPU.
    """
    H, Hkv = check_int("num_heads", num_heads, 1), check_int("num_kv_heads", num_kv_heads, 1)
    D = _check_qkv(qkv, H, Hkv)
    _check_norm(norm)
    _check_weights(q_weight, k_weight, norm, H, Hkv, D, qkv.device, "qkv")
    eps = _check_eps(eps)
    _check_rope(rope, D, qkv.device, "qkv")
    staging = _check_staging(k_pool, v_pool, dst, dst2, src_rows, Hkv, D, qkv.dtype,
                             qkv.device, "qkv")
    T = _check_fit(qkv, rope, dst, src_rows, tokens, staging)
    _check_kv_quant(kv_scale, kv_amax, saturated, k_pool, Hkv, qkv.device, "qkv")
    _check_q_out(q_out, q_scale, q_saturated, qkv, H, T, "qkv")
    _qk_norm_rope_op(qkv, q_weight, k_weight, H, Hkv, norm, eps, *_rope_fields(rope),
                     k_pool, v_pool, dst, dst2, src_rows, T, kv_scale, kv_amax, saturated,
                     q_out, q_scale, q_saturated)
