"""Video sessions over a real `framekv serve` on the CPU (tiny Wan, its tiny encoder and
decoder, sampling video to video at strength 0.5): a WebSocket client sending JPEG
frames gets the chunks the engine makes of those frames by hand, image for image; the
long poll's POST .../frames (PNG and rgb24) too; input faster than chunks stays bounded,
its drops in the session's info and /metrics, each chunk's header naming the input frames
the encoder took for it; each bad frames message is refused with a
message (socket) or its status (POST) and the session goes on; a session that takes no
frames, a bad strength, a foreign page and no token are refused; a video session kept
over a restart in --state-dir goes on bit-equal.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("diffusers")
pytest.importorskip("httpx")
ws_client = pytest.importorskip("websockets.sync.client")
pytest.importorskip("PIL.Image")

from framekv.engine.serving import to_uint8  # noqa: E402
from framekv.specs import wire  # noqa: E402
from framekv.tools.serve.frames_in import decode_frames  # noqa: E402
from framekv.tools.serve.wire import encode_image  # noqa: E402
from serve_harness import create, served_http  # noqa: E402
from video_harness import by_hand, frames_in, pictures, tiny_parts, video_scheduler  # noqa: E402

TOKEN = "video-in-token"
VIDEO = {"input": "video", "strength": 0.5}


@pytest.fixture(scope="module")
def server():
    sched = video_scheduler(0.5, decode=True, max_sessions=4, slots=2, queue_chunks=2)
    with served_http(sched, TOKEN) as (http, port, _):
        yield http, f"ws://127.0.0.1:{port}", sched


def connect(ws_base: str, sid: str):
    return ws_client.connect(f"{ws_base}/v1/sessions/{sid}/stream?token={TOKEN}",
                             open_timeout=10, max_size=None)


def chunks_of(ws, limit: float = 60.0) -> tuple[list, list]:
    """(frames chunks [(header, images)], error messages) until the end message."""
    chunks, errors = [], []
    while True:
        msg = ws.recv(timeout=limit)
        if isinstance(msg, str):
            body = json.loads(msg)
            if body["type"] == "end":
                return chunks, errors
            errors.append(body)
            continue
        header, payload = wire.decode(msg)
        chunks.append((header, wire.split_images(header, payload)))
        ws.send(json.dumps({"type": "ack", "index": header["index"]}))


def expected_images(sched, seed: int, messages: list[list[bytes]]) -> list[list[bytes]]:
    """The JPEGs of each chunk the engine makes by hand of chunk i's frames messages
    (decoded as the server decodes them), decoded by a fresh decoder."""
    chunks = [torch.cat([decode_frames(m, sched.video_size) for m in msgs]) for msgs in messages]
    latents = by_hand(0.5, seed, chunks, sched.chunk_shape)
    dec = tiny_parts().decoder(1)
    try:
        return [[encode_image(f, "jpeg", 85) for f in to_uint8(dec.decode(x[None]))[0]]
                for x in latents]
    finally:
        dec.close()


def metric(http, name: str) -> float:
    text = http.get("/metrics").text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def test_socket_jpeg_frames_make_the_chunks_the_engine_makes_of_them(server):
    http, ws_base, sched = server
    first, later = sched.video_chunk_frames
    sid = create(http, seed=21, chunks=2, **VIDEO)
    messages = [[frames_in(pictures(first, 80, 48, 1))],
                [frames_in(pictures(3, 80, 48, 2)), frames_in(pictures(later - 3, 80, 48, 3))]]
    with connect(ws_base, sid) as ws:
        for msg in sum(messages, []):
            ws.send(msg)
        chunks, errors = chunks_of(ws)
    assert not errors and [h["index"] for h, _ in chunks] == [0, 1]
    assert [images for _, images in chunks] == expected_images(sched, 21, messages)
    info = http.get(f"/v1/sessions/{sid}").json()
    assert (info["input"], info["frames_in"], info["frames_dropped"]) == (
        "video", first + later, 0)
    assert metric(http, "framekv_input_latency_seconds_count") >= 2


def test_the_long_poll_takes_frames_by_post_png_and_rgb24(server):
    http, _, sched = server
    first, _ = sched.video_chunk_frames
    sid = create(http, seed=22, chunks=1, **VIDEO)
    images = pictures(first, 40, 40, 4)
    one = frames_in(images[:1], "png")
    head, payload = wire.decode(one)
    del head["sizes"]                                 # one image: its length is the payload's
    messages = [wire.encode(head, payload), frames_in(images[1:2], "png"),
                frames_in(images[2:], "rgb24")]
    answers = [http.post(f"/v1/sessions/{sid}/frames", content=m) for m in messages]
    assert [a.status_code for a in answers] == [200] * 3, answers[-1].text
    assert answers[-1].json()["frames_in"] == first
    r = http.get(f"/v1/sessions/{sid}/chunks", params={"after": -1, "wait": 60})
    assert r.status_code == 200 and r.headers["content-type"] == "application/octet-stream"
    header, payload = wire.decode(r.content)
    assert wire.split_images(header, payload) == expected_images(sched, 22, [messages])[0]


def test_fast_input_stays_bounded_and_its_drops_show_in_info_and_metrics(server):
    http, _, sched = server
    first, later = sched.video_chunk_frames
    sid = create(http, seed=23, paused=True, **VIDEO)
    before = metric(http, "framekv_input_frames_dropped_total")
    sent = 0
    for k in range(3):                            # chunks of frames faster than any step
        r = http.post(f"/v1/sessions/{sid}/frames", content=frames_in(pictures(later, 32, 32, k)))
        sent += later
        assert r.status_code == 200 and r.json()["frames_waiting"] == first
    info = http.get(f"/v1/sessions/{sid}").json()
    assert (info["frames_in"], info["frames_waiting"], info["frames_dropped"]) == (
        sent, first, sent - first)
    assert metric(http, "framekv_input_frames_dropped_total") == before + sent - first
    assert metric(http, "framekv_input_frames_total") >= sent
    assert http.delete(f"/v1/sessions/{sid}").status_code == 204


def numbered(lo: int, hi: int, size) -> bytes:
    """An rgb24 frames_in message of frames ``lo`` to ``hi - 1`` of ``size`` (H, W),
    frame i one flat colour naming i (`numbers_of` reads it back)."""
    return frames_in([np.full((*size, 3), (i % 256, i // 256, 7), np.uint8)
                      for i in range(lo, hi)], "rgb24")


def numbers_of(frames: torch.Tensor) -> list[int]:
    """The numbers of a chunk's input frames [3, n, H, W] in [-1, 1] (`numbered`)."""
    rgb = ((frames[:, :, 0, 0] + 1) * 127.5).round().long()          # [3, n]
    assert bool((frames == frames[:, :, :1, :1]).all()), "a frame is not flat"
    return (rgb[0] + 256 * rgb[1]).tolist()


