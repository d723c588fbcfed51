"""Video streams in `StreamScheduler` on the CPU (tiny Wan, its tiny encoder): a video
stream's chunks are those its frames make by hand (encoder, v2v sampler, rollout), bit
for bit, through encoder row swaps; it never runs ahead of its input; strength 1 is the
text stream of the same seed bit for bit; fast input keeps the newest chunk and counts
the drops; a checkpointed stream restores with its input cursor, its waiting frames, its
encoder row and its chunks' input frame numbers and goes on bit-equal; every refusal
names what is expected.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

from framekv.engine.serving import Checkpoints  # noqa: E402
from video_harness import by_hand, random_frames, video_scheduler  # noqa: E402


def made(sched, s) -> list[torch.Tensor]:
    return [c.latents for c in s.delivery.queue]


def step_until(sched, streams, n: int, limit: int = 20) -> None:
    for _ in range(limit):
        if all(len(s.delivery.queue) >= n for s in streams):
            return
        sched.step()
    raise AssertionError([len(s.delivery.queue) for s in streams])


def test_video_streams_make_the_chunks_their_frames_make_by_hand_through_row_swaps():
    sched = video_scheduler(0.5, max_sessions=2, slots=1, swap_quantum=1, queue_chunks=3)
    try:
        first, later = sched.video_chunk_frames
        a, b = (sched.open_session(seed=seed, video=0.5) for seed in (3, 4))
        frames = {s.id: random_frames(first + 2 * later, sched.video_size, k)
                  for k, s in enumerate((a, b))}
        sched.feed(a.id, frames[a.id][:first - 1])
        assert sched.step() == 0 and sched.session_info(a.id)["frames_needed"] == first
        cuts = (0, first, first + later, first + 2 * later)
        for i in range(3):
            for s in (a, b):               # the missing frame of a's chunk 0 too
                start = cuts[i] + (first - 1 if (s is a and i == 0) else 0)
                sched.feed(s.id, frames[s.id][start:cuts[i + 1]])
            step_until(sched, (a, b), i + 1)
            assert sched.step() == 0       # no input for the next chunk: none made
        assert sched.metrics()["swap_outs"] >= 2       # the two took turns on one slot
        for s in (a, b):
            want = by_hand(0.5, s.seed, [frames[s.id][cuts[i]:cuts[i + 1]] for i in range(3)],
                           sched.chunk_shape)
            assert all(torch.equal(g, w) for g, w in zip(made(sched, s), want, strict=True))
            assert sched.session_info(s.id)["frames_dropped"] == 0
    finally:
        sched.close()


def test_at_strength_one_a_video_stream_is_the_text_stream_of_its_seed_bit_for_bit():
    sched = video_scheduler(1.0, max_sessions=2, queue_chunks=2)
    try:
        first, later = sched.video_chunk_frames
        text, video = sched.open_session(seed=9), sched.open_session(seed=9, video=1.0)
        sched.feed(video.id, random_frames(first, sched.video_size, 1))
        step_until(sched, (text, video), 1)
        sched.feed(video.id, random_frames(later, sched.video_size, 2))
        step_until(sched, (text, video), 2)
        assert all(torch.equal(t, v) for t, v in zip(made(sched, text), made(sched, video),
                                                      strict=True))
        assert sched.session_info(text.id)["input"] == "text"
    finally:
        sched.close()


def test_fast_input_keeps_the_newest_whole_chunk_and_counts_what_it_drops():
    sched = video_scheduler(0.5, max_sessions=1, queue_chunks=2)
    try:
        first, later = sched.video_chunk_frames
        s = sched.open_session(seed=5, video=0.5)
        burst = random_frames(first + 3 * later, sched.video_size, 7)
        for piece in burst.split(later):              # three chunks' worth and more at once
            info = sched.feed(s.id, piece)
            assert info["frames_waiting"] <= first
        assert info["frames_waiting"] == first and info["frames_dropped"] == 3 * later
        step_until(sched, (s,), 1)
        more = random_frames(2 * later + 3, sched.video_size, 8)
        info = sched.feed(s.id, more)
        assert (info["frames_waiting"], info["frames_dropped"]) == (later, 4 * later + 3)
        step_until(sched, (s,), 2)
        want = by_hand(0.5, 5, [burst[-first:], more[-later:]], sched.chunk_shape)
        assert all(torch.equal(g, w) for g, w in zip(made(sched, s), want, strict=True))
        assert [c.input for c in s.delivery.queue] == [          # the frames kept, numbered
            (len(burst) - first, first), (len(burst) + len(more) - later, later)]
        m = sched.metrics()
        assert (m["frames_in"], m["frames_dropped"]) == (len(burst) + len(more), 4 * later + 3)
    finally:
        sched.close()


def test_a_checkpointed_video_stream_restores_and_goes_on_bit_equal(tmp_path):
    """Its chunks' input frame numbers (dropped frames counted) go with it too: those
    queued as recorded, the next one's from the restored counters."""
    kept = Checkpoints(tmp_path, every=1)
    sched = video_scheduler(0.5, max_sessions=1, queue_chunks=4, checkpoints=kept)
    first, later = sched.video_chunk_frames
    junk, frames = 3, random_frames(first + 2 * later, sched.video_size, 11)
    try:
        s = sched.open_session(seed=6, video=0.5)
        sched.feed(s.id, random_frames(junk, sched.video_size, 12))    # dropped below
        for lo, hi in ((0, first), (first, first + later)):
            sched.feed(s.id, frames[lo:hi])
            sched.step()
        kept.flush()
    finally:
        sched.close()                      # killed: its last checkpoint is what is left
    again = video_scheduler(0.5, max_sessions=2, queue_chunks=4)
    other = video_scheduler(0.5, max_sessions=1, queue_chunks=4)
    spans = [(junk, first), (junk + first, later), (junk + first + later, later)]
    try:
        assert again.restore_sessions(tmp_path) == [s.id]
        info = again.session_info(s.id)
        assert (info["input_chunks"], info["frames_in"], info["chunks"]) == (
            2, junk + first + later, 2)
        assert [c.input for c in again.sessions[s.id].delivery.queue] == spans[:2]
        again.feed(s.id, frames[first + later:first + later + 3])   # waiting as it moves
        other.import_session(again.export_session(s.id))
        assert other.session_info(s.id)["frames_waiting"] == 3
        other.feed(s.id, frames[first + later + 3:])
        moved = other.sessions[s.id]
        step_until(other, (moved,), 3)
        cuts = (0, first, first + later, first + 2 * later)
        want = by_hand(0.5, 6, [frames[cuts[i]:cuts[i + 1]] for i in range(3)], other.chunk_shape)
        assert all(torch.equal(g, w) for g, w in zip(made(other, moved), want, strict=True))
        assert [c.input for c in moved.delivery.queue] == spans
    finally:
        again.close()
        other.close()


