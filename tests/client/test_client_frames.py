"""`framekv.client`'s video sessions (`framekv.client.frames`, ``send_frames``) against a
real `framekv serve` on 127.0.0.1 (CPU, tiny Wan, video to video at strength 0.5), over
a WebSocket and over the long poll: frames sent from the blocking and the asyncio
client make the chunks the engine makes of them by hand; each bad argument is a
ValueError naming it before any request; frames the server refuses are a
`ServerError` (the POST's status; on the socket, ``errors`` and the next send), and a
refusal read before a prompt change does not answer it.
"""
from __future__ import annotations

import asyncio
import io

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("diffusers")
pytest.importorskip("httpx")
pytest.importorskip("websockets.asyncio.client")
Image = pytest.importorskip("PIL.Image")

import framekv.client as fc  # noqa: E402
from framekv.client.frames import encode_frames  # noqa: E402
from serve_harness import serving  # noqa: E402
from test_serve_video_in import expected_images  # noqa: E402
from video_harness import pictures, video_scheduler  # noqa: E402

TOKEN = "frames-token"
TRANSPORTS = ["auto", "poll"]


@pytest.fixture(scope="module")
def server():
    sched = video_scheduler(0.5, decode=True, max_sessions=2, queue_chunks=2)
    with serving(sched, token=TOKEN) as (_, port):
        yield f"http://127.0.0.1:{port}", sched


