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
16 of fp32): the caller guarantees that the four are in bounds and that their address
is a multiple of the access size (`vector_aligned`).

``round_f32(ary, value)`` is a float32 rounded to the array's format and widened back:
what `store_f32` then `load_f32` would give, without the round trip through memory.

``quotient(a, reciprocal_bits(d))`` is ``a // d`` for an int ``0 <= a < 2^50`` and a
divisor fixed at launch: ``floor((a + 1/2) * (1/d))`` in fp64 is exact there (the exact
quotient is at least ``1/(2d)`` from an integer, far beyond the rounding), and it spares
the dozens of instructions of a 64-bit integer division in a kernel's index math.

Under numba's CUDA simulator the same names are numpy bit views.
"""
from __future__ import annotations

import functools
import struct

import numpy as np
import torch

from ._launch import SIMULATOR

__all__ = ["load_f32", "store_f32", "load_f32x4", "store_f32x4", "round_f32", "quotient",
           "reciprocal_bits", "FLOAT_DTYPES", "check_float_dtype", "vector_aligned"]

#: The tensor dtypes these accessors handle (as int16 and int32 bits).
FLOAT_DTYPES = (torch.bfloat16, torch.float32)


def check_float_dtype(name: str, t: torch.Tensor) -> None:
    """ValueError unless ``t`` is bf16 or fp32 (the formats the float kernels read)."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must have dtype bfloat16 or float32, got {t.dtype}")


def vector_aligned(t: torch.Tensor) -> bool:
    """Whether every group of four elements ``[..., 4k : 4k + 4]`` of ``t`` may be moved
    by `load_f32x4` / `store_f32x4`: last dimension contiguous and a multiple of 4, every
    other stride a multiple of 4 elements (0 included), the address 4-element aligned."""
    if t.dim() == 0 or t.shape[-1] % 4 or (t.shape[-1] > 1 and t.stride(-1) != 1):
        return False
    return (all(st % 4 == 0 for st in t.stride()[:-1])
            and t.data_ptr() % (4 * t.element_size()) == 0)


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

    def store_f32x4(ary, idx, values):
        """Store four float32 to ``ary[..., j : j + 4]``, rounded to the array's format."""
        for k in range(4):
            store_f32(ary, _last(idx, k), values[k])

    def round_f32(ary, value):
        """float32 ``value`` rounded to ary's format (bf16 or fp32 bits), as float32."""
        tmp = np.zeros(1, dtype=ary.dtype)
        store_f32(tmp, (0,), value)
        return load_f32(tmp, (0,))

    def load_f32(ary, idx):
        """``ary[idx]`` (bf16 or fp32 bits) as float32."""
        bits = ary[idx]
        if bits.dtype == np.int16:
            return (np.array([bits]).view(np.uint16).astype(np.uint32) << 16).view(np.float32)[0]
        return np.array([bits]).view(np.float32)[0]

    def store_f32(ary, idx, value):
        """Store float32 ``value`` to ``ary[idx]``, rounded to the array's format."""
        f = np.array([value], dtype=np.float32)
        if ary[idx].dtype == np.int16:
            b = f.view(np.uint32).astype(np.uint64)
            h = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
            if np.isnan(f[0]):
                h[0] = 0x7FC0
            ary[idx] = h.view(np.int16)[0]
        else:
            ary[idx] = f.view(np.int32)[0]

else:
    from llvmlite import ir
    from numba import cuda, float64, int64, types
    from numba.cuda import cgutils, libdevice
    from numba.cuda.extending import intrinsic

    _I16, _I32, _F32 = ir.IntType(16), ir.IntType(32), ir.FloatType()

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
    def quotient(a, inv_bits):
        """``a // d`` from ``inv_bits = reciprocal_bits(d)`` (module doc)."""
        return int64((float64(a) + 0.5) * libdevice.longlong_as_double(inv_bits))

    def _check_bits(ary):
        if not isinstance(ary, types.Array) or ary.dtype not in (types.int16, types.int32):
            raise TypeError(f"float access needs int16 (bf16) or int32 (fp32) bits, got {ary}")

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

    @intrinsic
    def load_f32(typingctx, ary, idx):
        """``ary[idx]`` (bf16 or fp32 bits) as float32."""
        _check(ary, idx)

        def codegen(context, builder, sig, args):
            ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
            bits = builder.load(ptr)
            if sig.args[0].dtype == types.int16:
                return bf16_to_f32_ir(builder, bits)
            return builder.bitcast(bits, _F32)

        return types.float32(ary, idx), codegen

    _F32X4 = types.UniTuple(types.float32, 4)

    def _vector_pointer(context, builder, sig, args):
        """Pointer to ary[idx] as a <4 x i16> / <4 x i32> vector, and its alignment (the
        last dimension steps by the element size: `vector_aligned`)."""
        ptr = _pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1],
                       unit_last=True)
        bits = _I16 if sig.args[0].dtype == types.int16 else _I32
        vec = ir.VectorType(bits, 4)
        return builder.bitcast(ptr, vec.as_pointer()), 4 * (bits.width // 8), bits

    @intrinsic
    def load_f32x4(typingctx, ary, idx):
        """The four floats ``ary[..., j : j + 4]`` (idx names j) as float32, one load."""
        _check(ary, idx)

        def codegen(context, builder, sig, args):
            ptr, align, bits = _vector_pointer(context, builder, sig, args)
            word = builder.load(ptr, align=align)
            out = []
            for k in range(4):
                lane = builder.extract_element(word, ir.Constant(_I32, k))
                out.append(bf16_to_f32_ir(builder, lane) if bits is _I16
                           else builder.bitcast(lane, _F32))
            return context.make_tuple(builder, _F32X4, out)

        return _F32X4(ary, idx), codegen

    @intrinsic
    def store_f32x4(typingctx, ary, idx, values):
        """Store four float32 to ``ary[..., j : j + 4]``, rounded, with one store."""
        _check(ary, idx)
        if not isinstance(values, types.BaseTuple) or len(values) != 4:
            raise TypeError(f"store_f32x4 needs a tuple of 4 numbers, got {values}")

        def codegen(context, builder, sig, args):
            ptr, align, bits = _vector_pointer(context, builder, sig, args[:2])
            vals = cgutils.unpack_tuple(builder, args[2], 4)
            word = ir.Constant(ir.VectorType(bits, 4), None)
            for k, (v, ty) in enumerate(zip(vals, sig.args[2])):
                v = context.cast(builder, v, ty, types.float32)
                lane = f32_to_bf16_ir(builder, v) if bits is _I16 else builder.bitcast(v, _I32)
                word = builder.insert_element(word, lane, ir.Constant(_I32, k))
            builder.store(word, ptr, align=align)

        return types.void(ary, idx, values), codegen

    @intrinsic
    def round_f32(typingctx, ary, value):
        """float32 ``value`` rounded to ary's format (bf16 or fp32 bits), as float32."""
        _check_bits(ary)

        def codegen(context, builder, sig, args):
            v = context.cast(builder, args[1], sig.args[1], types.float32)
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
            bits = f32_to_bf16_ir(builder, v) if sig.args[0].dtype == types.int16 else builder.bitcast(v, _I32)
            builder.store(bits, ptr)

        return types.void(ary, idx, value), codegen
