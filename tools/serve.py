"""`framekv serve`: streaming sessions over HTTP and WebSockets around a `StreamScheduler`.

Routes (JSON errors name the problem; with ``--token`` every route but /health needs
``Authorization: Bearer T``, on the WebSocket also ``?token=T``)::

    GET    /health                       liveness, sessions open / max
    GET    /metrics                      Prometheus text: sessions, steps, chunk latency
                                         histogram, graph replays and captures, memory
    POST   /v1/sessions                  {"seed": int, "chunks": int?, "prompt_seed": int?
                                          | "prompt": {"shape": [P, D], "data": base64
                                          float32}} -> 201 {"id": ...}; full: 503 +
                                          Retry-After
    DELETE /v1/sessions/{id}             204
    WS     /v1/sessions/{id}/stream      binary frames, one per chunk: a 4-byte
                                         big-endian header length, a JSON header
                                         (index, frame0, frames, dtype, shape, seconds,
                                         batch, prompt_version), the latents (fp32, C order); a last
                                         text frame {"type": "end", "state", "error"}.
                                         Control (text): {"type": "prompt", "prompt_seed"
                                         | "prompt"}, {"type": "pause"}, {"type": "resume"}

``--model wan-diffusers`` serves diffusers' Wan transformer (``--config``, random weights,
or ``--weights DIR``) at the sizes of ``--preset`` (default the config's,
`framekv.engine.wan.PRESETS`); a prompt is then [L, text_dim] text embeddings, and a
prompt change re-caches the session's visible frames by clean passes.

One thread runs the GPU loop (`StreamScheduler.run`); every graph is captured before
the socket opens. A client that disconnects frees its slot; SIGTERM drains (uvicorn's
graceful shutdown, then the loop stops and the pool is freed).
"""

import argparse
import asyncio
import base64
import contextlib
import json
import secrets
import signal
import struct
import threading

from .args import nonnegative_int, positive_int

MAX_BODY_BYTES = 1 << 20   # a request body or control message: JSON, at most 1 MiB
BODY_TIMEOUT_S = 10.0      # seconds a client may take to send its body
CHUNK_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: --model wan-diffusers --config names (each rolls out at its preset's sizes by default)
WAN_CONFIGS = ("tiny", "1.3b")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="streaming sessions over HTTP/WebSockets",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="the rollout's preset: the reference "
                   "model's (default tiny), or the sizes diffusers' Wan runs at (default the "
                   "config's: tiny or wan-1.3b)")
    p.add_argument("--model", choices=("reference", "wan-diffusers"), default="reference",
                   help="the reference DiT of --preset (default), or diffusers' Wan "
                        "transformer (needs the wan extra)")
    p.add_argument("--config", choices=WAN_CONFIGS, default="tiny",
                   help="with --model wan-diffusers: the shipped config (random weights "
                        "unless --weights)")
    p.add_argument("--weights", metavar="DIR", default=None,
                   help="with --model wan-diffusers: a local diffusers folder")
    p.add_argument("--max-sessions", type=positive_int, default=8,
                   help="session slots (default 8)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=nonnegative_int, default=8000)
    p.add_argument("--token", default=None, help="bearer token every route but /health needs")
    p.add_argument("--cache-dir", default=None, help="kernels and cuDNN plans kept on disk")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import uvicorn

    from framekv.engine.scheduler import StreamScheduler

    factory = wan_factory(args) if args.model == "wan-diffusers" else None
    sched = StreamScheduler(args.preset or "tiny", max_sessions=args.max_sessions,
                            device=args.device, cache_dir=args.cache_dir, progress=True,
                            runner_factory=factory)
    # uvicorn drains on SIGTERM, then puts back the handler it found and raises the
    # signal again; with this one in place that ends here, and the exit status is 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    uvicorn.run(build_app(sched, token=args.token), host=args.host, port=args.port,
                log_level="info")
    return 0


def wan_factory(args, *, use_graphs: bool = True):
    """The scheduler's runner for ``--model wan-diffusers``: a `WanRollout` of
    ``--config`` (random weights) or ``--weights``, at the sizes of ``--preset``
    (default the config's)."""
    import functools

    from framekv.engine import WanRollout
    from framekv.engine.wan import PRESETS, build_model, load_model, preset_sizes

    sizes = preset_sizes(getattr(args, "preset", None) or PRESETS[args.config])
    model = (load_model(args.weights, device=args.device) if args.weights
             else build_model(args.config, device=args.device))
    return functools.partial(WanRollout, model, cache_dir=args.cache_dir,
                             use_graphs=use_graphs, **sizes)


