"""What `build_app` reads of the cluster's sessions (`ClusterSessions`) where it reads a
`StreamScheduler`'s, besides the calls both answer alike: the open sessions' ids as a
set, the runner's and decoder's few attributes, a prompt change's future, a replica's
error as an exception of its type's name. A session's chunks are read through the
transport-neutral calls (`ClusterSessions.handout`, `rewind`, `ack`), never through a
stand-in of its record.
"""
from __future__ import annotations

import collections.abc
import concurrent.futures
import dataclasses


class OpenSessions(collections.abc.Set):
    """The ids of the open sessions (`ClusterSessions.sessions`), from the placement:
    membership, size and iteration, no record."""

    def __init__(self, owner):          # the ClusterSessions
        self.owner = owner

    def __contains__(self, sid):
        return sid in self.owner.where

    def __iter__(self):
        return iter(list(self.owner.where))

    def __len__(self):
        return len(self.owner.where)


class PartsShim:
    """What the app reads of a runner or decoder: a dtype's name, video frame counts."""

    def __init__(self, dtype: str, video_frames):
        self.dtype, self._video = dtype, video_frames

    def video_frames(self, frames: int, first: bool) -> int:
        return self._video[0 if first else 1]


@dataclasses.dataclass
class Opened:
    id: str


class ReplicaPromptChange:
    """A prompt change on a replica, as `PromptChange` reads to the app."""

    def __init__(self, version: int, applies_from: int):
        self.version, self.applies_from = version, applies_from
        self.future: concurrent.futures.Future = concurrent.futures.Future()


def named_error(text: str) -> Exception:
    """A replica's ``"Type: message"`` as an exception of that type's name (the message
    the app writes of it is then the one a single server writes)."""
    name, _, message = text.partition(": ")
    return type(name if name.isidentifier() else "RuntimeError", (RuntimeError,), {})(message)
