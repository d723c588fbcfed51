"""A real `framekv serve` in a thread and raw clients, for the server's hardening suite
(tests/serve/test_serve_hardening.py): `serving` runs a `DrainingServer` over a scheduler
(`served_http`: with an HTTP client on it);
`read_stream`, `ack`, `index_of` read a session's socket; `trickle` sends a request a byte at
a time; `raw_request` sends bytes no HTTP client would."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

from framekv.specs import wire
from framekv.tools.serve import build_app
from framekv.tools.serve.net import DrainingServer, server_config


@contextlib.contextmanager
def serving(sched, head_timeout: float = 1.0, **kw):
    """A `DrainingServer` over ``sched`` in a thread: (server, port); then stopped, the
    scheduler closed."""
    srv = DrainingServer(server_config(build_app(sched, **kw), port=0, log_level="warning",
                                       head_timeout=head_timeout), drain_timeout=5.0)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not srv.started:
            assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.02)
        yield srv, srv.servers[0].sockets[0].getsockname()[1]
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "the server did not drain and exit"
        sched.close()


@contextlib.contextmanager
def served_http(sched, token: str, head_timeout: float = 1.0, **kw):
    """`serving` with an httpx client on it that sends ``token``: (http, port, sched)."""
    import httpx

    with serving(sched, head_timeout, token=token, **kw) as (_, port):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30,
                          headers={"Authorization": f"Bearer {token}"}) as http:
            yield http, port, sched


def create(http, **body) -> str:
    """Open a session through ``http`` (an httpx client on the server): its id."""
    r = http.post("/v1/sessions", json=body)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def read_stream(ws, limit=30.0, first=None):
    """(chunk indices, text messages) of a socket until its end message, each chunk
    acknowledged as a client does."""
    indices, texts = [] if first is None else [first], []
    deadline = time.monotonic() + limit
    while True:
        msg = ws.recv(timeout=max(0.1, deadline - time.monotonic()))
        if isinstance(msg, str):
            texts.append(json.loads(msg))
            if texts[-1]["type"] == "end":
                return indices, texts
            continue
        indices.append(ack(ws, msg))


def ack(ws, msg: bytes) -> int:
    """Acknowledge the chunk of binary message ``msg`` on ``ws``; its index. A socket
    the server closed already (a drain: its last chunks and end are still to be read)
    takes no ack, as with a real client."""
    from websockets.exceptions import ConnectionClosed

    index = index_of(msg)
    with contextlib.suppress(ConnectionClosed):
        ws.send(json.dumps({"type": "ack", "index": index}))
    return index


def index_of(msg: bytes) -> int:
    """The index in a binary chunk message's header."""
    return wire.decode(msg)[0]["index"]


def no_sessions(sched, limit=10.0):
    deadline = time.monotonic() + limit
    while sched.sessions:
        assert time.monotonic() < deadline, list(sched.sessions)
        time.sleep(0.02)


def raw_request(port, head: bytes) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1]


def trickle(sock, data: bytes, every: float = 0.2) -> float | None:
    """Seconds until the server closed ``sock`` while it got ``data`` a byte per
    ``every`` s; None if the whole of it went through."""
    t0 = time.monotonic()
    sock.settimeout(every)
    for b in data:
        try:
            sock.sendall(bytes([b]))
            if sock.recv(1024) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0
    return None
