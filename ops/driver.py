"""The CUDA driver and runtime calls framekv makes through cuda-python.

`check` is the one place a cuda-python result is checked: every call returns its
status first (a driver ``CUresult``, a runtime ``cudaError_t`` or an NVRTC
``nvrtcResult``), then its values, and a failure raises `CudaDriverError` naming the
call and the error. Every success status is 0.

Everything here runs in the primary context of the device, the one torch's runtime
uses, so a pointer mapped here is valid for torch, numba and cuDNN alike. Imports of
cuda-python happen on first use: importing framekv must not touch CUDA.
"""
from __future__ import annotations

import functools

__all__ = ["CudaDriverError", "check", "driver", "error_name", "make_current", "mem_get_info",
           "primary_context", "version_string"]


class CudaDriverError(RuntimeError):
    """A CUDA driver, runtime or NVRTC call failed; the message names the call and the
    error."""


@functools.lru_cache(maxsize=None)
def driver():
    """The ``cuda.bindings.driver`` module (older cuda-python: ``cuda.cuda``)."""
    try:
        from cuda.bindings import driver as drv
    except ImportError:  # cuda-python < 12.6 spelled it differently
        from cuda import cuda as drv  # type: ignore[no-redef]
    return drv


def error_name(status) -> str:
    """The name of a cuda-python status ("CUDA_ERROR_INVALID_VALUE", "cudaErrorInvalidValue",
    "NVRTC_ERROR_COMPILATION"); read off the enum, so it needs no driver."""
    name = getattr(status, "name", None)
    return name if isinstance(name, str) else str(status)


def check(call: str, result):
    """The values of a cuda-python call's ``result``, raising on a failed status.

    ``result`` is ``(status, *values)`` or a bare status, as cuda-python returns them
    for driver, runtime and NVRTC calls alike. Returns None (no values), the value, or
    a tuple of the values.

    Raises:
        CudaDriverError: the status is not success; names ``call`` and the error.
    """
    if isinstance(result, tuple):
        status, values = result[0], result[1:]
    else:
        status, values = result, ()
    if status:  # success is 0 in all three enums
        raise CudaDriverError(f"{call} failed: {error_name(status)} ({int(status)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


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
