"""Named tensors and a JSON header in one file, in the safetensors layout.

    [8 bytes: header length n, little-endian u64][n bytes: JSON header][tensor bytes]
    header = {name: {"dtype": "BF16", "shape": [...], "data_offsets": [a, b]}, ...,
              "__metadata__": {"framekv": "<JSON of the caller's header>",
                               "crc32": "<CRC-32 of every tensor's bytes, in offset order>"}}

Any safetensors reader opens these files (`safetensors.safe_open`); this module writes
and reads them without that dependency, streaming each tensor's bytes (a K/V snapshot
is gigabytes: no second copy in memory). A file is written whole or not at all
(`framekv.engine.files.written_whole`): a failure leaves the old file (or none) as it
was. Reading checks everything a truncated or corrupt file breaks and raises `CorruptFile`
naming the first fault, before any tensor is allocated: a path that is not a regular
file (a FIFO, a device, a folder: never opened for reading), the header's length
(at most `MAX_HEADER` bytes), a header that is not JSON objects as written (nesting at
most `MAX_DEPTH` deep), offsets that tile the data exactly and end at the file's size,
dtypes, shapes, the bytes declared against the caller's bound (``max_bytes``: a sparse
file may declare terabytes it does not hold), then, once read, the CRC.
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
import zlib

import torch

from ..files import written_whole

__all__ = ["CorruptFile", "MAX_DEPTH", "MAX_HEADER", "read_tensors", "write_tensors"]

_CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
          torch.int8: "I8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}
_DTYPES = {v: k for k, v in _CODES.items()}
#: a header's bytes at most: names and fields (a stream's are kilobytes), never data
MAX_HEADER = 4 << 20
#: JSON nesting of a header at most (a stream's is five levels deep)
MAX_DEPTH = 32
_MAX_DIMS = 16
_BLOCK = 64 << 20          # bytes written, read and checksummed per call


class CorruptFile(ValueError):
    """A tensor file that is truncated, corrupt or not one at all."""


def _bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    flat = t.detach().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def write_tensors(path, tensors: dict[str, torch.Tensor], header: dict) -> int:
    """Write ``tensors`` (host or device; copied to host contiguous first) and the
    JSON-able ``header`` to ``path`` atomically (module doc); returns the file's bytes."""
    host, entries, offset = {}, {}, 0
    for name, t in tensors.items():
        if t.dtype not in _CODES:
            raise ValueError(f"tensors[{name!r}] has dtype {t.dtype}, not one of "
                             f"{sorted(str(d) for d in _CODES)}")
        t = t.detach().to("cpu").contiguous()
        host[name] = t
        n = t.numel() * t.element_size()
        entries[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + n]}
        offset += n
    crc = 0
    for t in host.values():
        crc = _crc(_bytes(t), crc)
    entries["__metadata__"] = {"framekv": json.dumps(header), "crc32": f"{crc:08x}"}
    raw = json.dumps(entries).encode()
    raw += b" " * (-len(raw) % 8)          # tensor data 8-byte aligned, as safetensors pads
    with written_whole(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for t in host.values():
            view = _bytes(t)
            for i in range(0, len(view), _BLOCK):
                f.write(view[i:i + _BLOCK])
    return 8 + len(raw) + offset


def _crc(view: memoryview, crc: int) -> int:
    for i in range(0, len(view), _BLOCK):
        crc = zlib.crc32(view[i:i + _BLOCK], crc)
    return crc


def read_tensors(path, *, pin_memory: bool = False,
                 max_bytes: int | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, header) of a file `write_tensors` wrote (host tensors, pinned if asked).
    ``max_bytes``: the most tensor bytes the file may declare (None: no bound).
    `CorruptFile` for a file that is truncated, corrupt, declares more, or is not a
    regular file (module doc); FileNotFoundError if there is none."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.islink(path):
            raise
        raise CorruptFile(f"{path}: a symbolic link to nothing") from None
    if not stat.S_ISREG(mode):
        raise CorruptFile(f"{path}: {_kind(mode)}, not a regular file: not opened")
    # O_NONBLOCK: a regular file swapped for a FIFO since the stat does not block the open
    with os.fdopen(os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise CorruptFile(f"{path}: {_kind(st.st_mode)}, not a regular file")
        size = st.st_size
        head = f.read(8)
        if len(head) != 8:
            raise CorruptFile(f"{path}: {size} bytes, too short for a tensor file")
        (n,) = struct.unpack("<Q", head)
        if not 0 < n <= min(MAX_HEADER, size - 8):
            raise CorruptFile(f"{path}: header length {n} does not fit the file's {size} "
                              f"bytes (or the {MAX_HEADER} a header may take)")
        entries, header, want_crc = _parse_header(path, f.read(n))
        specs = _check_entries(path, entries, size - 8 - n)
        declared = sum(length for _, _, length in specs.values())
        if max_bytes is not None and declared > max_bytes:
            raise CorruptFile(f"{path}: declares {declared} bytes of tensors, more than the "
                              f"{max_bytes} bytes a file may hold here: not read")
        tensors, crc = {}, 0
        for name, (dtype, shape, length) in specs.items():
            t = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
            view = _bytes(t)
            got = f.readinto(view) if length else 0
            if got != length:
                raise CorruptFile(f"{path}: truncated in tensor {name!r} ({got} of {length} bytes)")
            crc = _crc(view, crc)
            tensors[name] = t
    if f"{crc:08x}" != want_crc:
        raise CorruptFile(f"{path}: CRC-32 {crc:08x} of the tensor bytes, the header says "
                          f"{want_crc[:16]!r}: the file is corrupt")
    return tensors, header


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "a special file"


def _json_of(path, raw, what: str):
    """``raw`` parsed as a JSON object nested at most `MAX_DEPTH` deep; else CorruptFile."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise CorruptFile(f"{path}: {what} is nested too deeply to be one of ours") from None
    except ValueError as exc:
        raise CorruptFile(f"{path}: {what} is not JSON ({str(exc)[:100]})") from None
    if not isinstance(value, dict):
        kind = {list: "list", str: "string", type(None): "null", bool: "boolean"}.get(
            type(value), "number")
        raise CorruptFile(f"{path}: {what} is a JSON {kind}, not an object")
    if _depth(value) > MAX_DEPTH:
        raise CorruptFile(f"{path}: {what} is nested over {MAX_DEPTH} levels deep")
    return value


def _depth(value) -> int:
    """How deep JSON ``value`` nests (no recursion: any depth is measured)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


def _parse_header(path, raw: bytes) -> tuple[dict, dict, str]:
    """(tensor entries, the caller's header, the CRC's hex) of a file's header."""
    entries = _json_of(path, raw, "the header")
    meta = entries.pop("__metadata__", None)
    if not (isinstance(meta, dict) and isinstance(meta.get("framekv"), str)
            and isinstance(meta.get("crc32"), str)):
        raise CorruptFile(f"{path}: the header has no framekv metadata (__metadata__ with "
                          "the strings framekv and crc32): not a framekv tensor file")
    return entries, _json_of(path, meta["framekv"], "the framekv metadata"), meta["crc32"]


def _check_entries(path, entries: dict, data_bytes: int) -> dict:
    """name -> (dtype, shape, bytes), in file order, checked to tile the data exactly."""
    specs, at = {}, 0
    order = sorted(entries.items(), key=lambda kv: _offsets(path, kv)[0])
    for name, e in order:
        a, b = _offsets(path, (name, e))
        code, shape = e.get("dtype"), e.get("shape")
        dtype = _DTYPES.get(code) if isinstance(code, str) else None
        if dtype is None or not isinstance(shape, list) or len(shape) > _MAX_DIMS or not all(
                type(s) is int and s >= 0 for s in shape):
            raise CorruptFile(f"{path}: tensor {name[:64]!r} has a bad dtype or shape: "
                              f"{str(e)[:200]}")
        # Python ints: a declared shape cannot wrap its byte count round to a small one
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if a != at or b - a != n:
            raise CorruptFile(f"{path}: tensor {name[:64]!r} at bytes [{a}, {b}) does not follow "
                              f"byte {at} with its {n} bytes")
        specs[name], at = (dtype, shape, n), b
    if at != data_bytes:
        raise CorruptFile(f"{path}: the tensors hold {at} bytes, the file {data_bytes} "
                          f"after its header (truncated or extended)")
    return specs


def _offsets(path, item) -> tuple[int, int]:
    name, e = item
    off = e.get("data_offsets") if isinstance(e, dict) else None
    if not (isinstance(off, list) and len(off) == 2 and all(type(x) is int for x in off)):
        raise CorruptFile(f"{path}: tensor {name[:64]!r} has no data_offsets")
    return off[0], off[1]
