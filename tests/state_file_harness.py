"""Session files taken apart and put together again, and one of each bad file, for the
state-folder tests (tests/engine/serving/test_state_files.py, tests/serve/test_state_dir_start.py).

`split` parses a file `framekv.engine.cache.tensorfile` wrote into its tensor entries,
its framekv header and its data bytes; `pack` writes any header (an object, or raw
bytes) and data back in the same layout; `with_header` rewrites a file's framekv
header; `bad_files` puts every kind of file a folder must survive beside the good ones.
"""
from __future__ import annotations

import json
import os
import struct

#: a declared tensor this large is never allocated (a sparse file holds it on no disk)
HUGE_BYTES = 30 << 30


def split(raw: bytes) -> tuple[dict, dict, bytes]:
    """(tensor entries with ``__metadata__``, the framekv header, data) of a file."""
    (n,) = struct.unpack("<Q", raw[:8])
    entries = json.loads(raw[8:8 + n])
    return entries, json.loads(entries["__metadata__"]["framekv"]), raw[8 + n:]


def pack(header, data: bytes = b"") -> bytes:
    """A file of ``header`` (a JSON-able value, or raw bytes as they are) and ``data``."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def with_header(raw: bytes, edit) -> bytes:
    """``raw`` with its framekv header passed through ``edit(header)`` (in place)."""
    entries, header, data = split(raw)
    edit(header)
    entries["__metadata__"]["framekv"] = json.dumps(header)
    return pack(entries, data)


def sparse_huge(path, nbytes: int = HUGE_BYTES) -> None:
    """A file whose valid header declares one U8 tensor of ``nbytes``, its size matching
    (sparse: no block of it written)."""
    head = pack({"t": {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]},
                 "__metadata__": {"framekv": "{}", "crc32": "00000000"}})
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + nbytes)


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def bad_files(folder, good: bytes) -> dict[str, str]:
    """One of each bad ``*.session`` file in ``folder`` (``good``: a good file's bytes,
    mutated); name -> what is wrong with it. Every one must be renamed ``.corrupt``."""
    files = {
        "string.session": pack(b'"x"'), "number.session": pack(b"5"),
        "null.session": pack(b"null"), "list.session": pack(b"[1]"),
        "meta-list.session": pack({"__metadata__": {"framekv": "[1,2]", "crc32": "0"}}),
        "deep.session": pack(deep(200_000)),
        "meta-deep.session": pack({"__metadata__": {"framekv": deep(200_000).decode(),
                                                    "crc32": "0"}}),
        "acked.session": with_header(good, lambda h: h["extra"]["session"].update(acked=10**30)),
        "input.session": with_header(good, lambda h: h["extra"]["queue"][0].update(
            input=[-1, 5])),
        "short.session": b"\x01\x02", "text.session": b"not a session file" * 8,
    }
    for name, raw in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(raw)
    sparse_huge(os.path.join(folder, "huge.session"))
    os.mkfifo(os.path.join(folder, "f.session"))
    os.mkdir(os.path.join(folder, "dir.session"))
    os.symlink("/dev/zero", os.path.join(folder, "zero.session"))
    os.symlink(os.path.join(folder, "nowhere"), os.path.join(folder, "dangling.session"))
    return {**{n: n.split(".")[0] for n in files}, "huge.session": "huge",
            "f.session": "fifo", "dir.session": "folder", "zero.session": "device",
            "dangling.session": "link to nothing"}
