"""Replay checks: does a graph-replayed sequence produce what the eager one does?

For users' test suites. A step function runs one step (a forward, a whole chunk) over a
state; the check runs every step eagerly on one fresh state and through a `GraphCache`
on another, comparing outputs after each step, and reports the first mismatch::

    from framekv.graphs import assert_replay_matches

    def make_state():
        return {"h": torch.zeros(64, device="cuda"), "w": weight}

    def step(state, x):
        state["h"].copy_(torch.tanh(state["h"] @ state["w"] + x))  # in place: fixed address
        return state["h"] * 2

    steps = [{"x": torch.randn(64, device="cuda")} for _ in range(100)]
    assert_replay_matches(make_state, step, steps, device="cuda")  # bit for bit

For a rollout over a `CausalKVCache`, the step does the forwards and ``cache.commit``;
``after_replay(state, key)`` advances the host mirror a replay skips
(``note_staged``/``commit_host``) and ``reset(state)`` reopens the geometry after
capture (capturing runs the step's Python once, which moves the mirror).

Order of events: ``make_state()`` is called for the eager side, then the graph side,
then (when ``warmup > 0``) once more for a scratch state the warm-up calls run on, so
warm-up never touches the graph side's state. Every distinct key is captured before
step 0 (keys never depend on how far a rollout has got), then ``reset`` runs, then the
steps run in order.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import msgspec
import torch

from .cache import GraphCache
from .captured import named_outputs
from .keys import GraphKey


class ReplayMismatch(msgspec.Struct, frozen=True):
    """The first step whose replayed outputs differ from the eager ones.

    Attributes:
        step: index into the steps.
        output: the output's name (``output``, ``output[1]``, a dict key).
        max_abs_error: largest |eager - replayed| (inf for a shape/dtype/NaN mismatch).
        detail: what differs, in words.
    """

    step: int
    output: str
    max_abs_error: float
    detail: str

    def __str__(self) -> str:
        return (f"replay differs from eager at step {self.step}, {self.output}: "
                f"max abs error {self.max_abs_error:.3g} ({self.detail})")


def compare_outputs(expected: Any, actual: Any, *, atol: float = 0.0,
                    rtol: float = 0.0) -> tuple[str, float, str] | None:
    """(output name, max abs error, detail) of the first differing output, or None.

    Elements match when ``|a - e| <= atol + rtol * |e|`` (NaN matches NaN); with the
    defaults, bit-for-bit equal values.
    """
    want, got = named_outputs(expected), named_outputs(actual)
    if [n for n, _ in want] != [n for n, _ in got]:
        return ("outputs", float("inf"),
                f"names {[n for n, _ in want]} vs {[n for n, _ in got]}")
    for (name, e), (_, a) in zip(want, got):
        if e.shape != a.shape or e.dtype != a.dtype:
            return (name, float("inf"), f"eager {list(e.shape)} {e.dtype}, replayed "
                                        f"{list(a.shape)} {a.dtype}")
        e64, a64 = e.detach().double(), a.detach().to(e.device).double()
        ok = torch.isclose(a64, e64, rtol=rtol, atol=atol, equal_nan=True)
        bad = int((~ok).sum())
        if bad:
            err = (a64 - e64).abs().nan_to_num(nan=float("inf"))
            first = tuple(torch.nonzero(~ok)[0].tolist())
            return (name, float(err.max()), f"{bad} of {e.numel()} elements differ, first at "
                                            f"index {list(first)}")
    return None


def _default_key(step_fn, state, index, inputs) -> GraphKey:
    # One state, one cache: the owner cannot collide, the input layouts decide.
    return GraphKey.build(owner=0, program=getattr(step_fn, "__name__", "step") or "step",
                          inputs=inputs)


def check_replay(make_state: Callable[[], Any], step_fn: Callable[..., Any],
                 steps: Sequence[Mapping[str, torch.Tensor]], *, device,
                 key_fn: Callable[[Any, int, Mapping], GraphKey] | None = None,
                 after_replay: Callable[[Any, GraphKey], None] | None = None,
                 reset: Callable[[Any], None] | None = None, atol: float = 0.0,
                 rtol: float = 0.0, warmup: int = 2, debug: bool = True) -> ReplayMismatch | None:
    """Run ``steps`` eagerly and replayed; the first mismatch, or None.

    Args:
        make_state: returns a fresh state (every tensor a step reads or writes, at
            fixed addresses: steps update it in place).
        step_fn: ``step_fn(state, **inputs) -> outputs`` (a tensor, tuple/list/dict).
        steps: the inputs of each step, name -> tensor.
        device: the `GraphCache` device ("cpu" runs both sides eagerly).
        key_fn: ``key_fn(state, index, inputs) -> GraphKey``; default: one key per
            input layout.
        after_replay: ``after_replay(state, key)``, host work after each replay.
        reset: ``reset(state)``, run on the graph side's state after all captures.
        atol, rtol: tolerance (default exact).
        warmup: warm-up calls per capture (on a scratch state).
        debug: the cache's debug checks.
    """
    steps = list(steps)
    eager, graphed = make_state(), make_state()
    scratch = make_state() if warmup else None
    cache = GraphCache(device, debug=debug, warmup_iters=warmup)
    keys = [(key_fn(graphed, i, s) if key_fn else _default_key(step_fn, graphed, i, s))
            for i, s in enumerate(steps)]
    for key, inputs in zip(keys, steps):
        if key not in cache:
            hook = functools.partial(after_replay, graphed, key) if after_replay else None
            cache.capture(key, functools.partial(step_fn, graphed), inputs, after_replay=hook,
                          warmup_fn=functools.partial(step_fn, scratch) if warmup else None)
    if reset is not None:
        reset(graphed)
    for i, (key, inputs) in enumerate(zip(keys, steps)):
        expected = step_fn(eager, **inputs)
        actual = cache.replay(key, inputs)
        found = compare_outputs(expected, actual, atol=atol, rtol=rtol)
        if found is not None:
            return ReplayMismatch(i, *found)
    return None


def assert_replay_matches(make_state, step_fn, steps, **kwargs) -> None:
    """`check_replay`, raising AssertionError with the mismatch report if there is one."""
    mismatch = check_replay(make_state, step_fn, steps, **kwargs)
    if mismatch is not None:
        raise AssertionError(str(mismatch))
