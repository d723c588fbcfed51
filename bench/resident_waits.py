"""What waits for a resident loop: host calls made while the loop polls on the device.

    python -m framekv.bench.resident_waits

A `ResidentGraph`'s loop keeps one gate kernel polling on the device until its idle
limit. CUDA calls that wait for the whole device cannot return before that kernel
ends; this prints, for a one-kernel graph held resident, how long each call took
with the loop polling, and whether the loop had left (idle exit) when it returned.
Under CUDA's lazy module loading (torch's default) the first launch of a kernel
not loaded yet is one of them.
"""
from __future__ import annotations

import os
import time

import torch

from framekv.graphs import GraphCache, GraphKey


def _timed(cache, key, label: str, fn, idle: float) -> None:
    r = cache.resident(key, idle_timeout_s=idle)
    r.submit()
    r.wait()  # the loop is polling now
    t0 = time.perf_counter()
    fn()
    took = time.perf_counter() - t0
    state = r.state
    r.submit()
    r.wait()
    print(f"{label:<48} idle {idle:4.2f} s: call {1e3 * took:8.2f} ms, gate then {state}, "
          f"launches {r.launches}")
    r.close()


def main() -> None:
    print("CUDA_MODULE_LOADING", os.environ.get("CUDA_MODULE_LOADING"))
    cache = GraphCache("cuda")
    x = torch.zeros(1, device="cuda")
    key = GraphKey.build(owner=1, program="one", inputs={"x": x})
    cache.capture(key, lambda x: x.add_(1), {"x": x})
    ones = torch.ones(1000, device="cuda")
    torch.sqrt(ones)
    torch.cuda.synchronize()
    for label, fn, idle in (
            ("loaded op (sqrt)", lambda: torch.sqrt(ones), 1.0),
            ("first erfinv (kernel never loaded)", lambda: torch.erfinv(ones * 0.5), 1.0),
            ("first bessel_j0 (kernel never loaded)", lambda: torch.special.bessel_j0(ones), 0.2),
            ("first digamma (kernel never loaded)", lambda: torch.digamma(ones), 0.01),
            ("cudaMalloc 2 GiB (torch.empty)",
             lambda: torch.empty(1 << 31, dtype=torch.uint8, device="cuda"), 1.0),
            ("torch.cuda.synchronize()", torch.cuda.synchronize, 0.3),
            ("current_stream().synchronize()",
             lambda: torch.cuda.current_stream().synchronize(), 1.0),
            ("empty_cache (cudaFree)", torch.cuda.empty_cache, 0.3)):
        _timed(cache, key, label, fn, idle)


if __name__ == "__main__":
    main()
