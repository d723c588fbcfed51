"""The page at ``/`` in a real headless Chromium against a real ``framekv serve --model
wan-diffusers --config tiny --output frames`` process (CPU, a bearer token): the page
asks for the token, starts a session from its prompt box, draws the decoded video on
its canvas at the video's frame rate, changes the prompt mid-stream (the server's
acknowledged prompt_version shown, frames of it drawn after), stops (the server frees
the slot), and logs no console or page error on the way. Against the plain ``framekv
serve`` (the reference model, no token) the page never shows the token field, not even
before /health answers, and draws the pictures of the model's latents. A camera the
browser denies is a message beside the source, and the text prompt still streams.
/docs renders the API from /openapi.json with every request to the server itself.
"""
from __future__ import annotations

import time

import pytest
from page_harness import (CANVAS_COLOURS, FPS, NEEDS_CHROMIUM, READY, browser_page,
                          drawn_over, number, serve, serve_tiny_wan, slot_freed, stop, wait)

TOKEN = "page-token"

pytestmark = NEEDS_CHROMIUM


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``framekv serve`` of tiny Wan with a token as its own process; yields (base URL,
    health JSON)."""
    yield from serve_tiny_wan(tmp_path_factory, "--max-sessions", "2", "--token", TOKEN)


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    """The plain ``framekv serve`` (every option its default but the device and port)."""
    yield from serve(tmp_path_factory)


def test_the_page_streams_changes_its_prompt_and_stops(server):
    base, health = server
    assert health["output"] == "frames" and health["token"] and health["text"]
    problems = []
    with browser_page(problems) as page:
        page.goto(f"{base}/")                      # the page itself needs no token
        wait(page, READY)
        assert page.is_visible("#token") and page.is_disabled("#stop")

        page.fill("#token", TOKEN)
        page.fill("#seed", "7")
        page.fill("#prompt", "a red fox running through snow")
        page.click("#start")
        wait(page, drawn_over(12))               # past the first chunk (5 frames)
        canvas = page.evaluate(CANVAS_COLOURS)
        # tiny: 8x8 latents, 8x upsampled by the VAE
        assert (canvas["width"], canvas["height"]) == (64, 64), canvas
        assert canvas["colours"] > 16, canvas      # a picture, not a blank canvas
        assert page.text_content("#prompt-version") == "0"
        assert page.get_attribute("body", "data-state") == "streaming"

        page.fill("#prompt", "a blue whale under the sea")
        page.click("#apply")
        wait(page, "document.getElementById('prompt-version').textContent === '1'")
        after = number(page, "#frames-drawn")
        wait(page, "document.getElementById('drawn-version').textContent === '1'")
        wait(page, drawn_over(after + 8))        # the video goes on under the new prompt
        fps = number(page, "#fps")
        assert 0 < fps <= FPS * 1.25, fps          # drawn at the video's rate, not faster
        assert page.text_content("#latency").endswith(" ms")

        stop(page)
        assert page.text_content("#status") == "stopped"
        assert page.get_attribute("body", "data-state") == "stopped"
        drawn = number(page, "#frames-drawn")
        page.wait_for_timeout(300)
        assert number(page, "#frames-drawn") == drawn      # nothing drawn after stop
    slot_freed(base)
    assert problems == []


def test_the_plain_server_draws_its_latents_and_never_shows_a_token_field(plain_server):
    base, health = plain_server
    assert health["output"] == "frames" and not health["token"] and not health["text"]
    problems, held = [], []
    with browser_page(problems) as page:
        page.route("**/health", lambda route: held.append(route))   # held until let go
        page.goto(f"{base}/")
        deadline = time.monotonic() + 30
        while not held:
            assert time.monotonic() < deadline, "the page never asked /health"
            page.wait_for_timeout(50)
        assert page.is_hidden("#token-row")           # before /health answers
        assert page.text_content("#status") == "idle"
        held[0].continue_()
        wait(page, READY)
        assert page.is_hidden("#token-row") and page.is_enabled("#start")
        assert page.is_disabled("#prompt")                # no text prompts here

        page.click("#start")
        wait(page, drawn_over(6))
        canvas = page.evaluate(CANVAS_COLOURS)
        # tiny: 8x8 latents drawn 8x larger
        assert (canvas["width"], canvas["height"]) == (64, 64), canvas
        assert canvas["colours"] > 16, canvas
        assert page.get_attribute("body", "data-state") == "streaming"
        stop(page)
        assert page.text_content("#status") == "stopped"
    slot_freed(base)
    assert problems == []


def test_a_denied_camera_says_so_and_the_text_prompt_still_streams(server):
    base, _ = server
    problems = []
    with browser_page(problems) as page:
        page.add_init_script("""navigator.mediaDevices.getUserMedia = () =>
            Promise.reject(new DOMException("denied", "NotAllowedError"));""")
        page.goto(f"{base}/")
        wait(page, READY)
        page.fill("#token", TOKEN)
        page.select_option("#source", "camera")
        wait(page, "document.getElementById('camera-note').textContent !== ''")
        assert page.text_content("#camera-note") == (
            "permission to use the camera was denied: the text prompt still works")
        assert page.input_value("#source") == "text" and page.is_hidden("#camera")
        page.click("#start")
        wait(page, drawn_over(0))
        assert page.text_content("#frames-sent") == "-"        # no frame sent
        stop(page)
    slot_freed(base)
    assert problems == []


def test_the_docs_page_renders_the_api_from_this_server_alone(server):
    """/docs?token=T in the browser: every route and schema of /openapi.json rendered,
    every request to this server, no console or page error."""
    base, _ = server
    problems, requests = [], []
    with browser_page(problems) as page:
        page.on("request", lambda r: requests.append(r.url))
        page.goto(f"{base}/docs?token={TOKEN}")
        wait(page, "document.querySelectorAll('#routes details').length >= 8")
        texts = "es => es.map(e => e.textContent)"
        routes = page.eval_on_selector_all("#routes summary", texts)
        schemas = page.eval_on_selector_all("#schemas summary", texts)
        assert page.text_content("#status") == ""
    assert any(r.startswith("DELETE/v1/sessions/{sid}") for r in routes), routes
    assert any(r.startswith("PUT/v1/sessions/{sid}/prompt") for r in routes), routes
    assert {"CreateSession", "ErrorBody", "ServerInfo", "SessionInfo"} <= set(schemas)
    assert requests and all(u.startswith(base + "/") for u in requests), requests
    assert problems == []
