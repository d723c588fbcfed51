"""Named tensors and a JSON header in one file, in the safetensors layout.

    [8 bytes: header length n, little-endian u64][n bytes: JSON header][tensor bytes]
    header = {name: {"dtype": "BF16", "shape": [...], "data_offsets": [a, b]}, ...,
              "__metadata__": {"framekv": "<JSON of the caller's header>",
                               "crc32": "<CRC-32 of every tensor's bytes, in offset order>"}}

Any safetensors reader opens these files (`safetensors.safe_open`); this module writes
and reads them without that dependency, streaming each tensor's bytes (a K/V snapshot
is gigabytes: no second copy in memory). Writing goes to ``PATH.tmp`` and is renamed
over ``PATH`` once flushed and synced, so a failure leaves the old file (or none) as it
was. Reading checks everything a truncated or corrupt file breaks (header length,
offsets that tile the data exactly, file size, dtypes, shapes, the CRC) and raises
`CorruptFile` naming the first fault.
"""
from __future__ import annotations

import json
import math
import os
import struct
import zlib

import torch

__all__ = ["CorruptFile", "read_tensors", "write_tensors"]

_CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
          torch.int8: "I8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3"}
_DTYPES = {v: k for k, v in _CODES.items()}
_MAX_HEADER = 64 << 20
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
    tmp = f"{os.fspath(path)}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t in host.values():
                view = _bytes(t)
                for i in range(0, len(view), _BLOCK):
                    f.write(view[i:i + _BLOCK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return 8 + len(raw) + offset


def _crc(view: memoryview, crc: int) -> int:
    for i in range(0, len(view), _BLOCK):
        crc = zlib.crc32(view[i:i + _BLOCK], crc)
    return crc


def read_tensors(path, *, pin_memory: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors, header) of a file `write_tensors` wrote (host tensors, pinned if asked).
    `CorruptFile` for a truncated or corrupt file; FileNotFoundError if there is none."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise CorruptFile(f"{path}: {size} bytes, too short for a tensor file")
        (n,) = struct.unpack("<Q", head)
        if not 0 < n <= min(_MAX_HEADER, size - 8):
            raise CorruptFile(f"{path}: header length {n} does not fit the file's {size} bytes")
        try:
            entries = json.loads(f.read(n))
            meta = entries.pop("__metadata__")
            header, want_crc = json.loads(meta["framekv"]), meta["crc32"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptFile(f"{path}: the header is not a framekv tensor file's ({exc})") from None
        specs = _check_entries(path, entries, size - 8 - n)
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
                          f"{want_crc}: the file is corrupt")
    return tensors, header


def _check_entries(path, entries: dict, data_bytes: int) -> dict:
    """name -> (dtype, shape, bytes), in file order, checked to tile the data exactly."""
    specs, at = {}, 0
    order = sorted(entries.items(), key=lambda kv: _offsets(path, kv)[0])
    for name, e in order:
        a, b = _offsets(path, (name, e))
        dtype = _DTYPES.get(e.get("dtype"))
        shape = e.get("shape")
        if dtype is None or not isinstance(shape, list) or not all(
                isinstance(s, int) and s >= 0 for s in shape):
            raise CorruptFile(f"{path}: tensor {name!r} has a bad dtype or shape: {e}")
        # Python ints: a declared shape cannot wrap its byte count round to a small one
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if a != at or b - a != n:
            raise CorruptFile(f"{path}: tensor {name!r} at bytes [{a}, {b}) does not follow "
                              f"byte {at} with its {n} bytes")
        specs[name], at = (dtype, shape, n), b
    if at != data_bytes:
        raise CorruptFile(f"{path}: the tensors hold {at} bytes, the file {data_bytes} "
                          f"after its header (truncated or extended)")
    return specs


def _offsets(path, item) -> tuple[int, int]:
    name, e = item
    off = e.get("data_offsets") if isinstance(e, dict) else None
    if not (isinstance(off, list) and len(off) == 2 and all(isinstance(x, int) for x in off)):
        raise CorruptFile(f"{path}: tensor {name!r} has no data_offsets")
    return off[0], off[1]
