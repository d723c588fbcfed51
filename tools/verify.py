"""`framekv verify`: the replay-correctness harness on the command line.

Runs a preset's rollout eagerly, through graph replay, and against the fp32
exact-window reference (`framekv.engine.rollout.verify_rollout`), prints a per-layer,
per-step table of max errors and exits non-zero when one is beyond the tolerance. Over
an fp8 pool (``--kv-dtype fp8``) it also prints the pool's saturation counts, and a
warning when a value was clamped.
"""
from __future__ import annotations

import sys

from framekv.engine.verify import VerifyReport, verify_rollout


def run_verify(preset="tiny", *, chunks: int | None = None, device=None, backend=None,
               tolerance: float | None = None, glue: str = "fused", stream=None,
               kv_dtype=None, kv_scales=None) -> VerifyReport:
    """Run the harness and print its table to ``stream`` (default stdout); ``kv_dtype``
    and ``kv_scales`` as for `verify_rollout`."""
    report = verify_rollout(preset, chunks=chunks, device=device, backend=backend,
                            tolerance=tolerance, glue=glue, kv_dtype=kv_dtype,
                            kv_scales=kv_scales)
    print(report.format(), file=stream or sys.stdout)
    return report
