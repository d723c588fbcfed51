"""The server's tokens on the command line: where a bearer token comes from
(`token_of`: the flag, with a warning, else the environment) and the warning for a
server reachable beyond loopback with none (`warn_unguarded`). No web imports: the
command checks its options before the serve extra is imported.
"""
from __future__ import annotations

import argparse
import os
import sys

from ..args import bearer_token


def token_of(args, *, option: str = "token", env: str = "FRAMEKV_TOKEN") -> str | None:
    """The bearer token: ``--token`` (with a warning on stderr: every user of the machine
    sees a process's arguments), else ``FRAMEKV_TOKEN``, else None. ValueError for a
    set but malformed FRAMEKV_TOKEN (an empty one included). ``option``, ``env``:
    another token's (the cluster's ``--admin-token``, ``FRAMEKV_ADMIN_TOKEN``)."""
    given = getattr(args, option, None)
    if given is not None:
        print(f"framekv serve: warning: --{option.replace('_', '-')} is visible to every "
              f"user of this machine (ps, /proc); set {env} instead", file=sys.stderr)
        return given
    token = os.environ.get(env)
    if token is None:
        return None
    try:
        return bearer_token(token)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"{env} {exc}") from None


def warn_unguarded(host: str, token: str | None) -> None:
    """One warning line on stderr for a server bound to an address other than loopback
    with no token: whoever reaches it may open, read and end any session."""
    import ipaddress

    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:                       # a host name: it may resolve to anything
        loopback = host.lower() == "localhost"
    if token is None and not loopback:
        print(f"framekv serve: warning: --host {host} is not a loopback address and no token "
              "is set: whoever reaches it can open, read and end any session (set "
              "FRAMEKV_TOKEN)", file=sys.stderr)