def test_each_chunk_header_names_the_input_frames_it_was_made_of_through_drops(
        server, monkeypatch):
    """Frames come faster than chunks are made (bursts of more than a chunk, part of
    them dropped): each chunk's header ``input`` is exactly the frames the encoder took
    for it, and the frames between the ranges are the drops the session counts."""
    http, ws_base, sched = server
    first, later = sched.video_chunk_frames
    sid = create(http, seed=27, chunks=3, **VIDEO)
    encoded, real = [], sched.encode_stage.run

    def run(plan, shape):                           # what each chunk's encode takes
        encoded.extend(numbers_of(f) for s, f in zip(plan.streams, plan.frames) if s == sid)
        return real(plan, shape)
    monkeypatch.setattr(sched.encode_stage, "run", run)
    # each chunk's burst in messages that only together hold its frames: the drops
    # come as the last one lands, before the chunk can be taken
    bursts = [(3, first - 1), (4, later - 1), (2 * later + 1,)]     # 2, 3, later + 1 drop
    headers, sent = [], 0
    with connect(ws_base, sid) as ws:
        for burst in bursts:
            for n in burst:
                ws.send(numbered(sent, sent + n, sched.video_size))
                sent += n
            header, _ = wire.decode(ws.recv(timeout=60))
            ws.send(json.dumps({"type": "ack", "index": header["index"]}))
            headers.append(header)
    spans = [(h["input"]["first"], h["input"]["count"]) for h in headers]
    assert [list(range(a, a + n)) for a, n in spans] == encoded
    ends = [0] + [a + n for a, n in spans]
    drops = sum(a - end for (a, _), end in zip(spans, ends))
    assert [n for _, n in spans] == [first, later, later] and ends[-1] == sent
    info = http.get(f"/v1/sessions/{sid}").json()
    assert (info["frames_in"], info["frames_dropped"]) == (sent, drops)
    assert drops == 6 + later and all(a > end for (a, _), end in zip(spans, ends))