class _Error(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def parse_prompt(body: dict, shape):
    """The prompt tensor a request names: "prompt_seed" (random tokens of that seed),
    "prompt" (uploaded float32 embeddings), or neither (None: the model's)."""
    import torch

    if "prompt_seed" in body and "prompt" in body:
        raise _Error(422, "give prompt_seed or prompt, not both")
    if "prompt_seed" in body:
        seed = body["prompt_seed"]
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise _Error(422, f"prompt_seed must be an integer in [0, 2**31), got {seed!r}")
        return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    if "prompt" not in body:
        return None
    p = body["prompt"]
    if not isinstance(p, dict) or list(p.get("shape", [])) != list(shape) \
            or not isinstance(p.get("data"), str):
        raise _Error(422, f"prompt must be {{\"shape\": {list(shape)}, \"data\": base64 float32}}")
    try:
        raw = base64.b64decode(p["data"], validate=True)
    except ValueError:
        raise _Error(422, "prompt.data is not base64") from None
    if len(raw) != 4 * shape[0] * shape[1]:
        raise _Error(422, f"prompt.data must hold {shape[0] * shape[1]} float32 values, "
                          f"got {len(raw)} bytes")
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).view(*shape)


def _json_body(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise _Error(413, f"body over {MAX_BODY_BYTES} bytes")
    try:
        body = json.loads(raw or b"{}")
    except RecursionError:
        raise _Error(400, "the body is nested too deeply") from None
    except ValueError as exc:
        raise _Error(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _Error(400, f"the body must be a JSON object, got a {_json_kind(body)}")
    return body


def _json_kind(x) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean",
            type(None): "null"}.get(type(x), type(x).__name__)


async def _read_body(request, timeout: float) -> bytes:
    """The request body, after its Content-Length says it may be read."""
    length = request.headers.get("content-length")
    if length is None:
        raise _Error(411, "a Content-Length is needed: chunked request bodies are not accepted")
    if not length.isdigit() or int(length) > MAX_BODY_BYTES:
        raise _Error(413, f"Content-Length must be in [0, {MAX_BODY_BYTES}] bytes, got {length}")
    try:
        return await asyncio.wait_for(request.body(), timeout)
    except asyncio.TimeoutError:
        raise _Error(408, f"the body did not arrive within {timeout} s") from None


def chunk_frame(chunk) -> bytes:
    """A chunk as one binary WebSocket message (module doc)."""
    lat = chunk.latents.contiguous()
    header = json.dumps({"type": "chunk", "index": chunk.index, "frame0": chunk.frame0,
                         "frames": chunk.frames, "dtype": "float32", "shape": list(lat.shape),
                         "seconds": chunk.seconds, "batch": chunk.batch,
                         "prompt_version": chunk.prompt_version}).encode()
    return struct.pack(">I", len(header)) + header + lat.numpy().tobytes()


def metrics_text(sched) -> str:
    """Prometheus exposition text of the scheduler's counters."""
    import torch

    m = sched.metrics()
    lines = [f"framekv_sessions {m['sessions']}",
             f"framekv_session_slots {m['max_sessions']}",
             f"framekv_steps_total {m['steps']}", f"framekv_failed_steps_total {m['failed_steps']}",
             f"framekv_chunks_total {m['chunks']}",
             f"framekv_graph_replays_total {m['graph_replays']}",
             f"framekv_graph_captures_total {m['graph_captures']}",
             f"framekv_pool_bytes {m['pool_bytes']}"]
    if m["device"].startswith("cuda"):
        lines.append(f"framekv_gpu_allocated_bytes {torch.cuda.memory_allocated()}")
    secs = list(m["step_seconds"])
    lines += [f'framekv_chunk_seconds_bucket{{le="{b}"}} {sum(s <= b for s in secs)}'
              for b in CHUNK_BUCKETS]
    lines += [f'framekv_chunk_seconds_bucket{{le="+Inf"}} {len(secs)}',
              f"framekv_chunk_seconds_sum {sum(secs)}", f"framekv_chunk_seconds_count {len(secs)}"]
    return "\n".join(lines) + "\n"


def build_app(sched, *, token: str | None = None, body_timeout: float = BODY_TIMEOUT_S):
    """The FastAPI app over ``sched``; its lifespan runs the GPU loop thread."""
    from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
    from fastapi.responses import JSONResponse, PlainTextResponse, Response

    stop = threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        loop = threading.Thread(target=sched.run, args=(stop,), name="framekv-gpu", daemon=True)
        loop.start()
        yield
        stop.set()
        loop.join()
        for sid in list(sched.sessions):
            sched.close_session(sid)

    app = FastAPI(title="framekv", lifespan=lifespan)
    prompt_shape = sched.prompt_shape

    def check_token(auth: str | None) -> None:
        if token is not None and not (auth and secrets.compare_digest(auth, f"Bearer {token}")):
            raise _Error(401, "missing or wrong bearer token")

    def session(sid: str):
        s = sched.sessions.get(sid)
        if s is None:
            raise _Error(404, "no such session")
        return s

    @app.exception_handler(_Error)
    async def _err(request, exc: _Error):
        return JSONResponse({"error": exc.message}, exc.status, headers=exc.headers)

    @app.get("/health")
    async def health():
        return {"status": "ok", "sessions": len(sched.sessions), "max_sessions": sched.max_sessions}

    @app.get("/metrics")
    async def metrics(request: Request):
        check_token(request.headers.get("authorization"))
        return PlainTextResponse(metrics_text(sched), media_type="text/plain; version=0.0.4")

    @app.post("/v1/sessions", status_code=201)
    async def create(request: Request):
        check_token(request.headers.get("authorization"))
        body = _json_body(await _read_body(request, body_timeout))
        unknown = set(body) - {"seed", "chunks", "prompt", "prompt_seed"}
        if unknown or "seed" not in body:
            raise _Error(422, f"body needs \"seed\" and takes chunks, prompt, prompt_seed; "
                              f"unknown: {sorted(unknown)}")
        prompt = parse_prompt(body, prompt_shape)
        from framekv.engine.scheduler import SchedulerFull
        try:
            s = await asyncio.to_thread(sched.open_session, seed=body["seed"],
                                        chunks=body.get("chunks"), prompt=prompt)
        except SchedulerFull as exc:
            raise _Error(503, str(exc), {"Retry-After": "5"}) from None
        except ValueError as exc:
            raise _Error(422, str(exc)) from None
        return {"id": s.id}

    @app.delete("/v1/sessions/{sid}")
    async def delete(sid: str, request: Request):
        check_token(request.headers.get("authorization"))
        session(sid)
        await asyncio.to_thread(sched.close_session, sid)
        return Response(status_code=204)

    @app.websocket("/v1/sessions/{sid}/stream")
    async def stream(ws: WebSocket, sid: str):
        try:
            auth = ws.headers.get("authorization") or (
                f"Bearer {ws.query_params['token']}" if "token" in ws.query_params else None)
            check_token(auth)
            session(sid)
        except _Error as exc:
            await ws.close(code=1008, reason=exc.message)
            return
        await ws.accept()
        await _serve_socket(ws, sched, sid, prompt_shape, WebSocketDisconnect)

    return app


async def _serve_socket(ws, sched, sid: str, prompt_shape, disconnect) -> None:
    """Push the session's chunks as they come; apply its control messages; free the
    slot when the client goes."""
    async def send():
        while True:
            chunk = await asyncio.to_thread(sched.next_chunk, sid, 0.25)
            if chunk is not None:
                await ws.send_bytes(chunk_frame(chunk))
                continue
            s = sched.sessions.get(sid)
            if s is None or s.finished:
                await ws.send_text(json.dumps({"type": "end", "state": s.state if s else "closed",
                                               "error": s.error if s else None}))
                return

    async def receive():
        while True:
            text = await ws.receive_text()
            try:
                msg = _json_body(text.encode())
                await _control(sched, sid, msg, prompt_shape)
            except KeyError:  # the session ended meanwhile: the sender says how
                return await asyncio.Event().wait()
            except _Error as exc:
                await ws.send_text(json.dumps({"type": "error", "error": exc.message}))

    tasks = [asyncio.create_task(send()), asyncio.create_task(receive())]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t.exception() is not None and not isinstance(t.exception(), disconnect):
                raise t.exception()
    finally:
        for t in tasks:
            t.cancel()
        if sid in sched.sessions:
            await asyncio.to_thread(sched.close_session, sid)
        with contextlib.suppress(Exception):
            await ws.close()


async def _control(sched, sid: str, msg: dict, prompt_shape) -> None:
    kind = msg.get("type")
    if kind == "pause" or kind == "resume":
        await asyncio.to_thread(sched.pause, sid, kind == "pause")
    elif kind == "prompt":
        prompt = parse_prompt(msg, prompt_shape)
        if prompt is None:
            raise _Error(422, "a prompt message needs prompt_seed or prompt")
        await asyncio.to_thread(sched.set_prompt, sid, prompt)
    else:
        raise _Error(422, f"type must be prompt, pause or resume, got {kind!r}")
