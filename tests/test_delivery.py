"""A stream's chunks on their way to its client (`Delivery`, `Handout`, `end_message`) and
its state (`Phase`), on their own and through a scheduler's `handout` (CPU, tiny):
chunks stay queued until acknowledged, an acknowledgement never runs ahead of the
chunks made, a rewind hands every unacknowledged chunk again to a new reader and the
old one takes nothing, a chunk made again at or below the acknowledged index is not
queued; `handout` answers a chunk, nothing while chunks wait for their acknowledgement,
the end once every one is (the stream closed, its end reason its state), the end of a
stream closed under its reader, and word that another reader took it.
"""
from __future__ import annotations

import pytest
import torch

from framekv.engine.serving import (Delivery, Handout, Phase, SessionChunk, Stream,
                                    StreamScheduler, end_message)
from test_scheduler import _clear


def chunk(index: int) -> SessionChunk:
    return SessionChunk(index, 0, torch.zeros(1), 0.0, 1)


def test_a_delivery_hands_out_keeps_until_acknowledged_and_rewinds():
    d = Delivery()
    assert [d.put(chunk(i)) for i in range(3)] == [True] * 3 and d.delivered == 0
    assert d.take().index == 0 and d.take().index == 1 and d.sent == 2 and d.unsent
    assert d.ack(0, made=3) == 1 and d.sent == 1 and d.acked == 0
    old = d.reader
    new = d.rewind(None, made=3)                    # a reconnect: 1 and 2 again
    assert new == old + 1 and d.take(old) is None and d.take(new).index == 1
    assert d.rewind(1, made=3) == new + 1 and d.take().index == 2 and d.delivered == 2
    assert d.ack(10**9, made=3) == 1 and d.acked == 2 and not d.queue
    assert not d.put(chunk(2)) and d.put(chunk(3))  # made again (a resumed stream): kept out
    with pytest.raises(ValueError, match="the last chunk made is 3, got 4"):
        d.rewind(4, made=4)
    with pytest.raises(ValueError, match="index must be an integer, got True"):
        d.ack(True, made=4)
    copy = d.copy()
    copy.clear()
    assert len(d.queue) == 1 and (copy.acked, copy.reader) == (d.acked, d.reader)


def test_a_streams_state_is_a_phase_and_its_info_a_plain_string():
    s = Stream("x", 1, None, state="done")
    assert s.state is Phase.DONE and s.finished and s.info()["state"] == "done"
    assert type(s.info()["state"]) is str and f"{Phase.FAILED}" == "failed"
    with pytest.raises(ValueError, match="'gone' is not a valid Phase"):
        Stream("y", 1, None, state="gone")


def test_the_end_message_says_why_unless_it_ended_by_itself():
    info = Stream("x", 1, 2, state="done").info()
    assert end_message(info) == {"type": "end", "state": "done", "error": None}
    assert end_message({**Stream("x", 1, None).info(), "ended": False}, "shutdown", True) == {
        "type": "end", "state": "closed", "error": None, "reason": "shutdown",
        "resumable": True}
    assert end_message(None) == {"type": "end", "state": "closed", "error": None}


@pytest.fixture(scope="module")
def sched():
    s = StreamScheduler("tiny", max_sessions=2, device="cpu", use_graphs=False,
                        queue_chunks=2)
    yield s
    s.close()


def test_handout_ends_a_stream_once_its_client_has_every_chunk(sched):
    _clear(sched)
    s = sched.open_session(seed=3, chunks=2)
    reader = sched.rewind(s.id)
    while not s.finished:
        sched.step()
    got = [sched.handout(s.id, 0, reader=reader) for _ in range(2)]
    assert [h.chunk.index for h in got] == [0, 1]
    assert sched.handout(s.id, 0.05, reader=reader) == Handout()   # handed, not acknowledged
    assert sched.next_chunk(s.id, 5.0, reader=reader) is None      # finished: none at once
    sched.ack(s.id, 1)
    end = sched.handout(s.id, 0, reader=reader)
    assert end == Handout(end={"type": "end", "state": "done", "error": None})
    assert s.id not in sched.sessions and sched.session_info(s.id)["end_reason"] == "done"
    assert sched.handout(s.id, 0) == Handout(end={"type": "end", "state": "done",
                                                  "error": None, "reason": "done"}, gone=True)


def test_handout_tells_a_replaced_reader_and_one_whose_stream_closed(sched):
    _clear(sched)
    s = sched.open_session(seed=4, paused=True)
    old = sched.rewind(s.id)
    new = sched.rewind(s.id)
    assert sched.handout(s.id, 0, reader=old) == Handout(superseded=True)
    assert sched.handout(s.id, 0, reader=new) == Handout()
    sched.close_session(s.id, "deleted")
    assert sched.handout(s.id, 0, reader=new).end == {
        "type": "end", "state": "closed", "error": None, "reason": "deleted"}
