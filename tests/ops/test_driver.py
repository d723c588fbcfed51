"""framekv.ops.driver.check on CPU: driver, runtime and NVRTC statuses, one checker.

cuda-python's status enums exist without a driver, so every path of `check` runs here.
"""
from __future__ import annotations

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

