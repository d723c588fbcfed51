"""The control block a resident loop and its host share, and the loop's interface.

A `framekv.graphs.resident.ResidentGraph` and the device loop that serves it (the
parent graph of `framekv.graphs.resident.device`, or a test's thread playing it) talk
through one 64-byte block of mapped pinned host memory, one uint64 per word::

    +------+------+--------+------+-------+
    | RING | STOP | SERVED | DONE | STATE |      the host writes RING and STOP;
    +------+------+--------+------+-------+      the gate SERVED, DONE and STATE

- RING: the last run the host submitted (runs are numbered 1, 2, ...);
- STOP: set once, when the host closes the runner: the gate leaves at its next look;
- SERVED: the last run the gate started; DONE: the last run that finished;
- STATE: the gate's state, `NOT_LAUNCHED` -> `RUNNING` -> `EXITING` -> `EXITED`
  (the host writes `RUNNING` just before it launches the loop, so that no second
  launch happens; an exiting gate re-reads RING once before it leaves).

The device kernels are written against the same indices (`device.kernel_source`).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np

__all__ = ["RING", "STOP", "SERVED", "DONE", "STATE", "WORDS", "NOT_LAUNCHED", "RUNNING",
           "EXITING", "EXITED", "STATE_NAMES", "ResidentLoop"]

# Control-block words (uint64 each) and gate states.
RING, STOP, SERVED, DONE, STATE = range(5)
WORDS = 8  # one 64-byte line
NOT_LAUNCHED, RUNNING, EXITING, EXITED = range(4)
STATE_NAMES = ("not launched", "running", "exiting", "exited")


class ResidentLoop(Protocol):
    """The device side of a `ResidentGraph` (`device.DeviceLoop`, or a test's thread
    playing the gate over the same control block)."""

    control: np.ndarray  # [WORDS] uint64, the control block as the host sees it

    def launch(self) -> None: ...              # start the parent loop (queued in order)

    def synchronize(self) -> None: ...         # return once every launched loop ended

    def release(self) -> None: ...             # free what launch() needs
