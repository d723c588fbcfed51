"""`framekv.client` (`framekv.client.sessions`) against a real `framekv serve` on 127.0.0.1
(CPU, the tiny reference model): the blocking and the asyncio client create, stream,
change prompts (text messages and tensor uploads), pause, resume and close sessions,
over a WebSocket and over the long poll alike; their chunks equal each seed run
alone; a socket the way refuses falls back to the long poll; refusals are
`ServerError` with the server's status and message; chunk messages of both outputs
decode; ``framekv.client`` is the same module's names; the client example runs.
"""
from __future__ import annotations

import asyncio
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("websockets.asyncio.client")

from framekv.engine.serving import SessionChunk, StreamScheduler  # noqa: E402
import framekv.client.sessions as fc  # noqa: E402
from framekv.tools.serve.wire import chunk_frame, frames_message  # noqa: E402
from serve_harness import no_sessions, serving  # noqa: E402
from test_scheduler import alone_chunks  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKEN = "client-token"


@pytest.fixture(scope="module")
def server():
    sched = StreamScheduler("tiny", max_sessions=3, device="cpu", use_graphs=False,
                            queue_chunks=1)
    with serving(sched, token=TOKEN) as (_, port):
        yield f"http://127.0.0.1:{port}", sched


def err(chunks, want) -> float:
    return max(float((c.latents - w).abs().max()) for c, w in zip(chunks, want))


