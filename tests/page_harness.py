"""A real ``framekv serve`` process and a headless Chromium for the page suites
(tests/serve/test_serve_page.py, tests/serve/test_serve_page_camera.py): `serve` runs
the server on a free port until the module's tests end, `browser_page` opens a page whose console
errors and warnings and page errors are collected, `wait` waits for a JS condition."""
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
#: a fake camera (a moving test pattern) that every page may use without asking
FAKE_CAMERA = ["--use-fake-device-for-media-stream", "--use-fake-ui-for-media-stream"]
#: the frame rate the tiny Wan servers stream at
FPS = 16
#: the page suites' mark: they skip where no Chromium is installed
NEEDS_CHROMIUM = pytest.mark.skipif(not os.path.exists(CHROMIUM), reason=f"needs a Chromium "
                                    f"at {CHROMIUM} (scripts/install.sh test)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(tmp_path_factory, *argv):
    """``framekv serve --device cpu`` with ``argv`` as its own process; yields (base
    URL, health JSON), then stops it (SIGTERM) and checks that it exited 0."""
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


def serve_tiny_wan(tmp_path_factory, *argv):
    """`serve` of tiny Wan's frames at `FPS`, and ``argv``."""
    yield from serve(tmp_path_factory, "--model", "wan-diffusers", "--config", "tiny",
                     "--output", "frames", "--fps", str(FPS), *argv)


@contextlib.contextmanager
def browser_page(problems: list, args: tuple[str, ...] = ()):
    """A page of a headless Chromium (`CHROMIUM_ARGS` and ``args``); its console errors
    and warnings and its page errors go to ``problems``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS + list(args))
        try:
            page = browser.new_page()
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            yield page
        finally:
            browser.close()


def stop(page) -> None:
    """Click Stop and wait for the page's DELETE of its session to be answered (a browser
    closed right after the click may never send it)."""
    with page.expect_response(lambda r: r.request.method == "DELETE") as deleted:
        page.click("#stop")
    assert deleted.value.ok, deleted.value.status


def slot_freed(base: str) -> None:
    """Wait (10 s at most) until the server has no session open: a stopped page's slot
    is freed."""
    import httpx

    deadline = time.monotonic() + 10
    while httpx.get(f"{base}/health").json()["sessions"] != 0:
        assert time.monotonic() < deadline, "the stopped session kept its slot"
        time.sleep(0.1)


def number(page, selector: str) -> float:
    return float(page.text_content(selector))


def wait(page, js: str, timeout_s: float = 30.0) -> None:
    page.wait_for_function(js, timeout=timeout_s * 1000)


def drawn_over(n: int) -> str:
    """A JS condition: the page has drawn more than ``n`` frames."""
    return f"Number(document.getElementById('frames-drawn').textContent) > {n}"


READY = "document.getElementById('status').textContent.startsWith('ready')"

#: JS: the output canvas's size, distinct colours and last drawn frame number
CANVAS_COLOURS = """() => {
  const c = document.getElementById("video");
  const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
  const seen = new Set();
  for (let i = 0; i < d.length; i += 4) seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2]);
  return {width: c.width, height: c.height, colours: seen.size, frame: c.dataset.frame};
}"""
