"""The integer half of the kernels' e4m3 stores, compiled by LLVM for this CPU:
`e4m3_canon_ir` makes every NaN byte 0x7F and leaves every other byte as it is, over
all 2^16 pairs and random 4- and 8-byte words (the conversion itself is the GPU's
instruction: tests/ops/test_qk_norm_rope_fp8_gpu.py and tests/ops/test_quant_rows_gpu.py)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

CTYPES = {16: ctypes.c_uint16, 32: ctypes.c_uint32, 64: ctypes.c_uint64}


def compiled_canon(bits: int):
    """`e4m3_canon_ir` on a ``bits``-wide integer as a host function."""
    import llvmlite.binding as llvm
    from llvmlite import ir

    from framekv.ops._float import e4m3_canon_ir

    mod = ir.Module(name=f"canon{bits}")
    t = ir.IntType(bits)
    fn = ir.Function(mod, ir.FunctionType(t, [t]), name="canon")
    builder = ir.IRBuilder(fn.append_basic_block())
    builder.ret(e4m3_canon_ir(builder, fn.args[0]))
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    parsed = llvm.parse_assembly(str(mod))
    parsed.verify()
    engine = llvm.create_mcjit_compiler(parsed,
                                        llvm.Target.from_default_triple().create_target_machine())
    engine.finalize_object()
    c = CTYPES[bits]
    return engine, ctypes.CFUNCTYPE(c, c)(engine.get_function_address("canon"))


def per_byte(word: int, nbytes: int) -> int:
    """Each byte whose low seven bits are all set (an e4m3 NaN, either sign) as 0x7F."""
    out = 0
    for k in range(nbytes):
        b = (word >> (8 * k)) & 0xFF
        out |= (0x7F if b & 0x7F == 0x7F else b) << (8 * k)
    return out


def test_every_pair_of_bytes():
    _engine, canon = compiled_canon(16)              # the engine holds the code
    for w in range(1 << 16):
        assert canon(w) == per_byte(w, 2), hex(w)


@pytest.mark.parametrize("bits", [32, 64])
def test_random_words_with_nan_bytes_among_them(bits):
    _engine, canon = compiled_canon(bits)
    rng = np.random.default_rng(bits)
    nbytes = bits // 8
    for _ in range(4000):
        raw = rng.integers(0, 256, size=nbytes)
        raw[rng.random(nbytes) < 0.3] = rng.choice([0x7F, 0xFF, 0x7E, 0xFE, 0x80, 0x00])
        w = int.from_bytes(bytes(int(b) for b in raw), "little")
        assert canon(w) == per_byte(w, nbytes), hex(w)
