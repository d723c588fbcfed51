"""framekv.ops.driver.check on CPU: driver, runtime and NVRTC statuses, one checker.

cuda-python's status enums exist without a driver, so every path of `check` runs
here; the NVRTC compile of the resident gate runs against a stand-in NVRTC module to
show that a failed compile raises `CudaDriverError` carrying the compiler's log.
"""
from __future__ import annotations

import ctypes
import re

import pytest

pytest.importorskip("cuda.bindings")

from cuda.bindings import driver as dr  # noqa: E402
from cuda.bindings import nvrtc, runtime  # noqa: E402

from framekv.ops.driver import CudaDriverError, check, error_name  # noqa: E402


def test_success_returns_nothing_one_value_or_all_values():
    ok = dr.CUresult.CUDA_SUCCESS
    assert check("cuInit", ok) is None
    assert check("cuInit", (ok,)) is None
    assert check("cuDeviceGet", (ok, 7)) == 7
    assert check("cuMemGetInfo", (ok, 10, 20)) == (10, 20)
    assert check("cudaGraphGetNodes", (runtime.cudaError_t.cudaSuccess, [], 0)) == ([], 0)
    assert check("nvrtcGetCUBINSize", (nvrtc.nvrtcResult.NVRTC_SUCCESS, 512)) == 512


@pytest.mark.parametrize("status,name", [
    (dr.CUresult.CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"),
    (runtime.cudaError_t.cudaErrorInvalidValue, "cudaErrorInvalidValue"),
    (nvrtc.nvrtcResult.NVRTC_ERROR_COMPILATION, "NVRTC_ERROR_COMPILATION"),
])
def test_a_failed_status_of_any_family_names_the_call_and_the_error(status, name):
    want = re.escape(f"someCall failed: {name} ({int(status)})")
    with pytest.raises(CudaDriverError, match=want):
        check("someCall", (status, 123))
    with pytest.raises(CudaDriverError, match=re.escape(name)):
        check("someCall", status)  # a bare status, as calls without values return
    assert error_name(status) == name
    assert issubclass(CudaDriverError, RuntimeError)


class FakeNvrtc:
    """NVRTC whose compile fails with a log: the calls the resident gate's build makes."""

    nvrtcResult = nvrtc.nvrtcResult
    LOG = b"framekv_resident.cu(3): error: expected a ';'"

    def __init__(self):
        self.destroyed = False

    def nvrtcCreateProgram(self, *args):
        return self.nvrtcResult.NVRTC_SUCCESS, "prog"

    def nvrtcCompileProgram(self, prog, n, opts):
        return (self.nvrtcResult.NVRTC_ERROR_COMPILATION,)

    def nvrtcGetProgramLogSize(self, prog):
        return self.nvrtcResult.NVRTC_SUCCESS, len(self.LOG)

    def nvrtcGetProgramLog(self, prog, buf):
        # The real call writes into the caller's buffer in place, as done here.
        ctypes.memmove(ctypes.c_char_p(buf), self.LOG, len(self.LOG))
        return (self.nvrtcResult.NVRTC_SUCCESS,)

    def nvrtcDestroyProgram(self, prog):
        self.destroyed = True
        return (self.nvrtcResult.NVRTC_SUCCESS,)


def test_a_failed_gate_compile_raises_with_the_compilers_log(monkeypatch):
    import cuda.bindings

    from framekv.graphs.resident import device

    fake = FakeNvrtc()
    monkeypatch.setattr(cuda.bindings, "nvrtc", fake)
    with pytest.raises(CudaDriverError) as info:
        device._compile("sm_90")
    message = str(info.value)
    assert "NVRTC could not compile the resident gate for sm_90" in message
    assert "nvrtcCompileProgram failed: NVRTC_ERROR_COMPILATION" in message
    assert "error: expected a ';'" in message  # the log is attached
    assert fake.destroyed  # the program is freed on failure too
