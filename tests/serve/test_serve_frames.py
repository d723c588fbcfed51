"""`framekv serve --output frames` on the CPU: a real server over a tiny Wan runner, its
text encoder and a tiny VAE decoder; real HTTP and WebSocket clients.

A session's frames messages parse, their JPEGs decode (Pillow) to the video's size,
frame counts and numbers follow the VAE's chunking, and the pictures are those of the
same text and seed rolled out and decoded offline; a text prompt change is acknowledged
and the video goes on; /metrics parses (prometheus_client's parser) into the right
types and values; the page is served without a token; bad options are named.
"""
from __future__ import annotations

import argparse
import io
import json
import re
import time

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("diffusers")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
ws_client = pytest.importorskip("websockets.sync.client")
Image = pytest.importorskip("PIL.Image")

from framekv.engine.step import chunk_noise  # noqa: E402
from framekv.engine.serving import SessionChunk, StreamScheduler  # noqa: E402
from framekv.tools.serve import build_app, chunk_frame, frames_message, wan_factory  # noqa: E402
from framekv.specs.wire import decode as parse_message  # noqa: E402
from framekv.tools.serve.wire import encode_image  # noqa: E402
from serve_harness import served_http  # noqa: E402

TOKEN = "frames-token"


def url(http, path: str) -> str:
    """An absolute URL of the server, for a client without the token."""
    return str(http.base_url).rstrip("/") + path


@pytest.fixture(scope="module")
def server():
    parts = wan_factory(argparse.Namespace(config="tiny", preset=None, weights=None,
                                           device="cpu", cache_dir=None), use_graphs=False)
    sched = StreamScheduler(max_sessions=2, queue_chunks=2, runner_factory=parts,
                            decoder_factory=parts.decoder)
    with served_http(sched, TOKEN) as (http, port, _):
        yield http, f"ws://127.0.0.1:{port}", sched, parts


def stream(ws_base, sid, on_chunk=None, limit=60.0):
    """(chunks [(header, images)], text messages, end message) of a session's socket."""
    chunks, texts = [], []
    with ws_client.connect(f"{ws_base}/v1/sessions/{sid}/stream?token={TOKEN}",
                           open_timeout=10, max_size=None) as ws:
        deadline = time.monotonic() + limit
        while True:
            msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(msg, str):
                texts.append(json.loads(msg))
                if texts[-1]["type"] == "end":
                    return chunks, texts[:-1], texts[-1]
                continue
            header, payload = parse_message(msg)
            assert sum(header["sizes"]) == len(payload) and len(header["sizes"]) == header["frames"]
            ends = [sum(header["sizes"][:i + 1]) for i in range(header["frames"])]
            images = [payload[a:b] for a, b in zip([0] + ends[:-1], ends)]
            chunks.append((header, images))
            ws.send(json.dumps({"type": "ack", "index": header["index"]}))
            if on_chunk is not None:
                on_chunk(ws, header)


def offline_video(sched, parts, seed: int, text: str, n: int) -> list[torch.Tensor]:
    """The same text and seed rolled out alone and decoded by a fresh decoder: uint8."""
    from framekv.engine.wan import WanRollout
    from framekv.engine.wan.vae import StreamingVAEDecoder
    from framekv.engine.serving import to_uint8

    r = WanRollout(parts.model, use_graphs=False, text_encoder=parts.text_encoder, **parts.sizes)
    r.set_prompt(text)
    dec = StreamingVAEDecoder(parts.vae, sequences=1)
    out = [to_uint8(dec.decode(r.step(chunk_noise(seed, i, sched.chunk_shape)[None])))[0]
           for i in range(n)]
    r.close()
    return out


def pixels(jpeg: bytes):
    img = Image.open(io.BytesIO(jpeg))
    assert img.format == "JPEG" and img.mode == "RGB"
    return img, torch.from_numpy(np.asarray(img).copy())                  # [H, W, 3]


