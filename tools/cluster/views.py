"""What `build_app` reads of the cluster's sessions (`ClusterSessions`) where it reads a
`StreamScheduler`'s: a session's `StreamView`, the open sessions as a mapping, the
runner's and decoder's few attributes, a prompt change's future, a replica's error
as an exception of its type's name.
"""
from __future__ import annotations

import collections.abc
import concurrent.futures
import dataclasses


@dataclasses.dataclass
class StreamView:
    """What a socket's sender reads of a session (`serve_socket`): its reader, state,
    whether finished, chunks handed out and queued (``queue``: a range as long)."""

    reader: int
    state: str = "active"
    finished: bool = False
    sent: int = 0
    queue: range = range(0)


class OpenSessions(collections.abc.Mapping):
    """Session id -> `StreamView` of each open session (`ClusterSessions.sessions`):
    membership and size from the placement, a view fetched from its replica."""

    def __init__(self, owner):          # the ClusterSessions
        self.owner = owner

    def __getitem__(self, sid):
        view = self.owner.view(sid)
        if view is None:
            raise KeyError(sid)
        return view

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
