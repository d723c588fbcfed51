"""Float loads and stores for kernels that compute on bf16 or fp32 tensors.

numba has no bfloat16 array type and torch exports none, so the ops pass every
float tensor as raw bits (`_launch.array_arg`: bf16 as int16, fp32 as int32) and
convert at the access: ``load_f32(ary, idx)`` reads one element as float32 and
``store_f32(ary, idx, value)`` writes a float32 rounded to the array's format
(bf16: round to nearest even on the bits, as torch does, NaN -> 0x7FC0). The
element type picks the conversion when the kernel is compiled, so one kernel body
serves both formats (one compiled specialisation each).

``load_f32x4(ary, idx)`` / ``store_f32x4(ary, idx, values)`` move the four consecutive
elements ``idx[-1] .. idx[-1] + 3`` of the last dimension as one access (8 bytes of bf16,
16 of fp32, 4 of e4m3): the caller guarantees that the four are in bounds and that
their address is a multiple of the access size (`vector_aligned`). ``load_f32x8`` /
``store_f32x8`` move eight the same way (16 bytes of bf16, 8 of e4m3; fp32 as two
16-byte accesses), their address a multiple of the group's size or 16 bytes, the smaller
(``vector_aligned(t, 8)``).

``round_f32(ary, value)`` is a float32 rounded to the array's format and widened back:
what `store_f32` then `load_f32` would give, without the round trip through memory.

``quotient(a, reciprocal_bits(d))`` is ``a // d`` for an int ``0 <= a < 2^50`` and a
divisor fixed at launch: ``floor((a + 1/2) * (1/d))`` in fp64 is exact there (the exact
quotient is at least ``1/(2d)`` from an integer, far beyond the rounding), and it spares
the dozens of instructions of a 64-bit integer division in a kernel's index math.

fp8 e4m3 (``torch.float8_e4m3fn``, max finite 448) arrives as int8 bits. Stores to an
int8 array (`store_f32`, `store_f32x4`, `store_f32x8`) write ``e4m3_bits(value)``: the value clamped
to [-448, 448] (so inf saturates), then rounded to nearest even, as torch's
``x.clamp(-448, 448).to(torch.float8_e4m3fn)`` rounds; every NaN becomes 0x7F (torch
keeps a NaN's sign, and a negative NaN's bits differ between CPU and GPU arithmetic,
so one NaN byte keeps kernel and reference equal). On the GPU that is the hardware's
``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+), which saturates exactly as the clamp does.
`load_f32` and `round_f32` read e4m3 exactly. ``f32_bits(value)`` is a float32's bits
as an int32: for values >= 0 the integer order is the float order, so an int32 atomic
max on the bits keeps a float max (`cuda.atomic.max` on raw-bit arrays).

Under numba's CUDA simulator the same names are numpy bit views.

One file: one set of names, the simulator's and the device's implementations of each
side by side.
"""
from __future__ import annotations

import functools
import math
import struct

import numpy as np
import torch

from ._launch import SIMULATOR

__all__ = ["load_f32", "store_f32", "load_f32x4", "store_f32x4", "load_f32x8", "store_f32x8",
           "round_f32", "quotient",
           "reciprocal_bits", "FLOAT_DTYPES", "check_float_dtype", "vector_aligned",
           "FP8_DTYPE", "E4M3_MAX", "E4M3_NAN", "e4m3_bits", "f32_bits", "bits_f32"]

#: The tensor dtypes these accessors handle (as int16 and int32 bits).
FLOAT_DTYPES = (torch.bfloat16, torch.float32)
#: The fp8 format the stores write to int8 bits, its largest finite value, its NaN byte.
FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_NAN = 0x7F


