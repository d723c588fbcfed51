"""`DecodeStage` (framekv.engine.decode_stage): a `DecodePlan` in, a `DecodeResult` out.
A batch decodes as the decoder decodes it by hand, first chunks and later ones apart,
scratch rows left out; row swaps move a stream's video from row to row (equal to the
same stream never moved), a stream whose runner swap failed keeps no copy and starts
over, a row swap that raises fails its stream alone with the reason; a decode that
raises is the result's error and leaves the lane empty.
"""
from __future__ import annotations

import pytest
import torch

from framekv.engine.decode_lane import to_uint8
from framekv.engine.decode_stage import DecodePlan, DecodeStage, RowSwap
from framekv.engine.wan import TinyStreamingDecoder

C, F, H, W = 4, 2, 6, 5


def tiny(sequences: int):
    return TinyStreamingDecoder.random(latent_channels=C, widths=(16, 8, 8, 8),
                                       sequences=sequences)


def latents(batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, C, F, H, W, generator=g)                 # [B, C, F, H, W]


def test_a_batch_decodes_each_stage_apart_as_the_decoder_does():
    stage, ref = DecodeStage(tiny(3)), tiny(3)
    first = latents(3, 0)                   # two streams and a scratch row
    res = stage.swap(DecodePlan(rows=[0, 1], first=[True, True]))
    stage.decode(DecodePlan(rows=[0, 1], first=[True, True]), first, res)
    want = to_uint8(ref.decode(first[:2], rows=[0, 1]))
    assert res.error is None and all(torch.equal(res.frames[i], want[i]) for i in (0, 1))
    plan = DecodePlan(rows=[1, 0, 2], first=[False, False, True])
    assert plan.stages() == [[2], [0, 1]]
    later, res = latents(4, 1), stage.swap(plan)
    stage.decode(plan, later, res)
    fresh = to_uint8(ref.decode(later[[2]], rows=[2]))[0]
    steady = to_uint8(ref.decode(later[[0, 1]], rows=[1, 0]))
    assert torch.equal(res.frames[2], fresh)
    assert torch.equal(res.frames[0], steady[0]) and torch.equal(res.frames[1], steady[1])
    assert res.frames[0].shape == (4 * F, 8 * H, 8 * W, 3) and len(stage.lane) == 0


def test_a_stream_swapped_to_another_row_goes_on_as_if_it_never_moved():
    stage, ref = DecodeStage(tiny(2)), tiny(2)
    z = [latents(1, i) for i in range(3)]
    alone = [to_uint8(ref.decode(x, rows=[0]))[0] for x in z]
    one = DecodePlan(rows=[0], first=[True])
    res = stage.swap(one)
    stage.decode(one, z[0], res)
    # out of row 0 while a new stream starts there; back into row 1 a step later
    res = stage.swap(DecodePlan([RowSwap("a", 0)], [RowSwap("b", 0)]))
    assert set(res.parked) == {"a"} and res.failed == {}
    assert stage.decoder.frames_decoded(0) == 0 and res.parked["a"]["frames"] == F
    back = DecodePlan(swap_ins=[RowSwap("a", 1, res.parked["a"])], rows=[1], first=[False])
    got = []
    for x in z[1:]:
        res = stage.swap(back)
        stage.decode(back, x, res)
        got.append(res.frames[0])
        back = DecodePlan(rows=[1], first=[False])
    assert all(torch.equal(a, b) for a, b in zip(got, alone[1:]))


def test_failed_swaps_are_data_each_streams_own(monkeypatch):
    stage = DecodeStage(tiny(3))
    one = DecodePlan(rows=[0, 1], first=[True, True])
    stage.decode(one, latents(2, 0), stage.swap(one))
    plan = DecodePlan([RowSwap("out-ok", 0), RowSwap("runner-failed", 1)],
                      [RowSwap("in-ok", 0), RowSwap("runner-failed-in", 1, {"frames": 9}),
                       RowSwap("bad-state", 2, {"frames": 3, "cache": [torch.zeros(1)],
                                                "latent_size": (H, W)})])
    res = stage.swap(plan, failed={"runner-failed", "runner-failed-in"})
    assert set(res.parked) == {"out-ok"}            # a failed runner swap: no copy out
    assert stage.decoder.frames_decoded(1) == 0     # ... and its row starts over
    assert list(res.failed) == ["bad-state"]
    assert res.failed["bad-state"].startswith("swapping the session in failed: its decoder "
                                              "row: ValueError(")

    def refuse(row):
        raise RuntimeError("no host memory")
    monkeypatch.setattr(stage.decoder, "snapshot", refuse)
    res = stage.swap(DecodePlan([RowSwap("s", 0)]))
    assert res.parked == {} and res.failed == {
        "s": "swapping the session out failed: its decoder row: RuntimeError('no host memory')"}


def test_a_decode_that_raises_is_the_results_error_and_empties_the_lane():
    stage = DecodeStage(tiny(2))
    both = DecodePlan(rows=[0, 1], first=[True, False])
    stage.decode(DecodePlan(rows=[1], first=[True]), latents(1, 0), stage.swap(DecodePlan()))
    bad = latents(2, 1)
    bad[1] = float("nan")                    # the later stage's chunk: the first one ran
    res = stage.swap(both)
    assert not stage.submit(both, bad, res)
    assert isinstance(res.error, ValueError) and "finite" in str(res.error)
    assert len(stage.lane) == 0 and res.frames == [None, None]
    # the decoder goes on: its failed streams' rows start over under new streams
    again = DecodePlan(swap_ins=[RowSwap("c", 0), RowSwap("d", 1)], rows=[0, 1],
                       first=[True, True])
    res = stage.swap(again)
    stage.decode(again, latents(2, 2), res)
    assert res.error is None and all(f is not None for f in res.frames)
