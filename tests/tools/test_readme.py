"""README.md under test: every ```bash command and ```python block runs on the CPU as
written, section by section (`readme_harness`), so a README that stops working fails.

- A server the README starts (``framekv serve ...``) runs in the background on a free
  port while the rest of its section runs against it (the README's 127.0.0.1:8000 sent
  there), is probed (/health, the page at /), then stopped with SIGTERM: exit status 0,
  no traceback in its output. The cluster (``--replicas``) is probed further: every
  replica up, a session streamed over a socket, its GET naming its replica, sockets the
  client closed (cleanly and not) logging no error, its temporary state folder gone
  after exit.
- A block whose paragraph says what it needs ("Needs a CUDA GPU", "Needs the weights
  ...") is skipped with that sentence as the reason (a GPU block runs where a GPU is);
  installs and the test suite are tests/tools/test_quickstart.py's, skipped here saying so.
- The presets the README lists are the shipped ones.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import re
import socket

import pytest

import readme_harness as rh

BLOCKS = rh.blocks()
#: (block, command or None, why it is not run here) in README order
SKIPS = [(b, None, b.needs) for b in BLOCKS if b.needs] + [
    (b, c, rh.IN_A_FRESH_VENV) for b in BLOCKS if b.lang == "bash" and not b.needs
    for c in rh.commands(b) if rh.is_install(c)]
#: the sections with something to run here, in README order
SECTIONS = list(dict.fromkeys(
    b.section for b in BLOCKS if not b.needs
    and (b.lang == "python" or any(not rh.is_install(c) for c in rh.commands(b)))))


def test_the_readme_has_its_blocks():
    """The parse finds what the README holds: the check below can fail."""
    assert len(BLOCKS) >= 10 and {b.lang for b in BLOCKS} == {"bash", "python"}
    assert {"Quick start", "Generate a video", "Cluster"} <= {b.section for b in BLOCKS}
    assert [s for s in SECTIONS if s == "Quick start"] == []       # all installs
    assert any("framekv serve --replicas" in c for b in BLOCKS if b.lang == "bash"
               for c in rh.commands(b))


@pytest.mark.parametrize("block, command, reason", SKIPS,
                         ids=[f"line{b.line}-{i}" for i, (b, _, _) in enumerate(SKIPS)])
def test_a_block_not_run_here_says_why(block, command, reason, tmp_path):
    if block.gpu_only and command is None:
        import torch

        if torch.cuda.is_available():            # where it can run, it runs as written
            return run_blocks([block], tmp_path)
    pytest.skip(f"README.md line {block.line}: {reason}")


@pytest.mark.parametrize("section", SECTIONS)
def test_the_readme_runs_as_written(section, tmp_path):
    run_blocks([b for b in BLOCKS if b.section == section and not b.needs], tmp_path)


def run_blocks(blocks: list[rh.Block], cwd) -> None:
    """The blocks in order in ``cwd``; a server one starts is up until the last ends."""
    with contextlib.ExitStack() as stack:
        server = None
        for b in blocks:
            if b.lang == "python":
                rh.run_python(b.code, cwd, None if server is None else server.port)
                continue
            for command in rh.commands(b):
                if rh.is_install(command):
                    continue                           # test_a_block_not_run_here_says_why
                if rh.is_server(command):
                    server = stack.enter_context(serving(command, cwd))
                    continue
                rh.run(command, cwd)
                for out in re.findall(r"--out (\S+)", command):
                    assert (pathlib.Path(cwd) / out).stat().st_size > 0, command


@contextlib.contextmanager
def serving(command: str, cwd):
    """A README server, probed; stopped at the end of the block: exit status 0."""
    from framekv.bench.serve_load import free_port

    server = rh.Server(command, cwd, free_port())
    try:
        probe(server)
        yield server
    finally:
        status = server.stop()
    out = server.output()
    assert status == 0 and "Traceback" not in out and "ERROR" not in out, out
    if "--replicas" in command:           # its temporary state folder is gone with it
        m = re.search(r"\(state in (\S+), a temporary folder removed at exit\)", out)
        assert m and not pathlib.Path(m.group(1)).exists(), out


def probe(server: rh.Server) -> None:
    """Up and serving: /health (a cluster: every replica too), the page at /."""
    import httpx

    m = re.search(r"--replicas (\d+)", server.command)
    if m is None:
        server.wait(lambda url: httpx.get(f"{url}/health", timeout=5).status_code == 200)
    else:
        server.wait(lambda url: len(replicas(url)) == int(m.group(1)))
    page = httpx.get(f"{server.url}/", timeout=30)
    assert page.status_code == 200 and '<canvas id="video"' in page.text
    if m is not None:
        stream_and_drop(server.url)


def replicas(url: str) -> list:
    import httpx

    r = httpx.get(f"{url}/v1/cluster/replicas", timeout=5)
    return r.json() if r.status_code == 200 else []


def stream_and_drop(url: str) -> None:
    """A session on the cluster: its GET names its replica; a chunk read on a socket
    closed cleanly, then on one dropped, as a browser that stops a stream does."""
    import httpx
    from websockets.sync.client import connect

    from framekv.specs import wire

    ids = {r["id"] for r in replicas(url)}
    sid = httpx.post(f"{url}/v1/sessions", json={"seed": 1}, timeout=60).json()["id"]
    assert httpx.get(f"{url}/v1/sessions/{sid}", timeout=30).json()["replica"] in ids
    ws_url = url.replace("http://", "ws://") + f"/v1/sessions/{sid}/stream"
    for drop in (False, True):
        with connect(ws_url, max_size=None, open_timeout=60) as ws:
            header, _ = wire.decode(ws.recv(timeout=300))
            ws.send(json.dumps({"type": "ack", "index": header["index"]}))
            if drop:
                ws.socket.shutdown(socket.SHUT_RDWR)
    assert httpx.delete(f"{url}/v1/sessions/{sid}", timeout=60).status_code == 204


def test_the_presets_the_readme_lists_are_the_shipped_ones():
    from framekv.specs import list_presets

    line = next(ln for ln in rh.README.read_text().splitlines() if "TOML presets (" in ln)
    listed = re.findall(r"`([\w.-]+)`", line.split("TOML presets (", 1)[1].split(")")[0])
    assert sorted(listed) == list_presets()
