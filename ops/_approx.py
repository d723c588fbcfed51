"""The hardware's approximate float32 functions, for kernels bound by the instructions
they issue.

``exp2_approx(x)`` is ``2^x`` by ``ex2.approx.ftz.f32`` and ``rcp_approx(x)`` is ``1 / x``
by ``rcp.approx.ftz.f32``: one special-function instruction each, where libdevice's
``tanhf`` or an IEEE division costs a dozen or more. Both are within a few fp32 ulps of
the exact result (relative error about 2^-22); subnormal inputs and results are
flushed to zero; ``2^-inf = 0``, ``2^inf = inf``, ``1 / inf = 0``, ``1 / 0 = inf``,
NaN stays NaN. A kernel that uses them states in its contract how far its results may
move from its torch reference.

Under numba's CUDA simulator they are the exact fp32 functions (numpy).
"""
from __future__ import annotations

import numpy as np

from ._launch import SIMULATOR

__all__ = ["exp2_approx", "rcp_approx"]

if SIMULATOR:

    def exp2_approx(x):
        """2^x in float32."""
        with np.errstate(over="ignore"):
            return np.float32(np.exp2(np.float32(x)))

    def rcp_approx(x):
        """1 / x in float32."""
        with np.errstate(divide="ignore"):
            return np.float32(np.float32(1) / np.float32(x))

else:
    from llvmlite import ir
    from numba import types

    from ._float import float_intrinsic

    _F32 = ir.FloatType()

    def _ptx(instruction: str):
        """LLVM IR emitter: one PTX instruction float32 -> float32."""
        asm = ir.InlineAsm(ir.FunctionType(_F32, [_F32]), f"{instruction} $0, $1;", "=f,f")
        return lambda builder, v: builder.call(asm, [v])

    exp2_approx = float_intrinsic("exp2_approx", types.float32, _ptx("ex2.approx.ftz.f32"),
                                  "float32 2^x by ``ex2.approx.ftz.f32`` (module doc).")
    rcp_approx = float_intrinsic("rcp_approx", types.float32, _ptx("rcp.approx.ftz.f32"),
                                 "float32 1 / x by ``rcp.approx.ftz.f32`` (module doc).")
