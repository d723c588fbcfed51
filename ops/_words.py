"""Word loads and stores for the kernels.

The K/V kernels never look at values: they move raw words of 1, 2, 4, 8 or 16 bytes
(arrays viewed as int8/int16/int32/int64, and complex128 for 16 bytes). Plain numba
indexing of a complex128 array compiles to two 8-byte accesses through generic
addresses; ``load_word``/``store_word`` instead emit one global access of the whole
word (``ld.global.v2.f64``/``st.global.v2.f64`` for 16 bytes), aligned to its size.
Callers guarantee that alignment (``_launch.pick_word_size``).

Under numba's CUDA simulator kernels run as Python, so the same names are plain
indexing there.
"""
from __future__ import annotations

from ._launch import SIMULATOR

__all__ = ["load_word", "store_word"]

if SIMULATOR:

    def load_word(ary, idx):
        """Return ``ary[idx]``."""
        return ary[idx]

    def store_word(ary, idx, value):
        """Set ``ary[idx] = value``."""
        ary[idx] = value

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    _I32 = ir.IntType(32)
    _V2F64 = ir.VectorType(ir.DoubleType(), 2)

    def _global_word_pointer(context, builder, aryty, ary, idxty, idx):
        """Pointer to ``ary[idx]`` in the global address space, typed as one word."""
        arr = context.make_array(aryty)(context, builder, value=ary)
        indices = cgutils.unpack_tuple(builder, idx, count=len(idxty))
        indices = [context.cast(builder, i, t, types.intp) for i, t in zip(indices, idxty)]
        ptr = cgutils.get_item_pointer(context, builder, aryty, arr, indices,
                                       wraparound=False)
        size = aryty.dtype.bitwidth // 8
        # 16 bytes: a 2 x f64 vector, the type NVPTX lowers to one v2 access.
        word = _V2F64 if size == 16 else ir.IntType(8 * size)
        ptr = builder.bitcast(ptr, word.as_pointer())
        return builder.addrspacecast(ptr, ir.PointerType(word, 1)), size

    def _check(ary, idx):
        if not isinstance(ary, types.Array) or ary.dtype not in (
                types.int8, types.int16, types.int32, types.int64, types.complex128):
            raise TypeError(f"word access needs an int or complex128 array, got {ary}")
        if not isinstance(idx, types.UniTuple) or idx.count != ary.ndim:
            raise TypeError(f"word access needs {ary.ndim} indices, got {idx}")

    @intrinsic
    def load_word(typingctx, ary, idx):
        """Load ``ary[idx]`` with one global access of the element's size."""
        _check(ary, idx)

        def codegen(context, builder, sig, args):
            aryty, idxty = sig.args
            ptr, size = _global_word_pointer(context, builder, aryty, args[0], idxty, args[1])
            word = builder.load(ptr, align=size)
            if size != 16:
                return word
            # complex128 value = {double, double}: rebuild it from the vector lanes.
            out = cgutils.get_null_value(context.get_value_type(aryty.dtype))
            for lane in range(2):
                out = builder.insert_value(
                    out, builder.extract_element(word, ir.Constant(_I32, lane)), lane)
            return out

        return ary.dtype(ary, idx), codegen

    @intrinsic
    def store_word(typingctx, ary, idx, value):
        """Store ``value`` to ``ary[idx]`` with one global access of the element's size."""
        _check(ary, idx)

        def codegen(context, builder, sig, args):
            aryty, idxty, valty = sig.args
            ptr, size = _global_word_pointer(context, builder, aryty, args[0], idxty, args[1])
            val = context.cast(builder, args[2], valty, aryty.dtype)
            if size == 16:
                vec = cgutils.get_null_value(_V2F64)
                for lane in range(2):
                    vec = builder.insert_element(
                        vec, builder.extract_value(val, lane), ir.Constant(_I32, lane))
                val = vec
            builder.store(val, ptr, align=size)
            return context.get_dummy_value()

        return types.void(ary, idx, ary.dtype), codegen