def check_float_dtype(name: str, t: torch.Tensor) -> None:
    """ValueError unless ``t`` is bf16 or fp32 (the formats the float kernels read)."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must have dtype bfloat16 or float32, got {t.dtype}")


def vector_aligned(t: torch.Tensor, n: int = 4) -> bool:
    """Whether every group of n (4 or 8) elements ``[..., nk : nk + n]`` of ``t`` may be
    moved by `load_f32x4` / `store_f32x4` (n = 4) or their eight-wide twins: last
    dimension contiguous and a multiple of n, every other stride a multiple of n
    elements (0 included), the address aligned to the group (16 bytes at most)."""
    if t.dim() == 0 or t.shape[-1] % n or (t.shape[-1] > 1 and t.stride(-1) != 1):
        return False
    return (all(st % n == 0 for st in t.stride()[:-1])
            and t.data_ptr() % min(16, n * t.element_size()) == 0)


@functools.lru_cache(maxsize=256)
def reciprocal_bits(d: int) -> int:
    """The fp64 bits of ``1 / d`` as an int (a kernel argument for `quotient`)."""
    return struct.unpack("<q", struct.pack("<d", 1.0 / d))[0]


if SIMULATOR:

    def quotient(a, inv_bits):
        """``a // d`` from ``inv_bits = reciprocal_bits(d)`` (module doc)."""
        return int((np.float64(a) + 0.5) * np.int64(inv_bits).view(np.float64))

    def _last(idx, k):
        return tuple(idx[:-1]) + (idx[-1] + k,)

    def load_f32x4(ary, idx):
        """The four floats ``ary[..., j : j + 4]`` (idx names j) as float32."""
        return tuple(load_f32(ary, _last(idx, k)) for k in range(4))

    def load_f32x8(ary, idx):
        """The eight floats ``ary[..., j : j + 8]`` (idx names j) as float32."""
        return tuple(load_f32(ary, _last(idx, k)) for k in range(8))

    def store_f32x4(ary, idx, values):
        """Store four float32 to ``ary[..., j : j + 4]``, rounded to the array's format."""
        for k in range(4):
            store_f32(ary, _last(idx, k), values[k])

    def store_f32x8(ary, idx, values):
        """Store eight float32 to ``ary[..., j : j + 8]``, rounded to the array's format."""
        for k in range(8):
            store_f32(ary, _last(idx, k), values[k])

    def round_f32(ary, value):
        """float32 ``value`` rounded to ary's format (bf16, fp32 or e4m3 bits), as float32."""
        tmp = np.zeros(1, dtype=ary.dtype)
        store_f32(tmp, (0,), value)
        return load_f32(tmp, (0,))

    # e4m3 bytes 0 .. 255 as float32 (0x7F and 0xFF are NaN)
    _E4M3_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(
        torch.float8_e4m3fn).float().numpy()

    def e4m3_bits(value):
        """float32 ``value`` as e4m3fn bits (an int 0 .. 255): clamped to +-448, rounded
        to nearest even, NaN -> 0x7F (module doc)."""
        f = np.float32(value)
        if np.isnan(f):
            return E4M3_NAN
        sign = 0x80 if np.signbit(f) else 0
        a = min(abs(float(f)), E4M3_MAX)  # float64: the scalings below are exact
        if a < 2.0 ** -6:  # subnormal: steps of 2^-9, 8 steps reach the smallest normal
            return sign | round(a * 512.0)
        e = math.frexp(a)[1] - 1  # a = 1.m * 2^e, 3 mantissa bits: steps of 2^(e-3)
        # round() is to nearest even; 16 steps carry into the next exponent
        return sign | (((e + 7) << 3) + round(a * 2.0 ** (3 - e)) - 8)

    def f32_bits(value):
        """float32 ``value``'s bits as an int32."""
        return np.float32(value).view(np.int32)

    def bits_f32(bits):
        """The float32 whose bits are the int ``bits`` (a kernel argument, `f32_bits`)."""
        return np.array([bits], dtype=np.int64).astype(np.int32).view(np.float32)[0]

    def load_f32(ary, idx):
        """``ary[idx]`` (bf16, fp32 or e4m3 bits) as float32."""
        bits = ary[idx]
        if bits.dtype == np.int8:
            return _E4M3_VALUES[int(bits) & 0xFF]
        if bits.dtype == np.int16:
            return (np.array([bits]).view(np.uint16).astype(np.uint32) << 16).view(np.float32)[0]
        return np.array([bits]).view(np.float32)[0]

    def store_f32(ary, idx, value):
        """Store float32 ``value`` to ``ary[idx]``, rounded to the array's format."""
        f = np.array([value], dtype=np.float32)
        if ary[idx].dtype == np.int8:
            ary[idx] = np.uint8(e4m3_bits(f[0])).view(np.int8)
        elif ary[idx].dtype == np.int16:
            b = f.view(np.uint32).astype(np.uint64)
            h = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
            if np.isnan(f[0]):
                h[0] = 0x7FC0
            ary[idx] = h.view(np.int16)[0]
        else:
            ary[idx] = f.view(np.int32)[0]

