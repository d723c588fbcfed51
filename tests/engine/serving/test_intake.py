"""`Intake`'s frame numbers: each frame is numbered in the order it was received, dropped
ones counted, and a chunk's (first, count) (`Intake.span`, `Intake.take`) names exactly
the frames it takes, through drops, a copy and a `state` / `from_state` round trip (a
restart, a move) with frames waiting."""
from __future__ import annotations

import torch

from framekv.engine.serving.intake import Intake

SIZE, FIRST, LATER = (2, 3), 5, 8


def numbered(lo: int, hi: int) -> torch.Tensor:
    """Frames ``lo`` to ``hi - 1`` [n, 3, H, W], frame i flat at i / 100."""
    return torch.arange(lo, hi, dtype=torch.float32).div(100).view(-1, 1, 1, 1).expand(
        -1, 3, *SIZE).clone()


def take_checked(intake: Intake) -> tuple[int, int]:
    """Take a chunk; its span, checked against the frames it took and the counters."""
    before = intake.used + intake.dropped
    frames, _, span = intake.take()                                   # [3, n, H, W]
    first, count = span
    assert first == before and frames.shape[1] == count
    assert torch.equal(frames.permute(1, 0, 2, 3), numbered(first, first + count))
    return span


def test_a_chunks_numbers_are_the_frames_it_takes_across_drops():
    intake = Intake(SIZE, FIRST, LATER)
    assert intake.push(numbered(0, 7)) == 2                # 0, 1 dropped
    assert intake.span() == (2, FIRST)
    assert take_checked(intake) == (2, FIRST)
    intake.push(numbered(7, 10))
    assert intake.span() == (7, LATER) and not intake.ready()
    assert intake.push(numbered(10, 20)) == 5              # 7 to 11 dropped
    assert take_checked(intake) == (12, LATER)
    assert (intake.received, intake.dropped, intake.used) == (20, 7, 13)


def test_the_numbers_survive_a_copy_and_a_state_round_trip_with_frames_waiting():
    intake = Intake(SIZE, FIRST, LATER)
    intake.push(numbered(0, 9))                            # 0 to 3 dropped
    take_checked(intake)
    intake.push(numbered(9, 12))                           # three waiting as it leaves
    fields, waiting = intake.state()
    for again in (Intake.from_state(fields, waiting), intake.copy()):
        assert again.span() == (9, LATER)
        assert again.push(numbered(12, 20)) == 3           # 9, 10, 11 dropped
        assert take_checked(again) == (12, LATER)
        assert again.push(numbered(20, 28)) == 0
        assert take_checked(again) == (20, LATER)
    assert intake.span() == (9, LATER)                     # the original moved not

