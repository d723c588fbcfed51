"""A video session on the cluster's ingress logic (`ClusterSessions`) over two real
`Replica` s of ``framekv serve --model wan-diffusers --video-strength 0.5`` (tiny, the
CPU) in this process, behind the stand-in for Ray Serve's handle of
tests/cluster/test_cluster_sessions.py: its frames go to its replica (the socket's frames_in
messages and POST .../frames read `ClusterSessions.feed`), it moves between replicas
mid-stream with its encoder row and input, and its chunks equal, frame for frame, those
of the same frames on one replica with no move, their input frames numbered on; /v1/info names the video input.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("ray")
pytest.importorskip("fastapi")
pytest.importorskip("diffusers")

from framekv.tools.cli import build_parser  # noqa: E402
from framekv.tools.cluster.replica import Replica  # noqa: E402
from framekv.tools.serve.frames_in import video_in  # noqa: E402
from test_cluster_sessions import over_replicas, read  # noqa: E402
from video_harness import random_frames  # noqa: E402


def video_replica() -> Replica:
    return Replica(build_parser().parse_args([
        "serve", "--device", "cpu", "--model", "wan-diffusers", "--config", "tiny",
        "--video-strength", "0.5", "--max-sessions", "2", "--slots", "1",
        "--queue-chunks", "3"]))


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as mp, \
            over_replicas(mp, None, make=video_replica) as (cs, reps):
        yield cs, reps


def test_a_video_session_moves_between_replicas_and_goes_on_bit_equal(cluster):
    cs, reps = cluster
    first, later = cs.video_chunk_frames
    assert video_in(cs) == {"strength": 0.5, "width": 64, "height": 64, "first": first,
                            "later": later, "formats": ["jpeg", "webp", "png", "rgb24"],
                            "max_frames": 64}
    frames = random_frames(first + 2 * later, cs.video_size, 3)
    cuts = [(0, first), (first, first + later), (first + later, first + 2 * later)]
    moved, still = (cs.open_session(seed=31, chunks=3, video=0.5).id for _ in range(2))
    assert cs.where[moved] != cs.where[still]            # one on each replica
    got = {moved: [], still: []}
    readers = {sid: cs.rewind(sid) for sid in got}
    junk = 3                                              # dropped as chunk 0's frames come
    for sid in got:
        cs.feed(sid, random_frames(junk, cs.video_size, 4))
    for i, (lo, hi) in enumerate(cuts):
        for sid in got:
            cs.feed(sid, frames[lo:hi])
            read(cs, sid, 1, readers[sid], got[sid])
        if i == 1:                                        # mid-stream, its input cursor at 2
            src = cs.where[moved]
            report = cs.move(moved)
            assert report["from"] == src and cs.where[moved] != src
            assert cs.session_info(moved)["input_chunks"] == 2
    for sid in got:
        assert [c.index for c in got[sid]] == [0, 1, 2]
        assert [c.input for c in got[sid]] == [(junk + lo, hi - lo) for lo, hi in cuts]
    assert all(torch.equal(a.video, b.video) for a, b in zip(got[moved], got[still],
                                                            strict=True))
    info = cs.session_info(moved)
    assert (info["frames_in"], info["frames_dropped"]) == (junk + len(frames), junk)
    with pytest.raises(ValueError, match="strength must be 0.5"):
        cs.open_session(seed=1, video=0.75)


def test_the_ingress_takes_frames_by_post_and_socket_and_refuses_bad_ones(cluster):
    from fastapi.testclient import TestClient

    from framekv.tools.cluster.ingress import cluster_app
    from framekv.specs import wire
    from video_harness import frames_in, pictures

    cs, _ = cluster
    first, _ = cs.video_chunk_frames
    with TestClient(cluster_app(cs, {"model": "wan-diffusers:tiny"})) as http:
        assert http.get("/v1/info").json()["video_in"]["strength"] == 0.5
        sid = http.post("/v1/sessions", json={"seed": 8, "chunks": 1, "input": "video",
                                               "strength": 0.5}).json()["id"]
        r = http.post(f"/v1/sessions/{sid}/frames", content=frames_in(pictures(2, 24, 16, 1)))
        assert r.status_code == 200 and r.json()["frames_in"] == 2, r.text
        r = http.post(f"/v1/sessions/{sid}/frames", content=b"\x00\x00\x00\x09{")
        assert r.status_code == 400 and "runs past" in r.json()["error"]
        with http.websocket_connect(f"/v1/sessions/{sid}/stream") as ws:
            ws.send_bytes(frames_in(pictures(first - 2, 24, 16, 2), "webp"))
            header, _ = wire.decode(ws.receive_bytes())
            assert header["index"] == 0 and header["type"] == "frames"
        assert cs.session_info(sid)["frames_in"] == first