def test_frames_messages_parse_and_decode_to_the_sessions_video(server):
    http, ws, sched, parts = server
    F, (H, W) = parts.sizes["frames_per_chunk"], parts.sizes["latent_size"]
    r = http.post("/v1/sessions", json={"seed": 5, "chunks": 3, "text": "a red fox"})
    assert r.status_code == 201, r.text
    chunks, texts, end = stream(ws, r.json()["id"])
    assert end == {"type": "end", "state": "done", "error": None} and texts == []
    counts = [h["frames"] for h, _ in chunks]
    assert [h["index"] for h, _ in chunks] == [0, 1, 2]
    assert counts == [1 + 4 * (F - 1), 4 * F, 4 * F]
    assert [h["frame0"] for h, _ in chunks] == [0, counts[0], counts[0] + counts[1]]
    want = offline_video(sched, parts, 5, "a red fox", 3)
    for (h, images), video in zip(chunks, want):
        assert h["type"] == "frames" and h["format"] == "jpeg" and h["prompt_version"] == 0
        assert (h["width"], h["height"]) == (8 * W, 8 * H)
        assert 0 <= h["seconds"] <= h["latency"] + 1e-3
        for image, frame in zip(images, video):
            img, got = pixels(image)
            assert img.size == (8 * W, 8 * H)
            # JPEG is lossy: the offline frame through the same JPEG encoder, up to the
            # rounding flips of a batched decode.
            _, want = pixels(encode_image(frame, "jpeg", 85))
            assert float((got.float() - want.float()).abs().mean()) < 0.5
        other = pixels(encode_image(video[-1], "jpeg", 85))[1]
        assert float((pixels(images[0])[1].float() - other.float()).abs().mean()) > 5.0


def test_a_text_prompt_change_is_acknowledged_and_the_video_goes_on(server):
    http, ws, sched, parts = server
    F = parts.sizes["frames_per_chunk"]
    sid = http.post("/v1/sessions", json={"seed": 6, "chunks": 8, "text": "a red fox"}).json()["id"]

    def change(sock, header):
        if header["index"] == 0:
            sock.send(json.dumps({"type": "prompt", "text": "a", "prompt_seed": 1}))
            sock.send(json.dumps({"type": "prompt", "text": "a blue whale"}))
    chunks, texts, end = stream(ws, sid, on_chunk=change)
    assert end["state"] == "done" and len(chunks) == 8
    assert texts[0]["type"] == "error" and "give one of" in texts[0]["error"]
    assert [t["type"] for t in texts[1:]] == ["prompt_ack"] and texts[1]["prompt_version"] == 1
    versions = [h["prompt_version"] for h, _ in chunks]
    assert versions.index(1) == texts[1]["applies_from"]       # the first chunk under it
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert [h["frames"] for h, _ in chunks[1:]] == [4 * F] * 7    # not a new video


def test_metrics_parse_into_typed_series_with_the_schedulers_values(server):
    from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
    from prometheus_client.parser import text_string_to_metric_families

    http, ws, sched, parts = server
    sid = http.post("/v1/sessions", json={"seed": 9, "chunks": 2}).json()["id"]
    stream(ws, sid)
    deadline = time.monotonic() + 10
    while sched.sessions:                            # idle: the counters stand still
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE_PLAIN_0_0_4
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    m = sched.metrics()
    want = {"framekv_sessions": ("gauge", 0), "framekv_session_slots": ("gauge", 2),
            "framekv_pool_bytes": ("gauge", m["pool_bytes"]),
            "framekv_steps": ("counter", m["steps"]),
            "framekv_failed_steps": ("counter", 0), "framekv_chunks": ("counter", m["chunks"]),
            "framekv_graph_replays": ("counter", m["graph_replays"]),
            "framekv_graph_captures": ("counter", m["graph_captures"]),
            "framekv_video_frames": ("counter", m["video_frames"])}
    for name, (kind, value) in want.items():
        f = fams[name]
        assert f.type == kind and f.documentation and f.samples[0].value == value, name
    assert m["video_frames"] >= 5 + 8 and m["chunks"] >= 2
    assert "framekv_gpu_allocated_bytes" not in fams                   # CPU
    for name, count in (("framekv_chunk_seconds", m["chunks"]),
                        ("framekv_step_seconds", m["steps"])):
        f = fams[name]
        assert f.type == "histogram" and f.documentation
        samples = {(s.name, s.labels.get("le")): s.value for s in f.samples}
        buckets = [v for (n, le), v in samples.items() if n.endswith("_bucket")]
        assert buckets == sorted(buckets) and samples[(f"{name}_bucket", "+Inf")] == count
        assert samples[(f"{name}_count", None)] == count and samples[(f"{name}_sum", None)] > 0
    om = http.get("/metrics", headers={"Accept": "application/openmetrics-text"})
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n")
    assert httpx.get(url(http, "/metrics")).status_code == 401