TRANSPORTS = ["auto", "poll"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_blocking_client_streams_changes_prompts_and_closes(server, monkeypatch,
                                                                 transport):
    url, sched = server
    L, D = sched.prompt_shape
    monkeypatch.setenv("FRAMEKV_TOKEN", TOKEN)                # the default token
    with fc.Client(url, transport=transport) as client:
        assert client.info()["latents"]["shape"] == list(sched.chunk_shape)
        s = client.create(seed=31, chunks=12, prompt_seed=1)     # past the change
        chunks, acks = [], []
        for chunk in s.stream(timeout=30):
            chunks.append(chunk)
            if chunk.index == 1:
                acks.append(s.change_prompt(prompt_seed=2))
        assert [c.index for c in chunks] == list(range(12)) and s.end["state"] == "done"
        (ack,) = acks
        first = next(c.index for c in chunks if c.prompt_version == 1)
        assert ack == {"type": "prompt_ack", "prompt_version": 1, "applies_from": first}
        seeded = [torch.randn(L, D, generator=torch.Generator().manual_seed(k)) for k in (1, 2)]
        want = alone_chunks(sched, 31, 12, prompt=seeded[0], rewrite_at=first,
                            new_prompt=seeded[1])
        assert err(chunks, want) <= 1e-5
        assert s.info()["delivered"] == 12 and s.close() is False  # it had ended: 404
        live = client.create(seed=32)
        assert live.close() is True and live.info()["end_reason"] == "deleted"
    no_sessions(sched)


def test_a_prompt_change_after_the_last_chunk_is_refused_with_the_reason(server, monkeypatch):
    """Its last chunk made (not yet read), a session takes no new prompt: the change
    raises `ServerError` saying so, over the socket and as an upload, and the chunks
    still come, each under the old prompt."""
    url, sched = server
    monkeypatch.setenv("FRAMEKV_TOKEN", TOKEN)
    with fc.Client(url) as client:
        s = client.create(seed=33, chunks=1)
        deadline = time.monotonic() + 30
        while s.info()["state"] != "done":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for change in (lambda: s.change_prompt(prompt_seed=2),
                       lambda: s.change_prompt(prompt=torch.zeros(sched.prompt_shape))):
            with pytest.raises(fc.ServerError, match="has made all 1 of its chunks: a prompt "
                                                     "change would apply from chunk 1"):
                change()
        assert [c.prompt_version for c in s.stream(timeout=30)] == [0]
        assert s.end["state"] == "done"
    no_sessions(sched)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_tensor_prompt_applies_from_chunk_0_and_uploads_keep_their_dtype(server, transport):
    url, sched = server
    L, D = sched.prompt_shape
    emb = torch.randn(L, D, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    with fc.Client(url, token=TOKEN, transport=transport) as client:
        s = client.create(seed=33, chunks=3, prompt=emb[None])      # [1, L, D] too
        chunks = list(s.stream(timeout=30))
        assert [c.prompt_version for c in chunks] == [1, 1, 1]
        assert [c.input for c in chunks] == [None] * 3                  # text: no frames in
        assert err(chunks, alone_chunks(sched, 33, 3, prompt=emb.float())) <= 1e-5
        s2 = client.create(seed=34, paused=True)
        half = torch.randn(L, D).half()
        assert s2.change_prompt(prompt=half) == {"type": "prompt_ack", "prompt_version": 1,
                                                 "applies_from": 0}
        s2.close()


@pytest.mark.parametrize("transport, no_session", [("auto", 4404), ("poll", 404)])
def test_pause_resume_and_refusals(server, transport, no_session):
    url, sched = server
    with fc.Client(url, token=TOKEN, transport=transport) as client:
        s = client.create(seed=35)                                 # open-ended
        it = s.stream(timeout=30)
        next(it)
        s.pause()
        deadline = time.monotonic() + 10
        while not s.info()["paused"]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        made = s.info()["chunks"]
        time.sleep(0.3)
        after = s.info()["chunks"]        # a step under way as the pause came may finish
        assert after - made <= 1
        time.sleep(0.3)
        assert s.info()["chunks"] == after                         # paused: none made
        s.resume()
        assert next(it).index == 1
        with pytest.raises(fc.ServerError) as exc:
            s.change_prompt(text="a cat")                          # no text encoder here
        assert exc.value.status == 422 and "text encoder" in exc.value.message
        assert s.close() is True
        with pytest.raises(fc.ServerError) as exc:
            list(client.session("nope").stream(timeout=10))
        assert exc.value.status == no_session and "no such session open" in exc.value.message
        with pytest.raises(ValueError, match="give one of text, prompt_seed or prompt"):
            s.change_prompt(text="a", prompt_seed=1)
        with pytest.raises(ValueError, match="at most one of text, prompt_seed or prompt"):
            client.create(seed=1, text="a", prompt=torch.zeros(1))
    with fc.Client(url, token="wrong") as client:
        with pytest.raises(fc.ServerError) as exc:
            client.create(seed=1)
        assert (exc.value.status, exc.value.message) == (401, "wrong bearer token")
    no_sessions(sched)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_asyncio_client_does_the_same(server, transport):
    url, sched = server

    async def main():
        async with fc.AsyncClient(url, token=TOKEN, transport=transport) as client:
            assert (await client.info())["max_sessions"] == 3
            s = await client.create(seed=36, chunks=4)
            chunks, acks = [], []
            async for chunk in s.stream(timeout=30):
                chunks.append(chunk)
                if chunk.index == 0:
                    acks.append(await s.change_prompt(prompt_seed=5))
            emb = torch.randn(*sched.prompt_shape)
            s2 = await client.create(seed=37, chunks=2, prompt=emb)
            tensor_chunks = [c async for c in s2.stream(timeout=30)]
            refused = await client.session("nope").close()
            return chunks, acks, s.end, tensor_chunks, emb, refused, await s.close()
    chunks, acks, end, tensor_chunks, emb, refused, closed = asyncio.run(main())
    assert [c.index for c in chunks] == [0, 1, 2, 3] and end["state"] == "done"
    first = next((c.index for c in chunks if c.prompt_version == 1), 4)
    assert acks == [{"type": "prompt_ack", "prompt_version": 1, "applies_from": first}]
    P, D = sched.prompt_shape
    seeded = torch.randn(P, D, generator=torch.Generator().manual_seed(5))
    want = alone_chunks(sched, 36, 4, rewrite_at=first, new_prompt=seeded)
    assert err(chunks, want) <= 1e-5 and refused is False and closed is False
    assert err(tensor_chunks, alone_chunks(sched, 37, 2, prompt=emb)) <= 1e-5
    no_sessions(sched)


def test_a_refused_socket_falls_back_to_the_long_poll(server, monkeypatch):
    """A proxy that does not upgrade (426): "auto" streams by long poll from then on,
    "websocket" says so; a transport that is none is a ValueError."""
    import websockets.sync.client as sync_client
    from websockets.datastructures import Headers
    from websockets.exceptions import InvalidStatus
    from websockets.http11 import Response

    def refused(*args, **kw):
        raise InvalidStatus(Response(426, "Upgrade Required", Headers()))

    monkeypatch.setattr(sync_client, "connect", refused)
    url, sched = server
    with fc.Client(url, token=TOKEN) as client:
        s = client.create(seed=38, chunks=3)
        got = list(s.stream(timeout=30))
        assert [c.index for c in got] == [0, 1, 2] and s.end["state"] == "done"
        assert s.reconnect() is None and s._transport == "poll"     # stays on the poll
    assert err(got, alone_chunks(sched, 38, 3)) <= 1e-5
    with fc.Client(url, token=TOKEN, transport="websocket") as client:
        s = client.create(seed=39, chunks=1)
        with pytest.raises(fc.ServerError) as exc:
            s.connect()
        assert exc.value.status == 426 and "the socket was refused" in exc.value.message
        assert s.close() is True
    with pytest.raises(ValueError, match="transport must be one of .*, got 'grpc'"):
        fc.Client(url, transport="grpc")
    no_sessions(sched)


def test_chunk_messages_of_both_outputs_decode():
    lat = torch.randn(4, 2, 8, 8)
    c = fc.decode_chunk(chunk_frame(SessionChunk(3, 6, lat, 0.1, 2, 1, 2)))
    assert (c.index, c.prompt_version, c.header["frame0"]) == (3, 1, 6)
    assert torch.equal(c.latents, lat) and c.images == []
    with pytest.raises(ValueError, match="video\\(\\) needs a frames chunk"):
        c.video()
    y, x = np.mgrid[0:16, 0:24]                            # a smooth picture, 3 frames
    frame = np.stack([x * 10, y * 15, (x + y) * 5], -1).astype(np.uint8)
    video = torch.from_numpy(np.stack([frame, 255 - frame, frame // 2]))
    f = fc.decode_chunk(frames_message(SessionChunk(0, 0, lat, 0.1, 1, 0, 2, video, 0,
                                                    time.monotonic()), "webp", 95))
    assert f.latents is None and len(f.images) == 3 and f.header["format"] == "webp"
    frames = f.video()
    assert frames.shape == (3, 16, 24, 3) and frames.dtype == np.uint8
    assert float(np.abs(frames.astype(np.float32) - video.numpy()).mean()) < 4


def test_framekv_client_is_the_same_client():
    """``framekv.client`` (the ``client/`` folder, mapped by pyproject's package-dir) is
    one client: its face's names are `framekv.client.sessions`'."""
    import framekv.client as face

    assert all(getattr(face, n) is getattr(fc, n) for n in face.__all__)
    assert set(face.__all__) == set(fc.__all__)

def test_the_client_example_streams_from_its_own_server():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "client.py"), "--device",
                          "cpu"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for seed in (1, 2, 3):
        mine = [ln for ln in lines if ln.startswith(f"session {seed}: chunk")]
        assert [ln.split(", prompt")[0] for ln in mine] == [
            f"session {seed}: chunk {i} of [4, 2, 8, 8]" for i in range(8)]
        assert f"session {seed}: done" in lines
    ack = next(ln for ln in lines if "from chunk" in ln)
    applies = int(ack.rsplit(" ", 1)[1])
    versions = [ln.endswith("version 1") for ln in lines if ln.startswith("session 1: chunk")]
    assert 1 < applies < 8 and versions == [i >= applies for i in range(8)]


def test_chunks_sent_again_after_a_reconnect_come_once():
    """Chunks received but not yet streamed when a socket drops come again on the new
    one: each index reaches the caller once, in order."""
    from framekv.client.wire import SessionState

    msg = lambda i: chunk_frame(SessionChunk(i, 2 * i, torch.zeros(1, 2, 2, 2), 0.1, 2, 0, 2))  # noqa: E731
    st = SessionState(fc.Client("http://127.0.0.1:1"), "s", resume=False, after=0)
    for i in (1, 2):
        st._take(msg(i))
    for i in (1, 2, 3):                                    # the new socket's resend
        st._take(msg(i))
    assert [c.index for c in st.pending] == [1, 2, 3]
    st._take(msg(0))                                       # at or below the last streamed
    assert [c.index for c in st.pending] == [1, 2, 3]
