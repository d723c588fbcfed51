"""What ``framekv serve`` checks before it builds anything, besides its options' values:
that the packages of its extra import (`check_extra`) and that its address can be bound
(`check_address`). Either failing is one line and exit status 2 from the command, before
a model is built or warmed up, where it would otherwise fail only once the model is
ready. The cluster (``--replicas``) runs the same checks for its ingress's address.
"""
from __future__ import annotations

import errno
import importlib
import socket

#: the modules a server imports, by the package that brings each (the ``serve`` extra)
SERVE_MODULES = {"fastapi": "fastapi", "uvicorn": "uvicorn", "websockets": "websockets",
                 "prometheus_client": "prometheus-client", "PIL": "pillow"}


def check_extra(extra: str = "serve", modules: dict[str, str] = SERVE_MODULES) -> None:
    """ValueError naming ``extra`` and the packages missing when any of ``modules``
    (module -> package) does not import."""
    missing = []
    for module, package in modules.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(package)
    if missing:
        raise ValueError(f"the server needs the {extra} extra: pip install "
                         f"'framekv[{extra}]' (missing: {', '.join(missing)})")


def check_address(host: str, port: int) -> None:
    """ValueError naming ``--host``/``--port`` when this process cannot listen on
    ``host``:``port`` (in use, a host that is no local address, a port it may not
    take). Port 0 (any free port) always can. Bound as the server binds (address reuse
    on, so a port whose last connections linger in TIME_WAIT passes) and let go."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r}: not an address of this machine "
                         f"({exc.strerror or exc})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            why = ("in use by another process: stop it or give another --port"
                   if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc))
            raise ValueError(f"--port {port}: cannot listen on {host}:{port}, {why}") from None
