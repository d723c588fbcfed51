"""Argument types shared by the commands: each refuses a bad value at parse time, with
the expected and the actual value, before any work runs."""
from __future__ import annotations

import argparse
import math
import os
import tempfile
import urllib.parse


def positive_int(text: str) -> int:
    """An integer >= 1."""
    return _int_at_least(text, 1)


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
    return value


def int_in(low: int, high: int):
    """An argument type: an integer in [low, high] (a port, a frame rate, a bound that a
    larger value would only fail later, after the model is built)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got "
                                             f"{text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}], got "
                                             f"{value}")
        return value
    return parse


def prompt_text(text: str) -> str:
    """A text prompt: at least one character other than white space
    (`framekv.specs.checks.check_text`)."""
    from framekv.specs.checks import check_text

    try:
        return check_text("prompt", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("prompt ")) from None


def _number(text: str, ok, unparsed: str, refused: str) -> float:
    """``text`` as a float where ``ok(value)``; else "must be UNPARSED, got 'TEXT'" for
    text that is no number, "must be REFUSED, got VALUE" for one out of range."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {unparsed}, got {text!r}") from None
    if not ok(value):                               # NaN fails every range
        raise argparse.ArgumentTypeError(f"must be {refused}, got {text}")
    return value


def tolerance(text: str) -> float:
    """A finite number >= 0."""
    return _number(text, lambda v: math.isfinite(v) and v >= 0, "a number >= 0",
                   "a finite number >= 0")


def positive_number(text: str) -> float:
    """A finite number > 0."""
    return _number(text, lambda v: 0 < v < math.inf, "a number > 0", "a finite number > 0")


def strength(text: str) -> float:
    """A number in (0, 1] (a video-to-video strength)."""
    return _number(text, lambda v: 0 < v <= 1, "a number in (0, 1]", "a number in (0, 1]")


def seconds(text: str) -> float:
    """A finite number of seconds > 0."""
    return _number(text, lambda v: math.isfinite(v) and v > 0, "a number of seconds > 0",
                   "a finite number of seconds > 0")


def bearer_token(text: str) -> str:
    """A bearer token: one or more printable ASCII characters, no space (an HTTP
    header carries them unchanged; anything else could never match a request's)."""
    bad = sum(not "!" <= c <= "~" for c in text)     # the token itself is never echoed
    if not text or bad:
        raise argparse.ArgumentTypeError(f"must be 1 or more printable ASCII characters "
                                         f"without spaces, got {len(text)} characters of "
                                         f"which {bad} are not")
    return text


def writable_file(text: str) -> str:
    """A file path this process can write: its folder exists and is writable, it is not
    a folder, and an existing file is writable. Checked before the run, so a long run's
    report is never lost to a bad path at the end."""
    path = os.path.abspath(text)
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"must be a file path, got the folder {text!r}")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    refusal = None if os.path.exists(path) else creation_refused(folder)
    if refusal is not None:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {refusal}")
    return text


def creation_refused(folder: str) -> str | None:
    """Why no file can be made in ``folder``, or None when one can. access(2) answers
    yes for root everywhere and for folders of filesystems that take no new files
    (sysfs, procfs), so a file is made there and removed."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".framekv-probe-", dir=folder)
    except OSError as exc:
        return f"folder {folder!r} takes no new files ({exc.strerror or exc})"
    os.close(fd)
    os.unlink(probe)
    return None


#: a browser origin: http(s), a host, a port perhaps, nothing after
_ORIGIN_FORM = "scheme://host[:port] with scheme http or https (e.g. https://app.example.com)"


def origins(text: str) -> tuple[str, ...]:
    """``--allowed-origins``: comma-separated browser origins, each
    ``http(s)://host[:port]`` (lower-cased, a trailing slash dropped), or ``*`` for any."""
    found = []
    for item in text.split(","):
        origin = item.strip().lower().removesuffix("/")
        if origin != "*" and not _is_origin(origin):
            raise argparse.ArgumentTypeError(f"must be comma-separated origins, each "
                                             f"{_ORIGIN_FORM} or *, got {item.strip()!r}")
        found.append(origin)
    return tuple(dict.fromkeys(found))


def _is_origin(text: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(text)
        _ = parts.port                       # a port out of range raises ValueError
    except ValueError:
        return False
    return (parts.scheme in ("http", "https") and bool(parts.hostname) and "@" not in text
            and text == f"{parts.scheme}://{parts.netloc}")


#: ``--kv-dtype`` values: "bf16" the model's own dtype (an unquantized pool, as without
#: the option), "fp8" a float8 e4m3 pool (`framekv.engine.rollout.resolve_kv_dtype`).
KV_DTYPES = ("bf16", "fp8")


def add_kv_dtype_argument(p: argparse.ArgumentParser, choices: tuple[str, ...] = KV_DTYPES,
                          extra: str = "") -> None:
    """``--kv-dtype {bf16,fp8}`` (default bf16) into ``args.kv_dtype``; ``extra`` adds to
    the help what further ``choices`` mean."""
    p.add_argument("--kv-dtype", choices=choices, default="bf16",
                   help="the K/V cache's pool: bf16 (the model's dtype, default) or fp8 "
                        "(float8 e4m3, per-head scales; half the bytes)" + extra)


def kv_dtype_of(args) -> str | None:
    """The ``kv_dtype`` of the rollout ``--kv-dtype`` names: None (the model's dtype)
    for bf16, "fp8" for fp8."""
    value = getattr(args, "kv_dtype", "bf16")
    return None if value == "bf16" else value


def add_fp8_gemm_argument(p: argparse.ArgumentParser) -> None:
    """``--fp8-gemm`` into ``args.fp8_gemm`` (a switch of its own, beside ``--kv-dtype``:
    the two roundings are separate choices, measured apart)."""
    p.add_argument("--fp8-gemm", action="store_true",
                   help="run the transformer blocks' linear layers as fp8 GEMMs (float8 "
                        "e4m3, a scale per token and per output channel; "
                        "framekv.engine.fp8_linear); default: the model's dtype")


def gemm_dtype_of(args) -> str | None:
    """The ``gemm_dtype`` of the rollout ``--fp8-gemm`` asks for: "fp8", else None."""
    return "fp8" if getattr(args, "fp8_gemm", False) else None
