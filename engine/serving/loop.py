"""The GPU loop of `StreamScheduler`: one thread steps the streams (`run`), and work
that must run where GPU work runs is handed to it and runs between steps (`_on_gpu`).

A request (an export, a save) is queued with a future; the loop serves the queue at the
start of every step, after the decode in flight has landed, so a request sees every
chunk made and the decoder idle. Without a loop (or from the loop's own thread) the
caller runs it under the GPU lock. Requests handed over as the loop ends run in its
last moments. A loop that ends by an exception fails every stream still going
(`loop_error`), and `open_session` raises `LoopStopped` from then on.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading

from .records import LoopStopped
from .stream import Phase


class GpuLoop:
    """The loop and its requests (module doc); its attributes are the scheduler's."""

    def _on_gpu(self, fn, *args):
        """``fn(*args)`` where GPU work may run: handed to the loop thread between
        steps, or run here when no loop runs (or this is it)."""
        loop = self._loop
        if loop is None or not loop.is_alive() or threading.current_thread() is loop:
            with self._gpu:
                self._flush()
                return fn(*args)
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._requests.put((fn, args, done))
        with self.ready:
            self.ready.notify_all()
        while True:
            try:
                return done.result(timeout=0.5)
            except concurrent.futures.TimeoutError:
                if not loop.is_alive():     # it ended before taking the request
                    with self._gpu:
                        self._serve_requests()

    def _serve_requests(self) -> None:
        while True:
            try:
                fn, args, done = self._requests.get_nowait()
            except queue.Empty:
                return
            self._flush()           # a request sees every chunk made, the decoder idle
            try:
                done.set_result(fn(*args))
            except BaseException as exc:
                done.set_exception(exc)

    def run(self, stop: threading.Event, idle_wait: float = 0.05) -> None:
        """Step until ``stop`` is set (the GPU loop of a server, in its own thread). A
        failing step fails its streams and the loop goes on; should the loop itself
        raise, `loop_error` keeps why, every stream still going fails with it,
        `open_session` raises `LoopStopped` from then on, and the exception propagates."""
        self._loop = threading.current_thread()
        try:
            while not stop.is_set():
                if self.step() == 0:
                    with self.ready:
                        if (not self._ready() and self._requests.empty()
                                and not stop.is_set()):
                            self.ready.wait(idle_wait)
        except BaseException as exc:
            self._stopped(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._serve_requests_after_stop()

    def _serve_requests_after_stop(self) -> None:
        """Requests handed over as the loop ended run here (nobody else would)."""
        self._loop = None
        with self._gpu:
            self._flush()
            self._serve_requests()

    def _stopped(self, reason: str) -> None:
        with self.lock:
            self.loop_error = reason
            for s in self.sessions.values():
                if not s.finished:
                    s.state, s.waiting_since = Phase.FAILED, None
                    s.error = f"the GPU loop stopped: {reason}"
            self.ready.notify_all()

    def _check_running(self) -> None:
        if self.loop_error is not None:
            raise LoopStopped(f"the GPU loop stopped ({self.loop_error}): no session can "
                              "be stepped; restart the server")
