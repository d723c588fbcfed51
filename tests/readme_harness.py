"""README.md as steps to run (tests/tools/test_readme.py, tests/tools/test_quickstart.py): its fenced
```bash and ```python blocks by section, each bash block's commands, why a block or a
command is not run here, and the servers the README starts.

A block is skipped where the paragraph right above it says what it needs in a sentence
starting "Needs" (a CUDA GPU, a model's weights on disk): that sentence is the reason. A
"Needs a CUDA GPU" block runs where torch sees one. `bash scripts/install.sh ...`
commands and the test suite (`bash scripts/test.sh`) are run by tests/tools/test_quickstart.py
in a fresh venv of a clean clone, not in the environment that runs the tests.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the port the README's servers and clients name
README_PORT = 8000
#: why an install or the test suite is not run by the README test
IN_A_FRESH_VENV = ("installs into an environment and runs the test suite: "
                   "tests/tools/test_quickstart.py runs it in a fresh venv of a clean clone")


@dataclasses.dataclass
class Block:
    """One fenced block: its section (the ``## `` heading above it), language, code,
    first line in README.md, and the "Needs ..." sentence above it, if any."""

    section: str
    lang: str
    code: str
    line: int
    needs: str | None

    @property
    def gpu_only(self) -> bool:
        return self.needs is not None and "CUDA GPU" in self.needs


def blocks(text: str | None = None) -> list[Block]:
    """The ```bash and ```python blocks of the README, in order."""
    lines = (README.read_text() if text is None else text).splitlines()
    out, section, i = [], "", 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:].strip()
        m = re.match(r"^```(bash|python)\s*$", lines[i])
        if m:
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            out.append(Block(section, m.group(1), "\n".join(lines[i + 1:end]) + "\n", i + 1,
                             _needs(lines[:i])))
            i = end
        i += 1
    return out


def _needs(above: list[str]) -> str | None:
    """The sentence starting "Needs" in the paragraph right above a block, or None."""
    paragraph = []
    for line in reversed(above):
        if not line.strip():
            if paragraph:
                break
            continue
        paragraph.insert(0, line)
    m = re.search(r"(?:^|[.;:] )(Needs [^.:]+)[.:]", " ".join(paragraph))
    return m.group(1) if m else None


def commands(block: Block) -> list[str]:
    """A bash block's commands: continued lines joined, comments dropped."""
    out, pending = [], ""
    for line in block.code.splitlines():
        line = pending + strip_comment(line)
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        if line.strip():
            out.append(" ".join(line.split()))
    return out


def strip_comment(line: str) -> str:
    """``line`` without its ``# comment`` (a # outside quotes, at a word's start)."""
    quote = None
    for k, c in enumerate(line):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip()
    return line.rstrip()


def is_install(command: str) -> bool:
    """Whether a command installs or runs the test suite (`IN_A_FRESH_VENV`)."""
    return bool(re.search(r"\bbash scripts/(install|test)\.sh\b", command))


def is_server(command: str) -> bool:
    return command.startswith("framekv serve")


def env() -> dict:
    """The environment of a README command: this interpreter's scripts first on PATH
    (framekv, torchrun), no token of the caller's."""
    e = {k: v for k, v in os.environ.items() if k != "FRAMEKV_TOKEN"}
    e["PATH"] = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    return e


def run(command: str, cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    """One command through bash in ``cwd``; its exit status must be 0."""
    out = subprocess.run(["bash", "-c", command], cwd=cwd, env=env(), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, f"{command}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


def run_python(code: str, cwd, port: int | None, timeout: float = 600):
    """A python block as a file in ``cwd`` (its URLs of the README's port sent to
    ``port``); its exit status must be 0."""
    if port is not None:
        code = code.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}")
    path = pathlib.Path(cwd) / f"block{len(list(pathlib.Path(cwd).glob('block*.py')))}.py"
    path.write_text(code)
    out = subprocess.run([sys.executable, str(path)], cwd=cwd, env=env(), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, f"{path.name}:\n{code}\n{out.stdout}\n{out.stderr}"
    return out


class Server:
    """A README ``framekv serve`` command in the background, on a free port (``--port``
    added: the README's 8000 may be taken on a shared machine), its output in a log;
    `stop` sends SIGTERM and returns its exit status."""

    def __init__(self, command: str, cwd, port: int):
        self.command, self.port, self.url = command, port, f"http://127.0.0.1:{port}"
        self.log = pathlib.Path(cwd) / f"server-{port}.log"
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(["bash", "-c", f"exec {command} --port {port}"],
                                         cwd=cwd, env=env(), stdout=f,
                                         stderr=subprocess.STDOUT)

    def wait(self, up, timeout: float = 600) -> None:
        """Until ``up(url)`` is true; AssertionError with the log if the server ends
        first or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"{self.command} ended:\n{self.output()}"
            try:
                if up(self.url):
                    return
            except AssertionError:
                raise
            except Exception:           # not listening yet (httpx's errors, OSError)
                pass
            assert time.monotonic() < deadline, f"{self.command} did not serve:\n{self.output()}"
            time.sleep(0.25)

    def output(self) -> str:
        return self.log.read_text()

    def stop(self, timeout: float = 120) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
