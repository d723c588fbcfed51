"""The swap bench drives its scheduler like a client on the CPU: every session's
chunks are taken and acknowledged, so both runs make frames and the swapped run
swaps."""
from __future__ import annotations

from framekv.bench.snapshots import format_snapshots, measure_swap


def test_swap_bench_makes_frames_and_swaps_on_cpu():
    res = measure_swap("tiny", sessions=3, slots=2, seconds=1.5, warmup=1.0, device="cpu",
                       progress=lambda _msg: None)
    resident, swapped = res["resident"], res["swapped"]
    assert resident["frames_per_second"] > 0 and swapped["frames_per_second"] > 0
    assert resident["chunks_per_session_min"] >= 1
    assert swapped.get("swap_ins", 0) >= 1, swapped
    assert resident.get("swap_ins", 0) == 0, resident
    assert res["swapped_vs_resident"] == swapped["frames_per_second"] / resident["frames_per_second"]
    assert "swapped / resident" in format_snapshots({"swap": res})
