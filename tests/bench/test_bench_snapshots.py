"""The swap bench drives its scheduler like a client on the CPU: every session's
chunks are taken and acknowledged, so both runs make frames and the swapped run
swaps; it reports the steps' batch sizes, scratch rows and rotations."""
from __future__ import annotations

from framekv.bench.snapshots import format_snapshots, measure_swap


def test_swap_bench_makes_frames_and_swaps_on_cpu():
    res = measure_swap("tiny", sessions=3, slots=2, seconds=1.5, warmup=1.0, device="cpu",
                       quantum=2, progress=lambda _msg: None)
    resident, swapped = res["resident"], res["swapped"]
    assert resident["frames_per_second"] > 0 and swapped["frames_per_second"] > 0
    assert resident["chunks_per_session_min"] >= 1
    assert swapped.get("swap_ins", 0) >= 1, swapped
    assert resident.get("swap_ins", 0) == 0, resident
    assert res["swapped_vs_resident"] == swapped["frames_per_second"] / resident["frames_per_second"]
    for r in (resident, swapped):
        # every step ran both slots: a batch of 2, never a scratch row
        assert r["steps"] >= 1 and r["batch_sizes"] == {2: r["steps"]}, r
        assert r["rows"] == 2 * r["steps"] and r["scratch_rows_per_step"] == 0, r
    assert swapped["rotations"] >= 1 and resident["rotations"] == 0
    text = format_snapshots({"swap": res})
    assert "swapped / resident" in text and "scratch rows per step 0.00" in text