def test_the_page_is_served_without_a_token_and_loads_nothing_from_outside(server):
    http, ws, sched, parts = server
    r = httpx.get(url(http, "/"))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for needle in ('id="frames-drawn"', 'id="status"', 'id="prompt-version"', "<canvas",
                   'id="token"', "createImageBitmap"):
        assert needle in r.text, needle
    # its one script beside it comes from this server, without a token too
    assert re.findall(r"src=\"([^\"]*)\"", r.text) == ["camera.js"]
    assert 'href="http' not in r.text and "@import" not in r.text
    script = httpx.get(url(http, "/camera.js"))
    assert script.status_code == 200 and "javascript" in script.headers["content-type"]
    assert "://" not in script.text and "@import" not in script.text
    health = httpx.get(url(http, "/health")).json()
    assert health | {"sessions": 0} == {"status": "ok", "sessions": 0, "max_sessions": 2,
                                        "output": "frames", "fps": 16, "token": True,
                                        "text": True}


def test_webp_frames_a_video_chunks_input_and_a_chunk_without_frames():
    y, x = np.mgrid[0:24, 0:40]                      # odd-ish sizes, a smooth picture
    frame = np.stack([x * 6, y * 10, (x + y) * 4], -1).astype(np.uint8)
    video = torch.from_numpy(np.stack([frame, 255 - frame, frame // 2]))  # [3, 24, 40, 3]
    chunk = SessionChunk(4, 8, torch.zeros(1), 0.5, 2, 3, 2, video, 17, time.monotonic(), 0.0)
    header, payload = parse_message(frames_message(chunk, "webp", 90))
    assert {k: header[k] for k in ("type", "index", "frame0", "frames", "width", "height",
                                   "format", "batch", "prompt_version")} == {
        "type": "frames", "index": 4, "frame0": 17, "frames": 3, "width": 40, "height": 24,
        "format": "webp", "batch": 2, "prompt_version": 3}
    assert "input" not in header                     # a text session's chunk names none
    chunk.input = (12, 8)                            # a video session's: its input frames
    for message in (frames_message(chunk), chunk_frame(chunk)):
        assert parse_message(message)[0]["input"] == {"first": 12, "count": 8}
    start = 0
    for size, want in zip(header["sizes"], video):
        img = Image.open(io.BytesIO(payload[start:start + size]))
        start += size
        assert img.format == "WEBP" and img.size == (40, 24)
        assert float(np.abs(np.asarray(img.convert("RGB"), np.float32) - want.numpy()).mean()) < 4
    chunk.video = None
    with pytest.raises(ValueError, match="needs a chunk with decoded frames"):
        frames_message(chunk)


@pytest.mark.parametrize("kwargs,match", [
    (dict(output="frames"), "needs a scheduler with a decoder"),
    (dict(output="pixels"), "output must be one of"),
    (dict(frame_format="png"), "frame_format must be one of"),
    (dict(fps=0), r"fps must be an integer in \[1, 240\]"),
    (dict(quality=101), r"quality must be an integer in \[1, 100\]"),
])
def test_bad_app_options_are_named(kwargs, match):
    latents_only = type("Sched", (), {"decoding": False})()
    with pytest.raises(ValueError, match=match):
        build_app(latents_only, **kwargs)


def test_latents_are_served_only_from_a_scheduler_that_copies_them_to_the_host():
    frames_only = type("Sched", (), {"decoding": True, "host_latents": False})()
    with pytest.raises(ValueError, match="carry their latents to the host"):
        build_app(frames_only, output="latents")


def test_the_reference_model_streams_frames_unless_latents_are_asked_for():
    """It has no VAE: its frames are pictures of its latents (`LatentPreview`; served in
    tests/serve/test_serve_defects.py)."""
    from framekv.tools.cli import build_parser
    from framekv.tools.serve.command import output_of

    for argv, output in ((["serve"], "frames"), (["serve", "--output", "frames"], "frames"),
                         (["serve", "--output", "latents"], "latents")):
        assert output_of(build_parser().parse_args(argv)) == output, argv
