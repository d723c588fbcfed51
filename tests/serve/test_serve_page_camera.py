"""The page's camera source in a real headless Chromium with a fake camera against a
real ``framekv serve --model wan-diffusers --config tiny --video-strength 0.75``
process (CPU): switched to Camera, the page shows the camera beside the output,
starts a video-to-video session at the slider's strength (one not the server's:
refused, said why), sends the camera's frames as frames_in messages (one JPEG of the
model's size each) at the session's frame rate, draws the chunks made from them and
shows a moving input to output latency: each chunk's, from sending the last input
frame its header names (so exact where the server dropped frames), each header naming
its input frames. A frames_in message the page packs is what
`framekv.specs.wire` decodes. A page that gets no chunk back sends two chunks of
frames at the frame rate and no more, all taken by the server, none dropped; a camera
that goes is a message. (A denied camera: tests/serve/test_serve_page.py, against a text
server.)
"""
from __future__ import annotations

import time

import pytest
from page_harness import (CANVAS_COLOURS, FAKE_CAMERA, FPS, NEEDS_CHROMIUM, READY,
                          browser_page, drawn_over, number, serve_tiny_wan, slot_freed,
                          stop, wait)

pytestmark = NEEDS_CHROMIUM


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``framekv serve`` of tiny Wan (no token) as its own process; yields (base URL,
    health JSON)."""
    yield from serve_tiny_wan(tmp_path_factory, "--video-strength", "0.75")


def _latency_ms(page) -> float | None:
    text = page.text_content("#io-latency")
    return float(text.removesuffix(" ms")) if text.endswith(" ms") else None


def _strength(page, value: str) -> None:
    """Move the strength slider to ``value`` as a user does (its value, an input event)."""
    page.eval_on_selector("#strength", f"e => {{ e.value = '{value}'; "
                                       "e.dispatchEvent(new Event('input')); }")
    assert page.text_content("#strength-value") == f"{float(value):.2f}"


def _packs_what_the_wire_codec_decodes(page) -> None:
    """A frames_in message of two images the page packs, decoded by `framekv.specs.wire`."""
    from framekv.specs import wire

    msg = page.evaluate("""() => Array.from(new Uint8Array(Camera.framesIn(
        [new Uint8Array([1, 2, 3]).buffer, new Uint8Array([250, 251]).buffer],
        "jpeg", 40, 30)))""")
    header, payload = wire.decode(bytes(msg))
    assert header == {"type": "frames_in", "format": "jpeg", "width": 40, "height": 30,
                      "count": 2, "sizes": [3, 2]}
    assert wire.split_images(header, payload) == [bytes([1, 2, 3]), bytes([250, 251])]


def _frames_are_jpegs_of_the_model_size(sent: list, width: int, height: int) -> None:
    """The binary messages the page sent on its socket: frames_in of one JPEG each, the
    camera's center cut to the model's ``width`` x ``height``."""
    import io

    from PIL import Image

    from framekv.specs import wire

    frames = [wire.decode(m) for m in sent if isinstance(m, bytes)]
    assert len(frames) >= 5, sent[:3]
    for j, (header, payload) in enumerate(frames):      # each named by its index here
        assert header == {"type": "frames_in", "format": "jpeg", "width": width,
                          "height": height, "count": 1, "sizes": [len(payload)],
                          "id": j}, header
        image = Image.open(io.BytesIO(payload))
        assert (image.format, image.size) == ("JPEG", (width, height))


def _latency_runs_from_the_last_input_frame_its_header_names(page) -> None:
    """Camera frames sent on a stand-in socket (as fast as they encode: nothing told the
    page the chunks' frames), then a chunk of frames 0 to 4 whose header names input
    frames 12 to 19 (the server dropped those before): its latency runs from sending
    frame 19, not frame 4."""
    got = page.evaluate("""async () => {
        const sends = [];
        const ws = { readyState: WebSocket.OPEN, bufferedAmount: 0,
                     send: () => sends.push(performance.now()) };
        Camera.opened(ws, 60);
        while (sends.length < 20) await new Promise((ok) => setTimeout(ok, 10));
        Camera.halt();
        const now = performance.now();
        Camera.received({ width: 64, height: 64, frame0: 0, frames: 5,
                          input: { first: 12, count: 8 } });
        return { want: now - sends[19], not: now - sends[4],
                 readout: document.getElementById('io-latency').textContent };
    }""")
    shown = float(got["readout"].removesuffix(" ms"))
    assert abs(shown - got["want"]) <= 2 < got["not"] - got["want"], got


def _input_spans(received: list, first: int, later: int) -> None:
    """The chunk messages the page got: each header names its input frames, chunk 0's
    ``first`` of them, each later one's ``later``, each run after the one before."""
    from framekv.specs import wire

    spans = [wire.decode(m)[0]["input"] for m in received if isinstance(m, bytes)]
    assert [s["count"] for s in spans] == [first] + [later] * (len(spans) - 1), spans
    assert all(b["first"] >= a["first"] + a["count"] for a, b in zip(spans, spans[1:]))


def test_the_camera_streams_through_the_model_with_its_latency(server):
    base, _ = server
    problems, created, sent, received = [], [], [], []
    with browser_page(problems, FAKE_CAMERA) as page:
        page.on("request", lambda r: created.append(r.post_data_json)
                if r.method == "POST" and r.url.endswith("/v1/sessions") else None)
        page.on("websocket", lambda ws: (ws.on("framesent", lambda m: sent.append(m)),
                                         ws.on("framereceived", lambda m: received.append(m))))
        page.goto(f"{base}/")
        wait(page, READY)
        _packs_what_the_wire_codec_decodes(page)
        assert page.is_hidden("#camera") and page.is_hidden("#strength-row")
        page.select_option("#source", "camera")
        wait(page, "document.getElementById('camera').videoWidth > 0")   # the preview plays
        assert page.is_visible("#strength-row") and page.text_content("#camera-note") == ""
        _latency_runs_from_the_last_input_frame_its_header_names(page)
        page.fill("#seed", "3")
        _strength(page, "0.6")                      # not the server's: refused, said why
        page.click("#start")
        wait(page, "document.body.dataset.state === 'error'")
        assert "strength must be 0.75" in page.text_content("#status")
        _strength(page, "0.75")
        page.click("#start")
        wait(page, drawn_over(6))                   # past the first chunk (5 frames)
        assert [(c.get("input"), c.get("strength")) for c in created] == [
            ("video", 0.6), ("video", 0.75)], created
        canvas = page.evaluate(CANVAS_COLOURS)
        assert (canvas["width"], canvas["height"]) == (64, 64), canvas
        assert canvas["colours"] > 16, canvas       # a picture, not a blank canvas
        assert number(page, "#frames-sent") >= 5
        _frames_are_jpegs_of_the_model_size(sent, 64, 64)
        wait(page, "document.getElementById('io-latency').textContent.endsWith(' ms')")
        first, chunks = _latency_ms(page), number(page, "#chunks")
        assert first > 0, first
        # the median moves as chunks come (each chunk's own latency differs)
        wait(page, f"document.getElementById('io-latency').textContent !== '{first:.0f} ms'")
        assert number(page, "#chunks") > chunks
        _input_spans(received, 5, 8)

        stop(page)
        assert page.text_content("#status") == "stopped"
        sent = number(page, "#frames-sent")
        page.wait_for_timeout(300)
        assert number(page, "#frames-sent") == sent          # nothing sent after stop
    slot_freed(base)
    refused = ("console error: Failed to load resource: the server responded with a status "
               "of 422 (Unprocessable Entity)")
    assert problems == [refused]                # the refused start's, no other


def _start_over_routed_socket(page, base: str, route) -> None:
    """The page at ``base``, its stream socket through ``route`` (playwright's
    route_web_socket handler), switched to the camera, a session started."""
    page.route_web_socket("**/stream", route)
    page.goto(f"{base}/")
    wait(page, READY)
    page.select_option("#source", "camera")
    wait(page, "document.getElementById('camera').videoWidth > 0")
    page.click("#start")


def test_a_refused_frame_is_left_out_of_the_pages_numbering(server):
    """The page's third frames message is spoiled on its way (a routed socket): the
    server refuses it naming its id, so the page leaves that frame out of its numbering
    (the server's frame n is its frame n + 1 from n = 2 on) and goes on: chunks come and
    the latency shows."""
    from framekv.specs import wire

    base, _ = server

    def spoil(ws):
        to_server = ws.connect_to_server()

        def forward(message):
            if isinstance(message, bytes):
                header, payload = wire.decode(message)
                if header.get("id") == 2:
                    message = wire.encode(header, b"\xff" * len(payload))
            to_server.send(message)
        ws.on_message(forward)

    problems = []
    with browser_page(problems, FAKE_CAMERA) as page:
        _start_over_routed_socket(page, base, spoil)
        wait(page, "Camera.refusedFrames().length > 0")
        assert "does not decode" in page.text_content("#status")
        assert page.evaluate("Camera.refusedFrames()") == [2]
        assert page.evaluate("[0, 1, 2, 3, 7].map(Camera.pageIndex)") == [0, 1, 3, 4, 8]
        wait(page, drawn_over(6))
        wait(page, "document.getElementById('io-latency').textContent.endsWith(' ms')")
        assert _latency_ms(page) > 0 and page.evaluate("Camera.refusedFrames()") == [2]
        stop(page)
    slot_freed(base)
    assert problems == []


def test_a_page_that_gets_no_chunk_sends_two_chunks_of_frames_and_stops(server):
    """The server's messages never reach the page (a routed socket): it sends chunk 0's
    and chunk 1's frames, then none, and the server took every one, dropping none. Then
    the camera ends: the page says so and is back on its text source."""
    import httpx

    base, _ = server
    per = httpx.get(f"{base}/v1/info").json()["video_frames_per_chunk"]
    want = per["first"] + per["later"]

    def deaf(ws):                                 # frames go through, chunks do not come
        ws.connect_to_server().on_message(lambda message: None)

    problems = []
    with browser_page(problems, FAKE_CAMERA) as page:
        _start_over_routed_socket(page, base, deaf)
        wait(page, "Number(document.getElementById('frames-sent').textContent) >= 1")
        began = time.monotonic()
        wait(page, f"Number(document.getElementById('frames-sent').textContent) >= {want}")
        assert time.monotonic() - began >= 0.8 * (want - 1) / FPS     # paced, not a burst
        page.wait_for_timeout(600)                  # ten frames' time at 16 fps
        assert number(page, "#frames-sent") == want
        sid = page.evaluate("S.id")
        info = httpx.get(f"{base}/v1/sessions/{sid}").json()
        assert (info["frames_in"], info["frames_dropped"]) == (want, 0), info
        assert page.text_content("#io-latency") == "-"
        # the camera goes (unplugged): said so, back to text
        page.evaluate("document.getElementById('camera').srcObject.getVideoTracks()[0]"
                      ".dispatchEvent(new Event('ended'))")
        assert page.text_content("#camera-note") == (
            "the camera stopped: the text prompt still works")
        assert page.input_value("#source") == "text" and page.is_hidden("#camera")
        page.click("#stop")
    slot_freed(base)
    assert problems == []
