"""The clock sampler on a real GPU: it samples the device torch uses while matmuls run."""
from __future__ import annotations

import time

import pytest
import torch

from framekv.bench import clocks

pytestmark = pytest.mark.gpu


def test_sampler_reads_clock_and_power_of_the_busy_device():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    device = clocks.device_id(torch.cuda.current_device())
    assert device.startswith("GPU-"), device  # a UUID: right under CUDA_VISIBLE_DEVICES
    with clocks.ClockSampler(device, period_ms=50) as sampler:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.5:
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()
    s = sampler.summary()
    assert s is not None and s["samples"] >= 5, s
    assert 0 < s["sm_mhz_mean"] <= s["sm_mhz_max"], s
    assert 0 < s["power_w_mean"] and 0 < s["power_limit_w"], s
    assert 0.0 <= s["power_capped_share"] <= 1.0, s