else:
    from llvmlite import ir
    from numba import cuda, float64, int32, int64, types
    from numba.cuda import cgutils, libdevice
    from numba.cuda.extending import intrinsic

    _I8, _I16, _I32, _F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()

    def _pointer(context, builder, aryty, ary, idxty, idx, unit_last=False):
        """Pointer to ary[idx]; ``unit_last``: the last dimension steps by the element
        size (the caller's promise), so its runtime stride, a 64-bit multiply per
        access, is left out."""
        arr = context.make_array(aryty)(context, builder, value=ary)
        indices = cgutils.unpack_tuple(builder, idx, count=len(idxty))
        indices = [context.cast(builder, i, t, types.intp) for i, t in zip(indices, idxty)]
        if not unit_last:
            return cgutils.get_item_pointer(context, builder, aryty, arr, indices,
                                            wraparound=False)
        itemsize = context.get_constant(types.intp, aryty.dtype.bitwidth // 8)
        strides = cgutils.unpack_tuple(builder, arr.strides, count=aryty.ndim)[:-1] + [itemsize]
        offset = context.get_constant(types.intp, 0)
        for i, st in zip(indices, strides):
            offset = builder.add(offset, builder.mul(i, st))
        data = builder.ptrtoint(arr.data, offset.type)
        return builder.inttoptr(builder.add(data, offset), arr.data.type)

    @cuda.jit(device=True, forceinline=True)
    def bits_f32(bits):
        """The float32 whose bits are the int ``bits`` (a kernel argument, `f32_bits`)."""
        return libdevice.int_as_float(int32(bits))

    @cuda.jit(device=True, forceinline=True)
    def quotient(a, inv_bits):
        """``a // d`` from ``inv_bits = reciprocal_bits(d)`` (module doc)."""
        return int64((float64(a) + 0.5) * libdevice.longlong_as_double(inv_bits))

    def _check_bits(ary):
        if not isinstance(ary, types.Array) or ary.dtype not in (types.int8, types.int16,
                                                                 types.int32):
            raise TypeError(f"float access needs int8 (e4m3), int16 (bf16) or int32 (fp32) "
                            f"bits, got {ary}")

    def _check(ary, idx):
        _check_bits(ary)
        if not isinstance(idx, types.UniTuple) or idx.count != ary.ndim:
            raise TypeError(f"float access needs {ary.ndim} indices, got {idx}")

    def bf16_to_f32_ir(builder, lane):
        """LLVM IR: an i16 of bf16 bits as a float (the kernels' word unpackers too)."""
        return builder.bitcast(builder.shl(builder.zext(lane, _I32), ir.Constant(_I32, 16)),
                               _F32)

    def f32_to_bf16_ir(builder, value):
        """LLVM IR: a float rounded to bf16 bits (i16), nearest even as torch rounds;
        NaN becomes 0x7FC0. The rounding is the hardware's ``cvt.rn.bf16.f32`` (sm_80+):
        one instruction where the same rounding on the bits needs six, in kernels that
        are bound by the instructions they issue; it rounds every non-NaN value exactly
        as the bit formula ``(b + 0x7FFF + ((b >> 16) & 1)) >> 16`` does."""
        cvt = ir.InlineAsm(ir.FunctionType(_I16, [_F32]), "cvt.rn.bf16.f32 $0, $1;", "=h,f")
        rounded = builder.call(cvt, [value])
        nan = builder.fcmp_unordered("uno", value, value)
        return builder.select(nan, ir.Constant(_I16, 0x7FC0), rounded)

    def e4m3_canon_ir(builder, word):
        """LLVM IR: an integer of e4m3 bytes with every NaN byte made 0x7F (the
        hardware keeps a NaN's sign). ``satfinite`` never writes 0x7F or 0xFF for a
        number, so a byte is NaN iff its low seven bits are all ones: adding 1 to
        them carries into bit 7 exactly there (no carry leaves a byte), and that bit
        clears the sign. Three instructions per word, however many bytes it holds."""
        width = word.type.width // 8

        def rep(byte):
            return ir.Constant(word.type, int.from_bytes(bytes([byte]) * width, "little"))

        low = builder.and_(word, rep(0x7F))
        nan = builder.and_(builder.add(low, rep(0x01)), rep(0x80))
        return builder.and_(word, builder.not_(nan))

    def _e4m3x2_raw_ir(builder, lo, hi):
        cvt = ir.InlineAsm(ir.FunctionType(_I16, [_F32, _F32]),
                           "cvt.rn.satfinite.e4m3x2.f32 $0, $1, $2;", "=h,f,f")
        return builder.call(cvt, [hi, lo])

    def e4m3x2_ir(builder, lo, hi):
        """LLVM IR: two floats as e4m3 bits in an i16, ``lo`` in the low byte (the lower
        address), clamped to +-448 and rounded to nearest even by the hardware's
        ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+; its first source goes to the upper
        byte); a NaN becomes 0x7F."""
        return e4m3_canon_ir(builder, _e4m3x2_raw_ir(builder, lo, hi))

    def e4m3_words_ir(builder, vals):
        """LLVM IR: 4k floats as k i32 words of e4m3 bytes (value i at byte i % 4 of
        word i // 4, the lower address first), each as `e4m3x2_ir` writes it: two
        conversions merged into one register per word, then `e4m3_canon_ir`."""
        asm = ir.InlineAsm(ir.FunctionType(_I32, [_F32] * 4),
                           "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
                           "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
                           "=r,f,f,f,f")
        return [e4m3_canon_ir(builder, builder.call(asm, vals[k:k + 4]))
                for k in range(0, len(vals), 4)]

    def e4m3_to_f32_ir(builder, byte):
        """LLVM IR: an i8 of e4m3 bits as a float (exact: through the hardware's
        ``cvt.rn.f16x2.e4m3x2``, sm_89+, and an exact widening of the half)."""
        cvt = ir.InlineAsm(ir.FunctionType(_I32, [_I16]), "cvt.rn.f16x2.e4m3x2 $0, $1;", "=r,h")
        halves = builder.call(cvt, [builder.zext(byte, _I16)])
        half = builder.bitcast(builder.trunc(halves, _I16), ir.HalfType())
        return builder.fpext(half, _F32)

    def _store_ir(builder, aryty, ptr, value):
        """Store a float to ``ptr``, rounded to the format of ``aryty``'s bits."""
        if aryty.dtype == types.int8:
            builder.store(builder.trunc(e4m3x2_ir(builder, value, ir.Constant(_F32, 0.0)),
                                        _I8), ptr)
        elif aryty.dtype == types.int16:
            builder.store(f32_to_bf16_ir(builder, value), ptr)
        else:
            builder.store(builder.bitcast(value, _I32), ptr)

    def _load_ir(builder, aryty, bits):
        """The float of raw ``bits`` loaded from an array of ``aryty``."""
        if aryty.dtype == types.int8:
            return e4m3_to_f32_ir(builder, bits)
        if aryty.dtype == types.int16:
            return bf16_to_f32_ir(builder, bits)
        return builder.bitcast(bits, _F32)

    def float_intrinsic(name: str, result, emit, doc: str):
        """An intrinsic of one float argument, cast to float32 ``v``: ``emit(builder, v)``
        builds its value of numba type ``result`` (``doc`` its docstring)."""

        @intrinsic
        def fn(typingctx, value):
            if not isinstance(value, types.Float):
                raise TypeError(f"{name} needs a float, got {value}")

            def codegen(context, builder, sig, args):
                return emit(builder, context.cast(builder, args[0], sig.args[0], types.float32))

            return result(value), codegen

        fn.__doc__ = doc
        return fn

    e4m3_bits = float_intrinsic(
        "e4m3_bits", types.int32,
        lambda b, v: b.zext(b.trunc(e4m3x2_ir(b, v, ir.Constant(_F32, 0.0)), _I8), _I32),
        "float32 ``value`` as e4m3fn bits (an int32 0 .. 255; module doc).")
    f32_bits = float_intrinsic("f32_bits", types.int32, lambda b, v: b.bitcast(v, _I32),
                               "float32 ``value``'s bits as an int32.")

    @intrinsic
    def load_f32(typingctx, ary, idx):
        """``ary[idx]`` (bf16, fp32 or e4m3 bits) as float32."""
        _check(ary, idx)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            return _load_ir(builder, sig.args[0], builder.load(ptr))

        return types.float32(ary, idx), codegen

    def _vector_pointer(context, builder, sig, args, n):
        """Pointer to ary[idx] as an <n x i8 / i16 / i32> vector, and the alignment
        `vector_aligned` promises (the group's size, at most 16 bytes: a wider group
        moves as several 16-byte accesses; the last dimension steps by the element
        size)."""
        ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                       unit_last=True)
        bits = ir.IntType(sig.args[0].dtype.bitwidth)
        vec = ir.VectorType(bits, n)
        return builder.bitcast(ptr, vec.as_pointer()), min(16, n * (bits.width // 8)), bits

    def _vector_load(n):
        """The intrinsic loading ``ary[..., j : j + n]`` (idx names j) as n float32."""
        tup = types.UniTuple(types.float32, n)

        @intrinsic
        def load(typingctx, ary, idx):
            _check(ary, idx)

            def codegen(context, builder, sig, args):
                ptr, align, bits = _vector_pointer(context, builder, sig, args, n)
                if bits.width == 16 and n == 8:
                    # as 32-bit words, each unpacked in place (a <8 x i16> load would
                    # be two: PTX has no v8.u16)
                    words = ir.VectorType(_I32, n // 2)
                    word = builder.load(builder.bitcast(ptr, words.as_pointer()), align=align)
                    out = []
                    for k in range(n // 2):
                        w = builder.extract_element(word, ir.Constant(_I32, k))
                        out += [builder.bitcast(builder.shl(w, ir.Constant(_I32, 16)), _F32),
                                builder.bitcast(builder.and_(w, ir.Constant(_I32, 0xFFFF0000)),
                                                _F32)]
                    return context.make_tuple(builder, tup, out)
                word = builder.load(ptr, align=align)
                out = [_load_ir(builder, sig.args[0],
                                builder.extract_element(word, ir.Constant(_I32, k)))
                       for k in range(n)]
                return context.make_tuple(builder, tup, out)

            return tup(ary, idx), codegen

        return load

    def _vector_store(n):
        """The intrinsic storing n float32 to ``ary[..., j : j + n]``, rounded to the
        array's format: one store (e4m3: the converted pairs as one integer word)."""

        @intrinsic
        def store(typingctx, ary, idx, values):
            _check(ary, idx)
            if not isinstance(values, types.BaseTuple) or len(values) != n:
                raise TypeError(f"store_f32x{n} needs a tuple of {n} numbers, got {values}")

            def codegen(context, builder, sig, args):
                ptr, align, bits = _vector_pointer(context, builder, sig, args[:2], n)
                vals = [context.cast(builder, v, ty, types.float32) for v, ty in
                        zip(cgutils.unpack_tuple(builder, args[2], n), sig.args[2])]
                if bits.width == 8:
                    words = e4m3_words_ir(builder, vals)
                    vec = ir.Constant(ir.VectorType(_I32, n // 4), None)
                    for k, w in enumerate(words):
                        vec = builder.insert_element(vec, w, ir.Constant(_I32, k))
                    builder.store(vec, builder.bitcast(ptr, vec.type.as_pointer()), align=align)
                    return
                word = ir.Constant(ir.VectorType(bits, n), None)
                for k, v in enumerate(vals):
                    lane = f32_to_bf16_ir(builder, v) if bits is _I16 else builder.bitcast(v, _I32)
                    word = builder.insert_element(word, lane, ir.Constant(_I32, k))
                builder.store(word, ptr, align=align)

            return types.void(ary, idx, values), codegen

        return store

    load_f32x4, load_f32x8 = _vector_load(4), _vector_load(8)
    store_f32x4, store_f32x8 = _vector_store(4), _vector_store(8)

    @intrinsic
    def round_f32(typingctx, ary, value):
        """float32 ``value`` rounded to ary's format (bf16 or fp32 bits), as float32."""
        _check_bits(ary)

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[1], sig.args[1], types.float32)
            if sig.args[0].dtype == types.int8:
                pair = e4m3x2_ir(builder, v, ir.Constant(_F32, 0.0))
                return e4m3_to_f32_ir(builder, builder.trunc(pair, _I8))
            if sig.args[0].dtype == types.int16:
                return bf16_to_f32_ir(builder, f32_to_bf16_ir(builder, v))
            return v

        return types.float32(ary, value), codegen

    @intrinsic
    def store_f32(typingctx, ary, idx, value):
        """Store float32 ``value`` to ``ary[idx]``, rounded to the array's format."""
        _check(ary, idx)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            v = context.cast(builder, args[2], sig.args[2], types.float32)
            _store_ir(builder, sig.args[0], ptr, v)

        return types.void(ary, idx, value), codegen
