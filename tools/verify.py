"""`framekv verify`: the replay-correctness harness on the command line.

Runs a preset's rollout eagerly, through graph replay, and against the fp32
exact-window reference (`framekv.engine.rollout.verify_rollout`), prints a per-layer,
per-step table of max errors and exits non-zero when one is beyond the tolerance.
"""
from __future__ import annotations

import sys

from framekv.engine.verify import VerifyReport, verify_rollout


def run_verify(preset="tiny", *, chunks: int | None = None, device=None, backend=None,
               tolerance: float | None = None, glue: str = "fused", stream=None) -> VerifyReport:
    """Run the harness and print its table to ``stream`` (default stdout)."""
    report = verify_rollout(preset, chunks=chunks, device=device, backend=backend,
                            tolerance=tolerance, glue=glue)
    print(report.format(), file=stream or sys.stdout)
    return report
