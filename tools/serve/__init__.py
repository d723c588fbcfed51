"""``framekv serve``: streaming sessions over HTTP and WebSockets (the command and its
contract: ``command.py``).

    command.py    the command line (options checked before anything is built), the
                  server's start and drain
    app.py        the FastAPI app: its lifespan (the GPU loop, the idle reaper), /health,
                  /metrics, /v1/info, the docs
    errors.py     the error shape: every error {"error"}, 404, 405 and 500 included
    routes.py     the session routes and the socket's gate
    reader.py     one reader of a session's chunks, and the control messages back,
                  whatever carries them
    websocket.py  one session's socket: its framing, acknowledgements and control in
    poll.py       the long poll: chunks out by GET, control messages and frames in by POST
    frames_in.py  a video session's frames in: the frames_in message decoded and fitted
    models.py     the request and response bodies (pydantic)
    auth.py       bearer tokens, and which pages' origins may open a socket
    wire.py       request bodies, prompts, uploads, chunk messages
    net.py        uvicorn around it: header deadlines, the draining shutdown, redacted logs
    metrics.py    /metrics (prometheus_client)
    page/         the page at / and at /docs
"""
from ..args import kv_dtype_of
from ..model_flags import wan_factory
from .command import (MAX_BODY_BYTES, add_parser, build_app, chunk_frame, frames_message,
                      model_name, page_html, parse_prompt, run, token_of)

__all__ = ["MAX_BODY_BYTES", "add_parser", "build_app", "chunk_frame", "frames_message",
           "kv_dtype_of", "model_name", "page_html", "parse_prompt", "run", "token_of",
           "wan_factory"]