def bad_messages(good: bytes) -> list[tuple[bytes, int, str]]:
    """(message, POST status, words of its error) of each kind of bad frames message."""
    head, payload = wire.decode(good)
    png = frames_in(pictures(1, 80, 48, 5), "png")
    _, png_payload = wire.decode(png)

    def with_(**kw):
        return wire.encode({**head, **kw}, payload)
    return [
        (good[:-10], 400, "truncated"),
        (b"\x00\x00\x10\x00{", 400, "runs past"),
        (wire.HEADER.pack(5) + b"{nope" + payload, 400, "not JSON"),
        (with_(type="ack"), 400, "must be frames_in"),
        (with_(width=81), 422, "must be 81x48"),
        (with_(format="gif"), 422, "format must be one of"),
        (wire.encode({**head, "sizes": [len(png_payload)]}, png_payload), 422, "must be jpeg, got PNG"),
        (with_(count=2, sizes=[3, len(payload) - 3]), 400, "does not decode"),
        (with_(count=2), 400, "sizes must be 2"),
        (with_(count=65), 413, "count must be an integer in [1, 64]"),
        (with_(id=2.5), 422, "id must be an integer or a string of at most 64"),
        (with_(id="x" * 65), 422, "id must be an integer or a string of at most 64"),
        (wire.encode({**head, "format": "rgb24"}, b"\x00" * 7), 400, "rgb24 payload must be"),
    ]


def test_bad_frames_messages_are_refused_with_a_message_and_the_session_goes_on(server):
    http, ws_base, sched = server
    first, _ = sched.video_chunk_frames
    sid = create(http, seed=24, chunks=1, **VIDEO)
    good = frames_in(pictures(1, 80, 48, 6))
    bad = bad_messages(good)
    for msg, status, words in bad:
        r = http.post(f"/v1/sessions/{sid}/frames", content=msg)
        assert (r.status_code, words) == (status, words) and words in r.json()["error"], r.text
    with connect(ws_base, sid) as ws:
        for msg, _, _ in bad:
            ws.send(msg)
        ws.send(frames_in(pictures(first, 80, 48, 7)))
        chunks, errors = chunks_of(ws)
    assert [words in e["error"] for e, (_, _, words) in zip(errors, bad, strict=True)] == \
        [True] * len(bad)
    assert [h["index"] for h, _ in chunks] == [0]
    assert http.post("/v1/sessions/nope/frames", content=good).status_code == 404


def test_a_refusal_on_the_socket_names_the_id_its_message_gave(server):
    """Messages numbered by their sender: a refused one's answer carries its id (an
    integer or a string), one without a valid id or header none; accepted ones get no
    answer and their frames make the chunk."""
    http, ws_base, sched = server
    first, _ = sched.video_chunk_frames
    sid = create(http, seed=26, chunks=1, **VIDEO)
    good = frames_in(pictures(first, 80, 48, 9), id=0)
    wrong_size = frames_in(pictures(1, 80, 48, 10), width=81, id=1)
    named = frames_in(pictures(1, 80, 48, 11), format="gif", id="cam-7")
    bad_id = frames_in(pictures(1, 80, 48, 12), id=[3])
    with connect(ws_base, sid) as ws:
        for msg in (wrong_size, named, bad_id, b"\x00\x00\x10\x00{", good):
            ws.send(msg)
        chunks, errors = chunks_of(ws)
    assert [(e["about"], e["status"], e.get("id")) for e in errors] == [
        ("frames_in", 422, 1), ("frames_in", 422, "cam-7"), ("frames_in", 422, None),
        ("frames_in", 400, None)]
    assert "id must be an integer" in errors[2]["error"]
    assert [(h["index"], h["input"]) for h, _ in chunks] == [(0, {"first": 0, "count": first})]


