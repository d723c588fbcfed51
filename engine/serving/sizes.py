"""How big a scheduler is: `check_args` and `check_host_latents` (its arguments, each
refused by name), `default_batch_sizes` (the batch sizes captured), `scratch_rows` (the
rows a batch is padded with up to a captured size) and `MAX_SESSIONS`."""
from __future__ import annotations

__all__ = ["MAX_SESSIONS", "check_args", "check_host_latents", "default_batch_sizes",
           "scratch_rows"]

#: streams one scheduler holds at most: its records, slots and batch sizes stay small
#: host state (`framekv serve --max-sessions` refuses more at parse time)
MAX_SESSIONS = 4096


def scratch_rows(sizes: tuple[int, ...], slots: int) -> int:
    """The scratch rows a batch of 1 to ``slots`` streams may need: the most that the
    smallest captured size of ``sizes`` (ascending) at or above its count pads it with.
    Between two sizes a < b the widest padding is the batch of a + 1, so one pass over
    the sizes (not over every batch) finds it."""
    scratch, below = 0, 0
    for b in sizes:
        scratch = max(scratch, b - below - 1)
        if b >= slots:
            break
        below = b
    return scratch


def check_args(max_sessions, slots, queue_chunks, ended_records, swap_quantum,
               rollout_args: dict, runner_factory, decoder_factory) -> int:
    """The slots S once every argument is valid; else a ValueError naming it.
    ``rollout_args``: the preset `Rollout`'s own arguments by name, each None with a
    ``runner_factory`` (which sets its runner's)."""
    for name, v in (("max_sessions", max_sessions), ("queue_chunks", queue_chunks),
                    ("ended_records", ended_records), ("swap_quantum", swap_quantum)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if max_sessions > MAX_SESSIONS:
        raise ValueError(f"max_sessions must be an integer in [1, {MAX_SESSIONS}], got "
                         f"{max_sessions}")
    for name, value in rollout_args.items():
        if value is not None and runner_factory is not None:
            raise ValueError(f"{name} is the preset's Rollout's: with a runner_factory, "
                             f"set it in the factory, got {name}={value!r}")
    if decoder_factory is not None and not callable(decoder_factory):
        raise ValueError(f"decoder_factory must be a callable, got {decoder_factory!r}")
    if slots is None:
        return max_sessions
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= max_sessions:
        raise ValueError(f"slots must be None or an integer in [1, max_sessions="
                         f"{max_sessions}], got {slots!r}")
    return slots


def check_host_latents(host_latents, decoding: bool) -> bool:
    """Whether chunks carry their latents to the host (`StreamScheduler`'s
    ``host_latents``: None, True or False, False with a decoder only); else a
    ValueError naming it."""
    if host_latents not in (None, True, False):
        raise ValueError(f"host_latents must be None, True or False, got {host_latents!r}")
    if host_latents is False and not decoding:
        raise ValueError("host_latents=False needs a decoder_factory (frames for a client to "
                         "get), got none: a chunk carries its latents alone")
    return not decoding if host_latents is None else host_latents


def default_batch_sizes(max_sessions: int) -> tuple[int, ...]:
    """Powers of two below ``max_sessions``, and ``max_sessions``."""
    sizes = [1 << i for i in range(max_sessions.bit_length()) if 1 << i < max_sessions]
    return tuple(sizes) + (max_sessions,)