def video(sched, seed: int) -> np.ndarray:
    """uint8 [first + later, 48, 80, 3]: the frames of a session's two chunks."""
    first, later = sched.video_chunk_frames
    return np.stack(pictures(first + later, 80, 48, seed))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_frames_from_the_blocking_client_make_the_engines_chunks(server, transport):
    url, sched = server
    first, later = sched.video_chunk_frames
    frames = video(sched, 1)
    fmt = "png" if transport == "auto" else "rgb24"
    with fc.Client(url, token=TOKEN, transport=transport) as client:
        s = client.create(seed=41, chunks=2, input="video")       # the server's strength
        answers = [s.send_frames(frames[:first])]                  # numpy, jpeg
        chunks = []
        for chunk in s.stream(timeout=120):
            chunks.append(chunk)
            if chunk.index == 0:      # a tensor, at most 3 frames a message
                client._video["max_frames"] = 3
                answers.append(s.send_frames(torch.from_numpy(frames[first:]), format=fmt))
    if transport == "poll":
        assert [a["frames_in"] for a in answers] == [first, first + later]
    else:
        assert answers == [None, None] and s.errors == []
    messages = [encode_frames(frames[:first]).messages(64),
                encode_frames(frames[first:], fmt).messages(3)]
    assert [len(m) for m in messages] == [1, -(-later // 3)]
    assert [c.images for c in chunks] == expected_images(sched, 41, messages)
    assert [c.input for c in chunks] == [(0, first), (first, later)]   # nothing dropped


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_asyncio_client_sends_pil_images_and_encoded_frames(server, transport):
    url, sched = server
    first, _ = sched.video_chunk_frames
    frames = video(sched, 2)
    pil = [Image.fromarray(f) for f in frames[:first]]
    encoded = encode_frames(frames[first:], "webp", 80).images        # bytes a frame

    async def main():
        async with fc.AsyncClient(url, token=TOKEN, transport=transport) as client:
            s = await client.create(seed=42, chunks=2, input="video", strength=0.5)
            answers = [await s.send_frames(pil, format="webp", quality=80)]
            chunks = []
            async for chunk in s.stream(timeout=120):
                chunks.append(chunk)
                if chunk.index == 0:
                    answers.append(await s.send_frames(encoded, format="webp"))
            return answers, chunks

    answers, chunks = asyncio.run(main())
    assert [c.index for c in chunks] == [0, 1]
    assert [c.video().shape[1:] for c in chunks] == [(sched.video_size[0],
                                                       sched.video_size[1], 3)] * 2
    if transport == "poll":
        assert answers[-1]["frames_in"] == len(frames)
    else:
        assert answers == [None, None]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_frames_the_server_refuses_are_a_server_error(server, transport):
    """A frame wider than the server takes: on the long poll the POST's 422; on the
    socket, the error message in ``errors``, not taken as a prompt change's answer, and
    raised by the next send, which sends nothing (sent again, it goes)."""
    url, sched = server
    first, _ = sched.video_chunk_frames
    frames = video(sched, 3)
    too_wide = np.zeros((1, 2, 4097, 3), np.uint8)
    with fc.Client(url, token=TOKEN, transport=transport) as client:
        s = client.create(seed=43, chunks=2, input="video")
        if transport == "poll":
            with pytest.raises(fc.ServerError, match="width") as e:
                s.send_frames(too_wide)
            assert e.value.status == 422
        else:
            assert s.send_frames(too_wide) is None
        s.send_frames(frames[:first])
        # the socket's refusal comes while the change waits: it is not the change's answer
        assert s.change_prompt(text="a blue whale")["type"] == "prompt_ack"
        stream = s.stream(timeout=120)
        assert next(stream).index == 0
        if transport != "poll":
            assert len(s.errors) == 1 and "width" in s.errors[0]["error"]
            assert s.errors[0]["about"] == "frames_in" and s.errors[0]["status"] == 422
            with pytest.raises(fc.ServerError, match="width") as e:
                s.send_frames(frames[first:])
            assert e.value.status == 422
        answer = s.send_frames(frames[first:])
        if transport == "poll":
            assert answer["frames_in"] == len(frames)
        else:
            assert answer is None
        assert [c.index for c in stream] == [1]


def jpeg() -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


FRAMES = np.zeros((2, 8, 8, 3), np.uint8)
#: (send_frames arguments, words of the ValueError)
BAD_FRAMES = [
    ({"frames": FRAMES.astype(np.float32)}, "frames must be uint8 (0-255), got dtype float32"),
    ({"frames": torch.zeros(2, 8, 8, 3)}, "got a tensor of dtype torch.float32"),
    ({"frames": FRAMES[..., 0]}, "frames must be [N, H, W, 3] (N, H, W >= 1; RGB), got shape [2, 8, 8]"),
    ({"frames": np.zeros((2, 8, 8, 4), np.uint8)}, "got shape [2, 8, 8, 4]"),
    ({"frames": FRAMES[:0]}, "got shape [0, 8, 8, 3]"),
    ({"frames": []}, "got an empty list"),
    ({"frames": "cat.mp4"}, "got str"),
    ({"frames": [jpeg(), "x"]}, "frames[1] is str"),
    ({"frames": [Image.new("RGB", (8, 8)), Image.new("RGB", (9, 8))]},
     "frames must all be 8x8 (width x height), frames[1] is 9x8"),
    ({"frames": FRAMES, "format": "gif"}, "format must be one of ['jpeg', 'webp', 'png', "
                                          "'rgb24'], got 'gif'"),
    ({"frames": FRAMES, "quality": 0}, "quality must be an integer in [1, 100], got 0"),
    ({"frames": [jpeg()], "format": "rgb24"}, "got 'rgb24'"),
    ({"frames": [jpeg()], "format": "png"}, "frames[0] must be a png image (format='png'), "
                                            "got JPEG"),
    ({"frames": [jpeg(), b"nope"]}, "frames[1] must be a jpeg image, got 4 bytes"),
]
#: (create arguments, words of the ValueError)
BAD_CREATE = [
    ({"input": "audio"}, "input must be one of ('text', 'video'), got 'audio'"),
    ({"input": "video", "strength": 1.5}, "strength must be a number in (0, 1], got 1.5"),
    ({"input": "video", "strength": 0}, "got 0"),
    ({"input": "video", "strength": True}, "got True"),
    ({"strength": 0.5}, "strength is for input='video', got strength=0.5 with input='text'"),
]


def test_each_bad_argument_is_a_value_error_before_any_request():
    """...and a video session asked of a server without video input, after its
    /v1/info only."""
    import httpx

    def answer(r):
        if r.url.path == "/v1/info":
            return httpx.Response(200, json={"video_in": None})
        requests.append(r)
        return httpx.Response(500)

    requests = []
    client = fc.Client("http://127.0.0.1:9")
    client.http = httpx.Client(base_url=client.url, transport=httpx.MockTransport(answer))
    s = client.session("some-id")
    for kw, words in BAD_FRAMES:
        with pytest.raises(ValueError) as e:
            s.send_frames(**kw)
        assert words in str(e.value), (kw, str(e.value))
    for kw, words in BAD_CREATE:
        with pytest.raises(ValueError) as e:
            client.create(seed=1, **kw)
        assert words in str(e.value), (kw, str(e.value))
        with pytest.raises(ValueError, match=words.split(",")[0].replace("(", r"\(")):
            asyncio.run(fc.AsyncClient("http://127.0.0.1:9").create(seed=1, **kw))
    with pytest.raises(ValueError, match=r"input='video' needs a server with video input"):
        client.create(seed=1, input="video")
    assert requests == []


def test_messages_carry_at_most_max_frames_and_the_byte_cap(monkeypatch):
    import framekv.client.frames as frames
    from framekv.specs import wire

    encoded = frames.FramesIn("jpeg", 8, 8, [bytes([j]) * (10 + j) for j in range(5)])
    heads = [wire.decode(m) for m in encoded.messages(max_frames=2)]
    assert [h["count"] for h, _ in heads] == [2, 2, 1]
    monkeypatch.setattr(frames, "MAX_MESSAGE_BYTES", 25)
    heads = [wire.decode(m) for m in encoded.messages(max_frames=3)]
    assert [h["sizes"] for h, _ in heads] == [[10, 11], [12, 13], [14]]   # bytes first
    assert b"".join(p for _, p in heads) == b"".join(encoded.images)
    monkeypatch.setattr(frames, "MAX_MESSAGE_BYTES", 13)
    with pytest.raises(ValueError, match=r"frames\[4\] must be at most 13 bytes as jpeg, got 14"):
        encoded.messages(max_frames=3)
