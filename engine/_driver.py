"""The few CUDA driver calls framekv makes through cuda-python.

Everything here runs in the primary context of the device, the one torch's
runtime uses, so a pointer mapped here is valid for torch, numba and cuDNN alike.
Imports of cuda-python happen on first use: importing framekv must not touch CUDA.
"""
from __future__ import annotations

import functools


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the error."""


@functools.lru_cache(maxsize=None)
def driver():
    """The ``cuda.bindings.driver`` module (older cuda-python: ``cuda.cuda``)."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:  # cuda-python < 12.6 spelled it differently
        from cuda import cuda as drv  # type: ignore[no-redef]
    return drv


def check(call: str, result):
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising on failure."""
    drv = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, name = drv.cuGetErrorName(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        raise CudaDriverError(f"{call} failed: {name} ({int(err)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


@functools.lru_cache(maxsize=None)
def primary_context(device_index: int):
    """Retain (once per process) and make current the primary context of a device.

    torch's runtime uses this same context, so tensors, numba arrays and our
    mappings share one address space. Retained for the life of the process, as
    torch does.
    """
    import torch

    torch.cuda.init()  # torch first, so both agree on which context is primary
    drv = driver()
    check("cuInit", drv.cuInit(0))
    dev = check("cuDeviceGet", drv.cuDeviceGet(device_index))
    ctx = check("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain(dev))
    return dev, ctx


def make_current(device_index: int):
    """Make the device's primary context current on this thread; return the CUdevice."""
    dev, ctx = primary_context(device_index)
    check("cuCtxSetCurrent", driver().cuCtxSetCurrent(ctx))
    return dev


def mem_get_info(device_index: int) -> tuple[int, int]:
    """(free, total) bytes of the device, as the driver counts them."""
    make_current(device_index)
    free, total = check("cuMemGetInfo", driver().cuMemGetInfo())
    return int(free), int(total)


def version_string() -> str:
    """The driver's CUDA version as 'major.minor', or 'unavailable'."""
    try:
        drv = driver()
        check("cuInit", drv.cuInit(0))
        v = check("cuDriverGetVersion", drv.cuDriverGetVersion())
        return f"{v // 1000}.{(v % 1000) // 10}"
    except Exception:  # no driver on this machine
        return "unavailable"
