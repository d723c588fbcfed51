"""Files written whole or not at all: `written_whole`, the one way the engine writes a
file readers may open at any moment (a stream's state, a checkpoint of weights, a
cuDNN plan).

The bytes go to a temporary file beside the target (the same folder: the rename stays
on one file system; a name of its own: two writers never share it), which is synced to
disk and renamed over the target once written. A reader sees the old file (or none) or
the new one whole, even across a crash; a write that fails leaves the target as it was
and no temporary file behind.
"""
from __future__ import annotations

import contextlib
import os
import uuid

__all__ = ["written_whole"]


@contextlib.contextmanager
def written_whole(path):
    """The temporary path to write ``path``'s new bytes to (module doc); on a clean exit
    it replaces ``path``, on an exception it is removed (the exception goes on)."""
    path = os.fspath(path)
    tmp = f"{path}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)                 # the bytes on disk before the name points at them
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
