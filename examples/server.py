"""Embedding framekv in a server: one engine per process, every graph captured at start.

    python examples/server.py [--preset tiny] [--device cpu|cuda] [--port 8000] [--cache-dir D]
    curl -s localhost:8000/health
    curl -s -X POST localhost:8000/generate -d '{"chunks": 4}'

The engine owns one `Rollout` (model, paged cache, graph cache). Its chunk graphs are
captured before the socket opens, so no request pays a capture; each request resets
the rollout to position 0, prefills the prompt and replays one graph per chunk. The
GPU is one resource: requests take a lock and run one at a time. With ``--cache-dir``
(filled by ``framekv warmup PRESET --cache-dir D``) the start builds no kernel and no
cuDNN plan.

``--self-test`` serves on a free port, sends two requests and checks that the same
request gives the same latents (what a deterministic replay promises), then exits.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from framekv.engine.rollout import Rollout

MAX_CHUNKS = 1000
#: A request body is a small JSON object; anything larger is refused unread.
MAX_BODY_BYTES = 4096
#: Seconds a client may take to send its body.
BODY_TIMEOUT_S = 10.0


class Engine:
    """A rollout whose graphs are all captured; `generate` serves one request."""

    def __init__(self, preset: str, device: str | None, cache_dir: str | None = None):
        self.rollout = Rollout(preset, device, cache_dir=cache_dir)
        self.rollout.capture()  # every chunk length, before the first request
        self.lock = threading.Lock()

    def generate(self, chunks: int) -> dict:
        with self.lock:
            r = self.rollout
            r.reset()
            r.prefill()
            start = time.perf_counter()
            latents = [r.step() for _ in range(chunks)]
            seconds = time.perf_counter() - start
        frames = sum(x.shape[0] for x in latents)
        return {"chunks": chunks, "frames": frames, "seconds": seconds,
                "frames_per_second": frames / seconds,
                "latent_checksum": float(sum(x.double().sum() for x in latents)),
                "graph_hits": r.graphs.stats().hits}

    def health(self) -> dict:
        s = self.rollout.graphs.stats()
        return {"preset": self.rollout.name, "device": str(self.rollout.device),
                "graphs": s.graphs, "eager": s.eager, "graph_memory_bytes": s.reserved_bytes}


class BadRequest(Exception):
    """A request refused with an HTTP status and a message naming the problem."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def read_json_object(rfile, headers) -> dict:
    """The request body as a JSON object (empty body: {}), or BadRequest: a chunked
    body (411), a bad or oversized Content-Length (400, 413), a body that stalls (408,
    the handler's socket timeout), malformed or too deeply nested JSON, or JSON that is
    not an object (400)."""
    if headers.get("Transfer-Encoding", "").lower() not in ("", "identity"):
        raise BadRequest(411, "chunked request bodies are not accepted: send Content-Length")
    text = headers.get("Content-Length", "0")
    try:
        length = int(text)
    except ValueError:
        raise BadRequest(400, f"Content-Length must be an integer, got {text!r}") from None
    if not 0 <= length <= MAX_BODY_BYTES:
        raise BadRequest(413 if length > 0 else 400, f"Content-Length must be in [0, "
                         f"{MAX_BODY_BYTES}] bytes, got {length}")
    try:
        raw = rfile.read(length)
    except TimeoutError:
        raise BadRequest(408, f"the body did not arrive within {BODY_TIMEOUT_S} s") from None
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        raise BadRequest(400, "the JSON body is nested too deeply") from None
    except ValueError as exc:
        raise BadRequest(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(400, f"the body must be a JSON object, got a {type(body).__name__}")
    return body


def handler_for(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        timeout = BODY_TIMEOUT_S  # a stalled client holds a thread this long, no longer

        def do_GET(self):
            if self.path != "/health":
                return self._reply(404, {"error": f"no such path {self.path}"})
            self._reply(200, engine.health())

        def do_POST(self):
            if self.path != "/generate":
                return self._reply(404, {"error": f"no such path {self.path}"})
            try:
                chunks = read_json_object(self.rfile, self.headers).get("chunks", 1)
                if isinstance(chunks, bool) or not isinstance(chunks, int) or not 1 <= chunks <= MAX_CHUNKS:
                    raise BadRequest(400, f"chunks must be an integer in [1, {MAX_CHUNKS}], "
                                          f"got {chunks!r}")
            except BadRequest as exc:
                self.close_connection = True  # the body may not have been read whole
                return self._reply(exc.status, {"error": str(exc)})
            self._reply(200, engine.generate(chunks))

        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):  # quiet unless asked
            if self.server.verbose:
                super().log_message(fmt, *args)
    return Handler


def self_test(engine: Engine) -> int:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(engine))
    server.verbose = False
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def post(payload):
        req = urllib.request.Request(url + "/generate", json.dumps(payload).encode(), method="POST")
        with urllib.request.urlopen(req) as resp:
            return json.loads(resp.read())

    try:
        first, second = post({"chunks": 3}), post({"chunks": 3})
        with urllib.request.urlopen(url + "/health") as resp:
            health = json.loads(resp.read())
        try:
            post({"chunks": 0})
            bad = None
        except urllib.error.HTTPError as exc:
            bad = exc.code
    finally:
        server.shutdown()
    print(json.dumps({"health": health, "first": first, "second": second}, indent=2))
    same = first["latent_checksum"] == second["latent_checksum"]
    print(f"same request, same latents: {same}; bad request answered {bad}")
    return 0 if same and bad == 400 and first["frames"] > 0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--cache-dir", default=None,
                    help="load kernels and cuDNN plans kept by framekv warmup --cache-dir")
    ap.add_argument("--self-test", action="store_true")
    args = ap.parse_args()
    engine = Engine(args.preset, args.device, args.cache_dir)
    if args.self_test:
        return self_test(engine)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), handler_for(engine))
    server.verbose = True
    print(f"serving {args.preset} on http://127.0.0.1:{args.port} ({engine.health()})")
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