def test_what_a_video_server_refuses(server):
    http, ws_base, _ = server
    info = http.get("/v1/info").json()["video_in"]
    assert (info["strength"], info["first"], info["later"]) == (0.5, 5, 8)
    for body, words in (({"strength": 1.5, "input": "video"}, "strength must be a number"),
                        ({"strength": 0.75, "input": "video"}, "strength must be 0.5"),
                        ({"input": "video"}, "strength must be given with input video"),
                        ({"strength": 0.5}, "strength is for input video"),
                        ({}, "input must be video here")):
        r = http.post("/v1/sessions", json={"seed": 1, **body})
        assert r.status_code == 422 and words in r.json()["error"], (body, r.text)
    sid = create(http, seed=25, **VIDEO)
    good = frames_in(pictures(1, 16, 16, 8))
    r = http.post(f"/v1/sessions/{sid}/frames", content=good, headers={"Authorization": ""})
    assert r.status_code == 401
    r = http.post(f"/v1/sessions/{sid}/frames", content=good,
                  headers={"Origin": "http://elsewhere.example"})
    assert r.status_code == 403 and "not allowed" in r.json()["error"]
    http.delete(f"/v1/sessions/{sid}")


def test_a_server_without_video_input_refuses_frames():
    plain = video_scheduler(1.0, encode=False, max_sessions=1)
    with served_http(plain, TOKEN, output="latents") as (http, port, _):
        assert http.get("/v1/info").json()["video_in"] is None
        r = http.post("/v1/sessions", json={"seed": 1, **{**VIDEO, "strength": 1}})
        assert r.status_code == 422 and "needs a server with a video encoder" in r.json()["error"]
        sid = create(http, seed=1, chunks=1)
        r = http.post(f"/v1/sessions/{sid}/frames", content=frames_in(pictures(1, 8, 8, 0)))
        assert r.status_code == 409 and "takes no frames" in r.json()["error"]
        with connect(f"ws://127.0.0.1:{port}", sid) as ws:
            ws.send(frames_in(pictures(1, 8, 8, 0)))
            texts = []
            while not texts or texts[-1]["type"] != "end":
                msg = ws.recv(timeout=30)
                if isinstance(msg, str):
                    texts.append(json.loads(msg))
                else:
                    ws.send(json.dumps({"type": "ack", "index": wire.decode(msg)[0]["index"]}))
            assert "takes no frames" in texts[0]["error"] and texts[0]["type"] == "error"


def test_a_video_session_restarts_with_the_server_and_goes_on_bit_equal(tmp_path):
    """Written to --state-dir as the server stops (and checkpointed every chunk), the
    session opens again at the next start with its input cursor and encoder row: the
    frames of its next chunk make what one uninterrupted run makes of them. Its chunk
    not acknowledged comes again with the same header, and the next chunk's input
    frames are numbered on from the frames received before the stop."""
    kept = {"state_dir": tmp_path, "checkpoint_every": 1}
    sched = video_scheduler(0.5, decode=True, max_sessions=1, queue_chunks=2)
    first, later = sched.video_chunk_frames
    messages = [[frames_in(pictures(first, 48, 48, 9))], [frames_in(pictures(later, 48, 48, 10))]]

    def chunk(after: int) -> tuple[dict, bytes]:     # the long poll's next chunk
        r = http.get(f"/v1/sessions/{sid}/chunks", params={"after": after, "wait": 60})
        return wire.decode(r.content)
    with served_http(sched, TOKEN, **kept) as (http, _, _):
        sid = create(http, seed=26, chunks=2, **VIDEO)
        assert http.post(f"/v1/sessions/{sid}/frames", content=messages[0][0]).status_code == 200
        head, payload = chunk(-1)
        got = [wire.split_images(head, payload)]
    again = video_scheduler(0.5, decode=True, max_sessions=1, queue_chunks=2)
    with served_http(again, TOKEN, **kept) as (http, _, _):
        info = http.get(f"/v1/sessions/{sid}").json()
        assert (info["input_chunks"], info["frames_in"], info["chunks"]) == (1, first, 1)
        resent, _ = chunk(-1)
        assert resent["input"] == head["input"] == {"first": 0, "count": first}
        for msg in (frames_in(pictures(3, 48, 48, 11)), messages[1][0]):   # 3 dropped
            assert http.post(f"/v1/sessions/{sid}/frames", content=msg).status_code == 200
        head, payload = chunk(0)
        got.append(wire.split_images(head, payload))
    assert head["input"] == {"first": first + 3, "count": later}
    assert got == expected_images(again, 26, messages)