def test_what_a_scheduler_refuses_names_what_it_takes():
    plain = video_scheduler(1.0, encode=False, max_sessions=2)
    sched = video_scheduler(0.5, max_sessions=2)
    bare = video_scheduler(0.5, encode=False, max_sessions=2)
    try:
        with pytest.raises(ValueError, match="needs a server with a video encoder"):
            plain.open_session(seed=1, video=1.0)
        for strength, match in ((1.5, r"strength must be a number in \(0, 1\]"),
                                (True, "strength must be a number"),
                                (0.75, "strength must be 0.5, the strength this server")):
            with pytest.raises(ValueError, match=match):
                sched.open_session(seed=1, video=strength)
        for refusing in (sched, bare):
            with pytest.raises(ValueError, match="input must be video here: .* strength 0.5"):
                refusing.open_session(seed=1)
        text = plain.open_session(seed=2)
        with pytest.raises(ValueError, match="takes no frames: it was opened with text"):
            plain.feed(text.id, random_frames(1, (64, 64), 0))
        s = sched.open_session(seed=1, video=0.5)
        H, W = sched.video_size
        with pytest.raises(ValueError, match=rf"frames must be a float \[n, 3, {H}, {W}\]"):
            sched.feed(s.id, random_frames(2, (H, W + 8), 0))
        with pytest.raises(KeyError):
            sched.feed("no-such-session", random_frames(1, (H, W), 0))
        state = sched.export_session(s.id)
        with pytest.raises(ValueError, match="takes video of size .* no video"):
            bare.import_session(state)
        assert sched.session_info(s.id) is None and not bare.sessions
    finally:
        for each in (plain, sched, bare):
            each.close()


@pytest.mark.gpu
def test_on_cuda_with_graphs_a_video_stream_through_row_swaps_equals_it_alone():
    """On CUDA with every graph captured (the runner's, the encoder's and the decoder's
    rows), a video stream taking turns on one slot with another (its encoder row
    swapped out and in between its chunks) makes the chunks it makes alone, bit for
    bit; at strength 1 a video stream equals the text stream of its seed."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    turns = video_scheduler(0.5, device="cuda", decode=True, max_sessions=2, slots=1,
                            swap_quantum=1, queue_chunks=4, host_latents=True)
    alone = video_scheduler(0.5, device="cuda", decode=True, max_sessions=1, slots=1,
                            queue_chunks=4, host_latents=True)
    full = video_scheduler(1.0, device="cuda", max_sessions=2, queue_chunks=4)
    try:
        first, later = turns.video_chunk_frames
        n = first + 2 * later
        x, y = (random_frames(n, turns.video_size, k) for k in (1, 2))
        a, other = turns.open_session(seed=3, video=0.5), turns.open_session(seed=4, video=0.5)
        solo = alone.open_session(seed=3, video=0.5)
        text, video = (full.open_session(seed=3, chunks=3, video=v) for v in (None, 1.0))
        for sched, s, frames in ((turns, a, x), (turns, other, y), (alone, solo, x),
                                 (full, video, y)):
            sched.feed(s.id, frames[:first])       # then a chunk's at a time below
        for i, (lo, hi) in enumerate(((first, first + later), (first + later, n))):
            step_until(turns, (a, other), i + 1)
            step_until(alone, (solo,), i + 1)
            step_until(full, (text, video), i + 1)
            for sched, s, frames in ((turns, a, x), (turns, other, y), (alone, solo, x),
                                     (full, video, y)):
                sched.feed(s.id, frames[lo:hi])
        step_until(turns, (a, other), 3)
        step_until(alone, (solo,), 3)
        step_until(full, (text, video), 3)
        assert turns.metrics()["swap_outs"] >= 2
        for got, want in zip(a.delivery.queue, solo.delivery.queue, strict=True):
            assert torch.equal(got.latents, want.latents) and torch.equal(got.video, want.video)
        assert all(torch.equal(t.latents.cpu(), v.latents.cpu()) for t, v in zip(
            text.delivery.queue, video.delivery.queue, strict=True))
    finally:
        for sched in (turns, alone, full):
            sched.close()
