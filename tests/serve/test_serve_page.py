"""The page at ``/`` in a real headless Chromium against a real ``framekv serve --model
wan-diffusers --config tiny --output frames`` process (CPU, a bearer token): the page
asks for the token, starts a session from its prompt box, draws the decoded video on
its canvas at the video's frame rate, changes the prompt mid-stream (the server's
acknowledged prompt_version shown, frames of it drawn after), stops (the server frees
the slot), and logs no console or page error on the way. Against the plain ``framekv
serve`` (the reference model, no token) the page never shows the token field, not even
before /health answers, and draws the pictures of the model's latents. /docs renders
the API from /openapi.json with every request to the server itself.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
TOKEN = "page-token"
FPS = 16

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"needs a Chromium at {CHROMIUM} (scripts/install.sh test)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``framekv serve`` of tiny Wan with a token as its own process; yields (base URL,
    health JSON)."""
    yield from _serve(tmp_path_factory, "--model", "wan-diffusers", "--config", "tiny",
                      "--output", "frames", "--max-sessions", "2", "--token", TOKEN,
                      "--fps", str(FPS))


@pytest.fixture(scope="module")
def plain_server(tmp_path_factory):
    """The plain ``framekv serve`` (every option its default but the device and port)."""
    yield from _serve(tmp_path_factory)


def _serve(tmp_path_factory, *argv):
    import httpx

    port = _free_port()
    log = open(tmp_path_factory.mktemp("serve") / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "framekv.tools.cli", "serve", "--device",
                             "cpu", "--port", str(port), *argv],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={k: v for k, v in os.environ.items() if k != "FRAMEKV_TOKEN"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, (log.seek(0), log.read())[1]
            try:
                health = httpx.get(f"{base}/health", timeout=1).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(0.2)
        yield base, health
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=30) == 0, (log.seek(0), log.read())[1]
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()


@contextlib.contextmanager
def _browser_page(problems: list):
    """A page of a headless Chromium; its console errors and warnings and its page
    errors go to ``problems``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            yield page
        finally:
            browser.close()


def _slot_freed(base: str) -> None:
    """Wait (10 s at most) until the server has no session open: a stopped page's slot
    is freed."""
    import httpx

    deadline = time.monotonic() + 10
    while httpx.get(f"{base}/health").json()["sessions"] != 0:
        assert time.monotonic() < deadline, "the stopped session kept its slot"
        time.sleep(0.1)


def _number(page, selector: str) -> float:
    return float(page.text_content(selector))


def _wait(page, js: str, timeout_s: float = 30.0) -> None:
    page.wait_for_function(js, timeout=timeout_s * 1000)


CANVAS_COLOURS = """() => {
  const c = document.getElementById("video");
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  const seen = new Set();
  for (let i = 0; i < d.length; i += 4) seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
  return {width: c.width, height: c.height, colours: seen.size, frame: c.dataset.frame};
}"""


def _drawn_over(n: int) -> str:
    return f"Number(document.getElementById('frames-drawn').textContent) > {n}"


def test_the_page_streams_changes_its_prompt_and_stops(server):
    base, health = server
    assert health["output"] == "frames" and health["token"] and health["text"]
    problems = []
    with _browser_page(problems) as page:
        page.goto(f"{base}/")                      # the page itself needs no token
        _wait(page, "document.getElementById('status').textContent.startsWith('ready')")
        assert page.is_visible("#token") and page.is_disabled("#stop")

        page.fill("#token", TOKEN)
        page.fill("#seed", "7")
        page.fill("#prompt", "a red fox running through snow")
        page.click("#start")
        _wait(page, _drawn_over(12))               # past the first chunk (5 frames)
        canvas = page.evaluate(CANVAS_COLOURS)
        # tiny: 8x8 latents, 8x upsampled by the VAE
        assert (canvas["width"], canvas["height"]) == (64, 64), canvas
        assert canvas["colours"] > 16, canvas      # a picture, not a blank canvas
        assert page.text_content("#prompt-version") == "0"
        assert page.get_attribute("body", "data-state") == "streaming"

        page.fill("#prompt", "a blue whale under the sea")
        page.click("#apply")
        _wait(page, "document.getElementById('prompt-version').textContent === '1'")
        after = _number(page, "#frames-drawn")
        _wait(page, "document.getElementById('drawn-version').textContent === '1'")
        _wait(page, _drawn_over(after + 8))        # the video goes on under the new prompt
        fps = _number(page, "#fps")
        assert 0 < fps <= FPS * 1.25, fps          # drawn at the video's rate, not faster
        assert page.text_content("#latency").endswith(" ms")

        page.click("#stop")
        assert page.text_content("#status") == "stopped"
        assert page.get_attribute("body", "data-state") == "stopped"
        drawn = _number(page, "#frames-drawn")
        page.wait_for_timeout(300)
        assert _number(page, "#frames-drawn") == drawn      # nothing drawn after stop
    _slot_freed(base)
    assert problems == []


def test_the_plain_server_draws_its_latents_and_never_shows_a_token_field(plain_server):
    base, health = plain_server
    assert health["output"] == "frames" and not health["token"] and not health["text"]
    problems, held = [], []
    with _browser_page(problems) as page:
        page.route("**/health", lambda route: held.append(route))   # held until let go
        page.goto(f"{base}/")
        deadline = time.monotonic() + 30
        while not held:
            assert time.monotonic() < deadline, "the page never asked /health"
            page.wait_for_timeout(50)
        assert page.is_hidden("#token-row")           # before /health answers
        assert page.text_content("#status") == "idle"
        held[0].continue_()
        _wait(page, "document.getElementById('status').textContent.startsWith('ready')")
        assert page.is_hidden("#token-row") and page.is_enabled("#start")
        assert page.is_disabled("#prompt")                # no text prompts here

        page.click("#start")
        _wait(page, _drawn_over(6))
        canvas = page.evaluate(CANVAS_COLOURS)
        # tiny: 8x8 latents drawn 8x larger
        assert (canvas["width"], canvas["height"]) == (64, 64), canvas
        assert canvas["colours"] > 16, canvas
        assert page.get_attribute("body", "data-state") == "streaming"
        page.click("#stop")
        assert page.text_content("#status") == "stopped"
    _slot_freed(base)
    assert problems == []


def test_the_docs_page_renders_the_api_from_this_server_alone(server):
    """/docs?token=T in the browser: every route and schema of /openapi.json rendered,
    every request to this server, no console or page error."""
    base, _ = server
    problems, requests = [], []
    with _browser_page(problems) as page:
        page.on("request", lambda r: requests.append(r.url))
        page.goto(f"{base}/docs?token={TOKEN}")
        _wait(page, "document.querySelectorAll('#routes details').length >= 8")
        texts = "es => es.map(e => e.textContent)"
        routes = page.eval_on_selector_all("#routes summary", texts)
        schemas = page.eval_on_selector_all("#schemas summary", texts)
        assert page.text_content("#status") == ""
    assert any(r.startswith("DELETE/v1/sessions/{sid}") for r in routes), routes
    assert any(r.startswith("PUT/v1/sessions/{sid}/prompt") for r in routes), routes
    assert {"CreateSession", "ErrorBody", "ServerInfo", "SessionInfo"} <= set(schemas)
    assert requests and all(u.startswith(base + "/") for u in requests), requests
    assert problems == []
