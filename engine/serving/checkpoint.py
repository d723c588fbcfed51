"""`Checkpoints`: streams written to a folder as they go, off the GPU thread, so that a
server killed at any moment (SIGKILL, out of memory, a crash) restarts every stream
from its last checkpoint.

Every ``every`` chunks of a stream the scheduler takes its `StreamState` at a step
boundary (its K/V copy to pinned host memory queued on a side stream, the GPU thread
does not wait) and hands it here; a writer thread waits for the copy and writes the
file atomically (`state_files.write_state`: a whole file or none). The latest state of
a stream wins: one taken while an older one waits replaces it. A stream that ends
(closed, deleted, failed) has its file removed, after any write of it. ``flush`` waits
for every state handed over so far.
"""
from __future__ import annotations

import logging
import pathlib
import threading

from .state_files import SUFFIX, write_state

__all__ = ["Checkpoints"]
log = logging.getLogger("framekv.scheduler")


class Checkpoints:
    """A writer thread over ``directory`` (an existing folder), one state per stream
    every ``every`` chunks (module doc)."""

    def __init__(self, directory, every: int):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.directory, self.every = pathlib.Path(directory), every
        if not self.directory.is_dir():
            raise ValueError(f"directory must be an existing folder, got {str(directory)!r}")
        self._todo: dict[str, object] = {}    # stream id -> a state, or None: remove
        self._cv = threading.Condition()
        self._busy = 0
        self._closed = False
        self.written = self.failed = 0
        self._thread = threading.Thread(target=self._run, name="framekv-checkpoints", daemon=True)
        self._thread.start()

    def due(self, chunks: int) -> bool:
        """Whether a stream that has made ``chunks`` chunks is checkpointed now."""
        return chunks % self.every == 0

    def put(self, sid: str, state) -> None:
        """Write ``state`` (a `StreamState` whose copies may still run) as ``sid``'s."""
        with self._cv:
            self._todo[sid] = state
            self._cv.notify_all()

    def drop(self, sid: str) -> None:
        """Remove ``sid``'s file (it ended), after any write of it queued before."""
        with self._cv:
            self._todo[sid] = None
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every state handed over is written; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._todo and not self._busy, timeout)

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self.flush()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._todo or self._closed)
                if not self._todo:
                    return
                sid, state = self._todo.popitem()
                self._busy += 1
            try:
                self._write(sid, state)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _write(self, sid: str, state) -> None:
        path = self.directory / f"{sid}{SUFFIX}"
        try:
            if state is None:
                path.unlink(missing_ok=True)
                return
            state.synchronize()
            write_state(self.directory, state)
            self.written += 1
        except Exception:  # the stream goes on; its next checkpoint tries again
            self.failed += 1
            log.exception("checkpoint of stream %s to %s failed", sid, path)
