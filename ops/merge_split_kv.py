"""``merge_split_kv_``: merge the partial outputs of split-KV attention in one pass.

Split-KV attention cuts each causal block's keys into S sub-rows that run as extra
batch entries of one paged SDPA call (cuDNN batch index n = s * nb + i for split s of
block i). Sub-row n yields a partial output O_n, normalised within the sub-row, and
its softmax statistic lse_n (natural-log logsumexp of its scaled scores, fp32). The
exact output of block i is

    sum_s w_s O_(s*nb+i),   w_s = exp(lse_s - m) / sum_r exp(lse_r - m),  m = max_s lse_s

over the sub-rows that have keys; a sub-row with no keys is skipped (its O and lse are
never used, so garbage, NaN or -inf there cannot leak), and a block none of whose
sub-rows has keys gets zero rows. Rows at or past ``seq_len`` (padding) are written as
zeros.

fp8 partials (``torch.float8_e4m3fn``, what cuDNN's fp8 SDPA writes on Hopper) are
dequantized on the way: the merged row (t, h) is multiplied by ``scale[0] *
head_scale[h // (H / H_s)]`` (fp32 device tensors, read when the kernel runs), the
output's descale and the V head's pool scale of fp8 attention. With S = 1 the merge
is that dequantization alone (one sub-row weighs 1).

Kernel: one thread per 16-byte output word (8 values), grid-striding over the
T x H x D/8 words. A thread issues all its loads at once (the S statistics, key
counts and partial words), then weighs, accumulates in fp32 and stores one rounded
word. Every input byte is read once and every output byte written once, so the cost
should be the bytes moved. With the geometry as kernel arguments it is not: the index
divisions of each word and a loop over a runtime S cost more than the loads. So the
kernel is compiled once per geometry (`_kernel`: splits, blocks, heads, words per row,
block size, dtype as constants; an attention layout has one): the divisions become
multiplies, the split loop unrolls, and what remains is the cost of the bytes moved
(timings in docs/benchmarks.md).

One file: one op, as every op of this package is (kernel, reference, validating
wrapper, custom op); its length is the kernel's word paths for three dtypes, the fp8
path's 8-byte words, and the checks of seven tensors.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np
import torch
from numba import cuda
from numba import float32 as _f32

from . import _launch
from ._launch import Kernel, array_arg, blocks_for, int_arg, use_kernel
from framekv.specs.checks import check_last_dim_contiguous, check_no_overlap, check_same_device, check_tensor
from ._words import load_word, store_word
from .advance_commit import check_int

__all__ = ["merge_split_kv_", "merge_split_kv_reference"]

_DTYPES = (torch.bfloat16, torch.float16)
_FP8 = torch.float8_e4m3fn
_WORD = 16            # bytes per load/store
_WORD8 = 8            # bytes per fp8 partial load: the 8 values of one output word
_LANES = 8            # 2-byte values per word
_NEG_INF = np.float32(-np.inf)

# --------------------------------------------------------------------------- conversions
# A 16-byte word is a complex128 (two float64 holding the raw bits); lane k is the k-th
# 2-byte value in memory order (little-endian: the low half of the real part first).

if _launch.SIMULATOR:

    def _device(fn):
        return cuda.jit(device=True)(fn)

    def _as_f32(bits):
        """Reinterpret int32 bits as float32."""
        return np.int32(bits).view(np.float32)

    def _lanes(word):
        return np.array([word], dtype=np.complex128).view(np.uint16)  # [8]

    def _unpack_bf16(word):
        """The 8 bf16 values of a word, as float32."""
        return tuple((_lanes(word).astype(np.uint32) << 16).view(np.float32))

    def _unpack_fp16(word):
        """The 8 fp16 values of a word, as float32."""
        return tuple(_lanes(word).view(np.float16).astype(np.float32))

    def _pack_bf16(vals):
        """8 float32 rounded to bf16 (nearest even, NaN -> 0x7FC0), as one word."""
        f = np.array(vals, dtype=np.float32)  # [8]
        b = f.view(np.uint32).astype(np.uint64)
        h = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
        h[np.isnan(f)] = 0x7FC0
        return h.view(np.complex128)[0]

    def _pack_fp16(vals):
        """8 float32 rounded to fp16 (nearest even), as one word."""
        return np.array(vals, dtype=np.float32).astype(np.float16).view(np.complex128)[0]

    # Every e4m3 byte's value (NaN for 0x7F and 0xFF), as torch decodes it.
    _E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(_FP8).float().numpy()

    def _unpack_e4m3(word):
        """The 8 e4m3 values of an 8-byte word (memory order), as float32."""
        return tuple(_E4M3_VALUES[np.array([word], dtype=np.int64).view(np.uint8)])

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils, libdevice
    from numba.cuda.extending import intrinsic

    from ._float import bf16_to_f32_ir as _bf16_to_f32
    from ._float import f32_to_bf16_ir as _f32_to_bf16

    def _device(fn):
        return cuda.jit(device=True, forceinline=True)(fn)

    _as_f32 = libdevice.int_as_float

    _I16, _I32, _I64, _F32 = ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
    _F32X8 = types.UniTuple(types.float32, _LANES)

    def _word_lanes(builder, word):
        """The 8 lanes of a complex128 word as i16, in memory order."""
        lanes = []
        for part in range(2):
            bits = builder.bitcast(builder.extract_value(word, part), _I64)
            for k in range(4):
                lanes.append(builder.trunc(builder.lshr(bits, ir.Constant(_I64, 16 * k)), _I16))
        return lanes

    def _lanes_word(context, builder, lanes):
        """A complex128 word from 8 i16 lanes in memory order."""
        word = cgutils.get_null_value(context.get_value_type(types.complex128))
        for part in range(2):
            bits = ir.Constant(_I64, 0)
            for k in range(4):
                lane = builder.zext(lanes[4 * part + k], _I64)
                bits = builder.or_(bits, builder.shl(lane, ir.Constant(_I64, 16 * k)))
            word = builder.insert_value(word, builder.bitcast(bits, ir.DoubleType()), part)
        return word

    def _fp16_to_f32(builder, lane):
        cvt = ir.InlineAsm(ir.FunctionType(_F32, [_I16]), "cvt.f32.f16 $0, $1;", "=f,h")
        return builder.call(cvt, [lane])

    def _f32_to_fp16(builder, value):
        cvt = ir.InlineAsm(ir.FunctionType(_I16, [_F32]), "cvt.rn.f16.f32 $0, $1;", "=h,f")
        return builder.call(cvt, [value])

    def _unpacker(convert):
        def typer(typingctx, word):
            if word != types.complex128:
                raise TypeError(f"unpacking needs a complex128 word, got {word}")

            def codegen(context, builder, sig, args):
                values = [convert(builder, lane) for lane in _word_lanes(builder, args[0])]
                return context.make_tuple(builder, _F32X8, values)

            return _F32X8(word), codegen
        return intrinsic(typer)

    def _packer(convert):
        def typer(typingctx, vals):
            if vals != _F32X8:
                raise TypeError(f"packing needs {_F32X8}, got {vals}")

            def codegen(context, builder, sig, args):
                values = cgutils.unpack_tuple(builder, args[0], _LANES)
                return _lanes_word(context, builder, [convert(builder, v) for v in values])

            return types.complex128(vals), codegen
        return intrinsic(typer)

    _I8 = ir.IntType(8)

    def _e4m3_to_f32(builder, byte):
        """An e4m3fn byte as float32, exactly: its bits moved into an fp16 (sign, then
        exponent and mantissa 7 places up: the same value scaled by 2^-8, subnormals
        included), widened and scaled back by 256; 0x7F / 0xFF are NaN."""
        wide = builder.zext(byte, _I16)
        sign = builder.shl(builder.and_(wide, ir.Constant(_I16, 0x80)), ir.Constant(_I16, 8))
        mag = builder.and_(wide, ir.Constant(_I16, 0x7F))
        half = builder.or_(sign, builder.shl(mag, ir.Constant(_I16, 7)))
        value = builder.fmul(_fp16_to_f32(builder, half), ir.Constant(_F32, 256.0))
        nan = builder.icmp_unsigned("==", mag, ir.Constant(_I16, 0x7F))
        return builder.select(nan, ir.Constant(_F32, float("nan")), value)

    @intrinsic
    def _unpack_e4m3(typingctx, word):
        """The 8 e4m3 values of an 8-byte word (int64, memory order), as float32."""
        if word != types.int64:
            raise TypeError(f"unpacking e4m3 needs an int64 word, got {word}")

        def codegen(context, builder, sig, args):
            lanes = [builder.trunc(builder.lshr(args[0], ir.Constant(_I64, 8 * k)), _I8)
                     for k in range(_LANES)]
            return context.make_tuple(builder, _F32X8, [_e4m3_to_f32(builder, b) for b in lanes])

        return _F32X8(word), codegen

    _unpack_bf16 = _unpacker(_bf16_to_f32)
    _unpack_fp16 = _unpacker(_fp16_to_f32)
    _pack_bf16 = _packer(_f32_to_bf16)
    _pack_fp16 = _packer(_f32_to_fp16)

# --------------------------------------------------------------------------- kernel
# One thread per 16-byte output word. Every load a word needs (S statistics, S key
# counts, S partial words) is independent of the others and issued up front; which
# splits count is decided only after they arrive, with selects, so a thread waits for
# memory once instead of once for the statistics and again for the data. Splits are
# taken four at a time with an online maximum (the running sums rescaled when a later
# round raises it), so any S works with the registers of four.


@_device
def _stat(lse, kv_lens, s, S, nb, blk, h, tt):
    """Statistic of split s, or -inf past S or for a sub-row without keys."""
    if s >= S:
        return _NEG_INF
    n = s * nb + blk
    v = _as_f32(lse[n, h, tt])
    return v if kv_lens[n] > 0 else _NEG_INF


@_device
def _word_at(partial, s, S, blk, h, tt, w):
    """Word w of split s (read whether or not it counts: its weight decides), or 0."""
    if s < S:
        return load_word(partial, (s, blk, h, tt, w))
    return 0j


@_device
def _fold(acc, word, lse_s, m, fp16):
    """(acc + e * values(word), e) with e = exp(lse_s - m); the word is not touched for
    a split that does not count (it may hold NaN garbage)."""
    if not lse_s > _NEG_INF:
        return acc, _f32(0)
    e = _f32(math.exp(lse_s - m))
    x = _unpack_fp16(word) if fp16 else _unpack_bf16(word)
    return (acc[0] + e * x[0], acc[1] + e * x[1], acc[2] + e * x[2], acc[3] + e * x[3],
            acc[4] + e * x[4], acc[5] + e * x[5], acc[6] + e * x[6], acc[7] + e * x[7]), e


@_device
def _scaled(acc, r):
    return (acc[0] * r, acc[1] * r, acc[2] * r, acc[3] * r,
            acc[4] * r, acc[5] * r, acc[6] * r, acc[7] * r)


@_device
def _merge_word(partial, lse, kv_lens, S, nb, h, w, blk, tt, fp16):
    """Merged, normalised fp32 values of word w of row (t, h)."""
    z = _f32(0)
    acc = (z, z, z, z, z, z, z, z)
    den, m = z, _NEG_INF
    for s in range(0, S, 4):
        l0 = _stat(lse, kv_lens, s, S, nb, blk, h, tt)
        l1 = _stat(lse, kv_lens, s + 1, S, nb, blk, h, tt)
        l2 = _stat(lse, kv_lens, s + 2, S, nb, blk, h, tt)
        l3 = _stat(lse, kv_lens, s + 3, S, nb, blk, h, tt)
        x0 = _word_at(partial, s, S, blk, h, tt, w)
        x1 = _word_at(partial, s + 1, S, blk, h, tt, w)
        x2 = _word_at(partial, s + 2, S, blk, h, tt, w)
        x3 = _word_at(partial, s + 3, S, blk, h, tt, w)
        top = max(max(m, l0), max(max(l1, l2), l3))
        if top > _NEG_INF:
            if m > _NEG_INF and top > m:  # an earlier round's sums, onto the new maximum
                r = _f32(math.exp(m - top))
                acc, den = _scaled(acc, r), den * r
            m = top
            acc, e0 = _fold(acc, x0, l0, m, fp16)
            acc, e1 = _fold(acc, x1, l1, m, fp16)
            acc, e2 = _fold(acc, x2, l2, m, fp16)
            acc, e3 = _fold(acc, x3, l3, m, fp16)
            den += e0 + e1 + e2 + e3
    return _scaled(acc, _f32(1) / den if den > 0 else z)


@_device
def _store(out, t, h, w, vals, fp16):
    store_word(out, (t, h, w), _pack_fp16(vals) if fp16 else _pack_bf16(vals))


@_device
def _merge_words(out, partial, lse, kv_lens, seq_len, S, nb, H, W, block_size, fp16):
    # out: [T, H, W] words; partial: [S, nb, H, b, W] words (a view of token-major or
    # packed partials); lse: [S * nb, H, b] float32 bits (int32); kv_lens: [S * nb]
    # int32; fp16: values are fp16 (else bf16). S, nb, H, W, b: `_kernel`'s constants.
    T = nb * block_size
    z = _f32(0)
    for i in range(cuda.grid(1), T * H * W, cuda.gridsize(1)):
        row = i // W
        w = i - row * W
        t = row // H
        h = row - t * H
        blk = t // block_size
        vals = (z, z, z, z, z, z, z, z)
        if t < seq_len:
            vals = _merge_word(partial, lse, kv_lens, S, nb, h, w, blk,
                               t - blk * block_size, fp16)
        _store(out, t, h, w, vals, fp16)


# fp8 partials: the same merge over 8-byte words (the 8 e4m3 values of one output
# word), then the dequantizing factor, one multiply per value before the one rounding.


@_device
def _word_at8(partial, s, S, blk, h, tt, w):
    """8-byte word w of split s (read whether or not it counts), or 0."""
    if s < S:
        return load_word(partial, (s, blk, h, tt, w))
    return 0


@_device
def _fold8(acc, word, lse_s, m):
    """`_fold` of an fp8 word."""
    if not lse_s > _NEG_INF:
        return acc, _f32(0)
    e = _f32(math.exp(lse_s - m))
    x = _unpack_e4m3(word)
    return (acc[0] + e * x[0], acc[1] + e * x[1], acc[2] + e * x[2], acc[3] + e * x[3],
            acc[4] + e * x[4], acc[5] + e * x[5], acc[6] + e * x[6], acc[7] + e * x[7]), e


@_device
def _merge_word8(partial, lse, kv_lens, S, nb, h, w, blk, tt):
    """`_merge_word` of fp8 partials."""
    z = _f32(0)
    acc = (z, z, z, z, z, z, z, z)
    den, m = z, _NEG_INF
    for s in range(0, S, 4):
        l0 = _stat(lse, kv_lens, s, S, nb, blk, h, tt)
        l1 = _stat(lse, kv_lens, s + 1, S, nb, blk, h, tt)
        l2 = _stat(lse, kv_lens, s + 2, S, nb, blk, h, tt)
        l3 = _stat(lse, kv_lens, s + 3, S, nb, blk, h, tt)
        x0 = _word_at8(partial, s, S, blk, h, tt, w)
        x1 = _word_at8(partial, s + 1, S, blk, h, tt, w)
        x2 = _word_at8(partial, s + 2, S, blk, h, tt, w)
        x3 = _word_at8(partial, s + 3, S, blk, h, tt, w)
        top = max(max(m, l0), max(max(l1, l2), l3))
        if top > _NEG_INF:
            if m > _NEG_INF and top > m:
                r = _f32(math.exp(m - top))
                acc, den = _scaled(acc, r), den * r
            m = top
            acc, e0 = _fold8(acc, x0, l0, m)
            acc, e1 = _fold8(acc, x1, l1, m)
            acc, e2 = _fold8(acc, x2, l2, m)
            acc, e3 = _fold8(acc, x3, l3, m)
            den += e0 + e1 + e2 + e3
    return _scaled(acc, _f32(1) / den if den > 0 else z)


@_device
def _merge_words8(out, partial, lse, kv_lens, seq_len, scale, head_scale, S, nb, H, W,
                  block_size, hg, fp16):
    # partial: [S, nb, H, b, W] 8-byte words of e4m3; scale: [1] and head_scale: [H / hg]
    # float32 bits (int32). Otherwise as `_merge_words`.
    T = nb * block_size
    z = _f32(0)
    f0 = _as_f32(scale[0])
    for i in range(cuda.grid(1), T * H * W, cuda.gridsize(1)):
        row = i // W
        w = i - row * W
        t = row // H
        h = row - t * H
        blk = t // block_size
        vals = (z, z, z, z, z, z, z, z)
        if t < seq_len:
            vals = _merge_word8(partial, lse, kv_lens, S, nb, h, w, blk, t - blk * block_size)
            vals = _scaled(vals, f0 * _as_f32(head_scale[h // hg]))
        _store(out, t, h, w, vals, fp16)


@functools.lru_cache(maxsize=None)
def _kernel(S: int, nb: int, H: int, W: int, block_size: int, fp16: bool, fp8: bool = False,
            hg: int = 1) -> Kernel:
    """The kernel for one geometry, compiled with the splits, blocks, heads, words per
    row, block size and dtype as constants: the word's index divisions become
    multiplies and the loop over splits unrolls whole. An attention layout has one;
    a model's forwards a few. ``fp8``: e4m3 partials dequantized with a scale and
    per-head scales of ``hg`` heads each."""

    if fp8:
        @cuda.jit
        def _merge_split_kv_fp8_kernel(out, partial, lse, kv_lens, seq_len, scale, head_scale):
            _merge_words8(out, partial, lse, kv_lens, seq_len, scale, head_scale, S, nb, H, W,
                          block_size, hg, fp16)

        return Kernel(_merge_split_kv_fp8_kernel)

    @cuda.jit
    def _merge_split_kv_kernel(out, partial, lse, kv_lens, seq_len):
        _merge_words(out, partial, lse, kv_lens, seq_len, S, nb, H, W, block_size, fp16)

    return Kernel(_merge_split_kv_kernel)

# --------------------------------------------------------------------------- reference


def _flat_stats(lse, kv_lens, S, nb, b):
    """lse [S*nb, H, b(, 1)] -> [S, T, H]; kv_lens -> keep mask [S, T, H]."""
    H = lse.shape[1]
    stats = lse.reshape(S, nb, H, b).permute(0, 1, 3, 2).reshape(S, nb * b, H)  # [S, T, H]
    keep = (kv_lens.reshape(S, nb, 1, 1) > 0).expand(S, nb, b, H).reshape(S, nb * b, H)
    return stats.float(), keep


def merge_split_kv_reference(out, partial, lse, kv_lens, *, block_size: int,
                             seq_len: int, scale=None, head_scale=None) -> None:
    """Torch reference of :func:`merge_split_kv_` (same arguments, in place), fp32 math.

    Used on CPU and by tests. Masks instead of indexing: no host synchronisation and
    no host-to-device copy, so it can also be captured in a CUDA graph (benchmarks do).
    Accepts any floating ``partial``/``out`` dtype, so tests can merge fp32 partials;
    ``scale`` / ``head_scale`` multiply the merged rows as the kernel's fp8 path does.
    """
    partial = _token_major(partial, block_size)
    S, T, H, _ = partial.shape
    nb = T // block_size
    stats, keep = _flat_stats(lse, kv_lens, S, nb, block_size)         # [S, T, H]
    stats = stats.masked_fill(~keep, -math.inf)    # empty sub-rows weigh exp(-inf) = 0
    m = stats.amax(0)                                                   # [T, H]
    m = m.masked_fill(~torch.isfinite(m), 0)       # a block with no keys at all
    e = torch.exp(stats - m)                                            # [S, T, H]
    o = partial.float().masked_fill(~keep[..., None], 0)                # [S, T, H, D]
    acc = (e[..., None] * o).sum(0)                                     # [T, H, D]
    res = acc / e.sum(0).clamp_min(1)[..., None]   # the sum is >= 1, or 0 with acc = 0
    if scale is not None or head_scale is not None:
        res = res * _factors(scale, head_scale, H, res.device)[None, :, None]
    res[seq_len:] = 0
    out.copy_(res)


def _factors(scale, head_scale, H: int, device) -> torch.Tensor:
    """fp32 [H]: scale[0] * head_scale[h // (H / H_s)] (a missing one is 1)."""
    f = torch.ones(H, dtype=torch.float32, device=device)
    if head_scale is not None:
        f = head_scale.float().reshape(-1).repeat_interleave(H // head_scale.numel())
    if scale is not None:
        f = f * scale.float().reshape(-1)[0]
    return f


def _blocked(partial, b):
    """partial as the kernel reads it, [S, nb, H, b, D] (a view of [S, T, H, D])."""
    return partial if partial.dim() == 5 else partial.unflatten(1, (-1, b)).transpose(2, 3)


def _token_major(partial, b):
    """partial as [S, T, H, D] (a copy when it is the blocked [S, nb, H, b, D])."""
    return partial if partial.dim() == 4 else partial.transpose(2, 3).flatten(1, 2)


# --------------------------------------------------------------------------- checks


def _word_of(t: torch.Tensor) -> int:
    """Bytes of one load of t: 8 for fp8 partials (8 values), else 16."""
    return _WORD8 if t.dtype == _FP8 else _WORD


def _check_strides(name: str, t: torch.Tensor) -> None:
    """Raise unless t's rows are whole words apart (token and head strides)."""
    word = _word_of(t)
    per_word = word // t.element_size()
    if any(size > 1 and st % per_word for size, st in zip(t.shape[:-1], t.stride()[:-1])):
        raise ValueError(f"{name}: expected strides that are multiples of {per_word} "
                         f"elements ({word}-byte rows) except on the last dimension, "
                         f"got {tuple(t.stride())}")


def _check_address(name: str, t: torch.Tensor) -> None:
    """Raise unless t starts on a word boundary (needs real data: checked at run)."""
    word = _word_of(t)
    if t.data_ptr() % word:
        raise ValueError(f"{name}: expected a {word}-byte aligned start address, got "
                         f"{t.data_ptr():#x} (storage offset {t.storage_offset()})")


def _check_out(out) -> None:
    check_tensor("out", out, ndims=(3,), layout="[T, H, D]")
    if out.dtype not in _DTYPES:
        raise ValueError(f"out: expected dtype torch.bfloat16 or torch.float16, got {out.dtype}")
    if out.shape[2] % _LANES:
        raise ValueError(f"out: expected a head dimension D that is a multiple of {_LANES} "
                         f"(16-byte accesses), got D = {out.shape[2]}")
    check_last_dim_contiguous("out", out)
    check_no_overlap("out", out)
    _check_strides("out", out)


def _check_partial(partial, out, b) -> None:
    check_tensor("partial", partial, ndims=(4, 5), layout="[S, T, H, D] or [S, nb, H, b, D]")
    if partial.dtype not in (out.dtype, _FP8):
        raise ValueError(f"partial: expected dtype {out.dtype} (the dtype of out) or "
                         f"torch.float8_e4m3fn, got {partial.dtype}")
    T, H, D = out.shape
    want = (T, H, D) if partial.dim() == 4 else (T // b, H, b, D)
    if partial.shape[0] < 1 or tuple(partial.shape[1:]) != want:
        layout = "T, H, D of out" if partial.dim() == 4 else "nb, H, b, D of out and block_size"
        raise ValueError(f"partial: expected shape [S >= 1, {', '.join(map(str, want))}] "
                         f"({layout}), got {tuple(partial.shape)}")
    check_same_device("partial", partial, "out", out)
    check_last_dim_contiguous("partial", partial)
    _check_strides("partial", partial)


def _check_sizes(out, block_size, seq_len) -> None:
    T = out.shape[0]
    b = check_int("block_size", block_size, 1)
    if T % b:
        raise ValueError(f"block_size: expected a divisor of T = {T} (tokens of out), got {b}")
    if check_int("seq_len", seq_len) > T:
        raise ValueError(f"seq_len: expected an integer in [0, {T}] (T, tokens of out), "
                         f"got {seq_len}")


def _check_lse(lse, out, S, nb, b) -> None:
    check_tensor("lse", lse, ndims=(3, 4), layout="[S * nb, H, b] or [S * nb, H, b, 1]")
    if lse.dtype != torch.float32:
        raise ValueError(f"lse: expected dtype torch.float32, got {lse.dtype}")
    want = (S * nb, out.shape[1], b)
    if tuple(lse.shape[:3]) != want or lse.shape[3:] not in ((), (1,)):
        raise ValueError(f"lse: expected shape {list(want)} or {list(want) + [1]} "
                         f"(S * nb, H, block_size), got {tuple(lse.shape)}")
    check_same_device("lse", lse, "out", out)


def _check_kv_lens(kv_lens, out, S, nb) -> None:
    check_tensor("kv_lens", kv_lens, ndims=(1, 4), layout="[S * nb] or [S * nb, 1, 1, 1]")
    if kv_lens.dtype != torch.int32:
        raise ValueError(f"kv_lens: expected dtype torch.int32, got {kv_lens.dtype}")
    want = (S * nb,) if kv_lens.dim() == 1 else (S * nb, 1, 1, 1)
    if tuple(kv_lens.shape) != want:
        raise ValueError(f"kv_lens: expected shape {list(want)} (S * nb sub-rows), "
                         f"got {tuple(kv_lens.shape)}")
    check_same_device("kv_lens", kv_lens, "out", out)


def _check_scales(scale, head_scale, partial, out) -> None:
    if partial.dtype != _FP8:
        if scale is not None or head_scale is not None:
            raise ValueError(f"scale and head_scale dequantize fp8 partials, got a "
                             f"{partial.dtype} partial")
        return
    for name, t in (("scale", scale), ("head_scale", head_scale)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 1:
            got = f"{t.dtype} with {t.dim()} dims" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a 1-d torch.float32 tensor, got {got}")
        check_same_device(name, t, "out", out)
    if scale is not None and scale.numel() != 1:
        raise ValueError(f"scale: expected shape [1], got {tuple(scale.shape)}")
    H = out.shape[1]
    if head_scale is not None and (head_scale.numel() < 1 or H % head_scale.numel()):
        raise ValueError(f"head_scale: expected [H_s] with H_s dividing H = {H} (heads of "
                         f"out), got {tuple(head_scale.shape)}")


def _check(out, partial, lse, kv_lens, block_size, seq_len, scale=None, head_scale=None) -> None:
    _check_out(out)
    _check_sizes(out, block_size, seq_len)
    _check_partial(partial, out, block_size)
    S, nb = partial.shape[0], out.shape[0] // block_size
    _check_lse(lse, out, S, nb, block_size)
    _check_kv_lens(kv_lens, out, S, nb)
    _check_scales(scale, head_scale, partial, out)


# --------------------------------------------------------------------------- op


def _is_noop(out) -> bool:
    return out.numel() == 0


def _kernel_args(out, partial, lse, kv_lens, block_size, seq_len, scale=None, head_scale=None):
    T, H, D = out.shape
    words = T * H * (D // _LANES)
    threads = _launch.threads_for(words)
    lse3 = lse if lse.dim() == 3 else lse[..., 0]  # [S * nb, H, b]
    fp8 = partial.dtype == _FP8
    args = [array_arg(out, _WORD), array_arg(_blocked(partial, block_size), _word_of(partial)),
            array_arg(lse3), array_arg(kv_lens.reshape(-1)), int_arg(seq_len)]
    hg = 1
    if fp8:  # a missing factor is 1
        one = None if scale is not None and head_scale is not None else torch.ones(
            1, dtype=torch.float32, device=out.device)
        scale = one if scale is None else scale
        head_scale = one if head_scale is None else head_scale
        hg = H // head_scale.numel()
        args += [array_arg(scale.reshape(1)), array_arg(head_scale)]
    kernel = _kernel(partial.shape[0], T // block_size, H, D // _LANES, block_size,
                     out.dtype == torch.float16, fp8, hg)
    return kernel, args, blocks_for(-(-words // threads)), threads


def _run(out, partial, lse, kv_lens, block_size, seq_len, scale=None, head_scale=None) -> None:
    if _is_noop(out):
        return
    _check_address("out", out)
    _check_address("partial", partial)
    if not use_kernel(out):
        merge_split_kv_reference(out, partial, lse, kv_lens, block_size=block_size,
                                 seq_len=seq_len, scale=scale, head_scale=head_scale)
        return
    kernel, args, grid, block = _kernel_args(out, partial, lse, kv_lens, block_size, seq_len,
                                             scale, head_scale)
    kernel.launch(grid, block, args, out.device)


@torch.library.custom_op("framekv::merge_split_kv_", mutates_args=("out",))
def _merge_split_kv_op(out: torch.Tensor, partial: torch.Tensor, lse: torch.Tensor,
                       kv_lens: torch.Tensor, block_size: int, seq_len: int,
                       scale: Optional[torch.Tensor] = None,
                       head_scale: Optional[torch.Tensor] = None) -> None:
    _run(out, partial, lse, kv_lens, block_size, seq_len, scale, head_scale)


@_merge_split_kv_op.register_fake
def _(out, partial, lse, kv_lens, block_size, seq_len, scale=None, head_scale=None) -> None:
    return None


def merge_split_kv_(out: torch.Tensor, partial: torch.Tensor, lse: torch.Tensor,
                    kv_lens: torch.Tensor, *, block_size: int, seq_len: int,
                    scale: torch.Tensor | None = None,
                    head_scale: torch.Tensor | None = None) -> None:
    """Merge split-KV partial attention outputs into ``out``, in place.

    Row (t, h) of causal block i = t // block_size becomes
    ``sum_s w_s * partial[s, t, h]`` with ``w_s = exp(l_s - m) / sum_r exp(l_r - m)``,
    ``l_s = lse[s * nb + i, h, t % block_size]`` and ``m = max_s l_s``, over the splits
    whose sub-row has keys (``kv_lens[s * nb + i] > 0``); fp32 accumulation, one
    rounding. Rows of a block with no keys in any sub-row, and rows t >= seq_len, are
    zeros.

    Args:
        out: [T, H, D] bf16 or fp16, written; any token and head strides (e.g. a view
            of a packed output), D contiguous and a multiple of 8, rows 16-byte aligned.
        partial: [S, T, H, D] the dtype of out or float8_e4m3fn, S >= 1 (split s of
            block i at tokens i*b .. i*b+b-1); contiguous from cuDNN, any strides of
            whole words work (16 bytes; 8 for fp8).
            Or [S, nb, H, b, D], block by block (cuDNN's layout of packed GQA rows,
            `framekv.engine.attention.packing`): ``partial[s, i, h, t]`` is token
            i*b + t.
        lse: float32 [S * nb, H, b] or [S * nb, H, b, 1] (cuDNN's stats layout),
            natural-log logsumexp of each sub-row's scaled scores; any strides.
        kv_lens: int32 [S * nb] or [S * nb, 1, 1, 1], the key count of each sub-row.
        block_size: b, the causal block size; divides T (nb = T // b blocks).
        seq_len: real tokens, 0 <= seq_len <= T; rows past it are padding.
        scale, head_scale: fp8 partials only (ValueError otherwise): float32 [1] and
            [H_s] (H_s divides H); row (t, h) of the merge is multiplied by ``scale[0]
            * head_scale[h // (H / H_s)]`` before its rounding. Each defaults to 1.

    Statistics of non-empty sub-rows are assumed finite (not checked on the device).
    Reads only device memory at run time, so a captured CUDA graph merges whatever
    the tensors hold at replay. Raises ValueError naming the bad argument. One kernel
    on torch's current stream for CUDA tensors; the torch reference on CPU.
    """
    _check(out, partial, lse, kv_lens, block_size, seq_len, scale, head_scale)
    if _is_noop(out):
        return
    _merge_split_kv_op(out, partial, lse, kv_lens, block_size, seq_len, scale, head_scale)
