"""What leaves and enters a `StreamScheduler` whole: streams, one `StreamState` each
way (its chunks on their way to its client: `delivery`).

    export_session   the stream out, its slot freed (a move, a drain)
    import_session   a stream in under its id, off the pool until its turn
    save_sessions    every open stream written to a folder, left open (a shutdown)
    restore_sessions a folder's streams in again (a start)
    checkpoints      every N chunks, a stream's state handed to `Checkpoints`

A resident stream's state is taken between steps on the GPU thread (its K/V copied
out on a side stream; the pages it reads are fenced until the copy is done); an
off-pool one's is the state it holds already. The record, its unacknowledged chunks,
its decoder row and, for a video stream, its encoder row and input (`Intake`) go into
the same state (`state_files`).
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from ..memory import host_room
from ..stream_state import StreamState
from . import state_files
from .records import SchedulerFull
from .stream import Phase, Stream

log = logging.getLogger("framekv.scheduler")


class Moves:
    """Streams in and out of `StreamScheduler` (module doc); its attributes are the
    scheduler's."""

    def export_session(self, session_id: str) -> StreamState:
        """The stream leaves this scheduler as one `StreamState` (its K/V, prompt,
        history, decoder row, record and unacknowledged chunks in host memory), its
        slot freed. KeyError for an id that is not open. Runs between steps (the loop
        takes it; the caller waits)."""
        return self._on_gpu(self._export, session_id)

    def _export(self, session_id: str):
        with self.lock:
            s = self.sessions.pop(session_id)
        try:
            state = self._state_of(s)
        except BaseException:
            with self.lock:
                self.sessions[session_id] = s
            raise
        with self.lock:
            if s.slot is not None:
                self.pool.give(s.slot)
                s.slot = None
            self.ready.notify_all()
        if self.checkpoints is not None:
            self.checkpoints.drop(session_id)
        state.synchronize()
        return state

    def _state_of(self, s: Stream):
        """``s`` as a `StreamState`, it left where it is (GPU work for one on the pool:
        its K/V copy may still run)."""
        with self.lock:
            record = dataclasses.replace(s, delivery=s.delivery.copy(), pending=list(s.pending),
                                         intake=None if s.intake is None else s.intake.copy())
        stream, decoder, encoder = record.parked, record.decoder, record.encoder
        if record.slot is not None and not record.finished:
            stream = self.runner.snapshot(record.slot)
            decoder = None if self.decoder is None else self.decoder.snapshot(record.slot)
            if record.intake is not None:
                encoder = self.encode_stage.encoder.snapshot(record.slot)
        return state_files.stream_state(record, stream, decoder, self.model, self.decoding,
                                        encoder)

    def import_session(self, state) -> str:
        """A stream `export_session` (here or in another process) gave goes on here
        under its id from its next chunk, its unacknowledged chunks first; it takes a
        slot at its turn. ValueError naming every difference for a state of another
        runner or decoding, or an id open here; `SchedulerFull` without room. Host work
        only."""
        return self._admit(state_files.stream_of(state, self.model, self.decoding))

    def _admit(self, s) -> str:
        """An imported stream's record in (module doc of `import_session`)."""
        self._check_input_fits(s)
        with self.lock:
            if s.id in self.sessions:
                raise ValueError(f"session {s.id} is open here already")
            if len(self.sessions) >= self.max_sessions:
                raise SchedulerFull(f"all {self.max_sessions} sessions are open")
            s.last_stepped = s.slot_since = self._counts["steps"]
            self.sessions[s.id] = s
            self._mark_waiting(s)
            self.ready.notify_all()
            return s.id

    def save_sessions(self, directory) -> list[str]:
        """Write each open stream that has not failed to ``directory`` (an existing
        folder), one file each (`state_files`); they stay open. A stream that cannot be
        written is logged and left out. Returns the ids written."""
        return self._on_gpu(self._save, directory)

    def _save(self, directory) -> list[str]:
        saved = []
        with self.lock:
            streams = list(self.sessions.values())
        for s in streams:
            if s.state == Phase.FAILED:
                log.warning("session %s is not saved: it failed (%s)", s.id, s.error)
                continue
            try:
                state = self._state_of(s)
                state.synchronize()
                state_files.write_state(directory, state)
            except Exception:
                log.exception("saving session %s to %s raised: it is not saved", s.id, directory)
                continue
            saved.append(s.id)
        return saved

    def restore_sessions(self, directory, *, keep_files: bool = False) -> list[str]:
        """Open again the streams saved in ``directory`` (by `save_sessions` or the
        checkpoints), under their ids, as many as there is room for; each file opened
        is removed (``keep_files``: left, for checkpoints that write over it, so a crash
        before the next one loses nothing), a corrupt one renamed ``*.corrupt``, one
        that does not fit logged and left (`state_files`); a file declaring more tensor
        bytes than the host can still hold (`host_room`) is corrupt, refused before
        anything is allocated. Returns the ids opened."""
        with self.lock:
            room, taken = self.max_sessions - len(self.sessions), set(self.sessions)
        pin = torch.device(self.runner.device).type == "cuda"
        opened = []
        for path, state in state_files.read_states(
                directory, room=lambda: len(opened) < room, taken=taken, pin_memory=pin,
                max_bytes=host_room()):
            try:
                opened.append(self._admit(state_files.stream_of(
                    state, self.model, self.decoding, where=str(path))))
            except (ValueError, SchedulerFull) as exc:
                log.error("session file left as it is, not opened: %s", exc)
                continue
            if not keep_files:
                state_files.remove(path)
        return opened

    def _checkpoint(self, due: list[str]) -> None:
        """Hand the due streams' states to the checkpoint writer (their copies run)."""
        for sid in due:
            with self.lock:
                s = self.sessions.get(sid)
            if s is None or s.state == Phase.FAILED:
                continue
            try:
                self.checkpoints.put(sid, self._state_of(s))
            except Exception:
                log.exception("taking the checkpoint of stream %s failed", sid)
