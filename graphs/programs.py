"""Per-chunk programs: a whole sequence of steps as one callable, and standard keys.

A chunk of an autoregressive rollout is several denoising forwards, one clean forward
(frame-causal blocks, its K/V become history) and a commit. Captured as one graph it
replays with one launch and no Python between the steps. Nothing special is needed
for that: any callable that runs the steps in order is captured like any other. A
`SequenceProgram` just names the steps so that the key's ``program`` string and
``block_sizes`` are derived from the same list that runs::

    chunk = SequenceProgram("chunk", [
        *[Step("1576", partial(denoise, t=i), block_size=1576) for i in range(4)],
        Step("clean394", clean, block_size=394),
        Step("commit", lambda x, **_: (cache.commit(1576), x)[1]),
    ])
    key = chunk.key(owner=owner_token(cache), geometry=g, tokens=1576, inputs=inputs)
    # key.program == "chunk:4x1576+clean394+commit"
    out = graphs.run(key, chunk, inputs, after_replay=mirror)

Each step is ``fn(carry, **inputs) -> carry``: the first step gets ``carry=None``,
the program returns the last step's carry (its outputs).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch

from framekv.specs import Geometry

from .keys import GraphKey


def program_string(name: str, labels: Sequence[str]) -> str:
    """``name:`` plus the step labels joined by ``+``, runs of equal labels as ``NxL``.

    ``program_string("chunk", ["1576"] * 4 + ["clean394", "commit"])`` is
    ``"chunk:4x1576+clean394+commit"``.
    """
    parts: list[str] = []
    run_label, run = None, 0
    for label in list(labels) + [None]:
        if label == run_label:
            run += 1
            continue
        if run_label is not None:
            parts.append(run_label if run == 1 else f"{run}x{run_label}")
        run_label, run = label, 1
    return f"{name}:{'+'.join(parts)}" if parts else name


class Step(NamedTuple):
    """One step of a `SequenceProgram`.

    Attributes:
        label: the step's name in the program string ("1576", "clean394", "commit").
        fn: ``fn(carry, **inputs) -> carry``.
        block_size: the causal block size of the forward the step runs, None when it
            runs none (a commit); listed in the key's ``block_sizes``.
    """

    label: str
    fn: Callable[..., Any]
    block_size: int | None = None


class SequenceProgram:
    """Steps run in order as one callable: ``program(**inputs)`` -> the last carry."""

    def __init__(self, name: str, steps: Sequence[Step]):
        if not isinstance(name, str) or not name or ":" in name:
            raise ValueError(f"name must be a non-empty string without ':', got {name!r}")
        steps = tuple(steps)
        if not steps:
            raise ValueError("a SequenceProgram needs at least one step")
        for i, step in enumerate(steps):
            if not isinstance(step, Step) or not callable(step.fn):
                raise ValueError(f"steps[{i}] must be a Step with a callable fn, got {step!r}")
        self.name, self.steps = name, steps

    @property
    def program(self) -> str:
        """The key's program string, e.g. ``"chunk:4x1576+clean394+commit"``."""
        return program_string(self.name, [s.label for s in self.steps])

    @property
    def block_sizes(self) -> tuple[int, ...]:
        """Block size of each forward, in order."""
        return tuple(s.block_size for s in self.steps if s.block_size is not None)

    def __call__(self, **inputs: torch.Tensor) -> Any:
        carry = None
        for step in self.steps:
            carry = step.fn(carry, **inputs)
        return carry

    def key(self, *, owner: int, tokens: int, geometry: Geometry | None = None,
            inputs: Mapping[str, torch.Tensor] | None = None) -> GraphKey:
        """The key of this program over ``inputs``."""
        return GraphKey.build(owner=owner, geometry=geometry, tokens=tokens,
                              block_sizes=self.block_sizes, program=self.program, inputs=inputs)


# ------------------------------------------------------------------ standard keys
def forward_key(owner: int, geometry: Geometry | None, tokens: int, block_size: int,
                inputs: Mapping[str, torch.Tensor] | None = None, split: int | None = None,
                packed: bool | None = None) -> GraphKey:
    """Key of one forward of ``tokens`` real tokens cut into ``block_size`` blocks
    (``split``: its split-KV S, ``packed``: its GQA query packing; None when the
    attention does neither)."""
    return GraphKey.build(owner=owner, geometry=geometry, tokens=tokens,
                          block_sizes=(block_size,), program="forward", inputs=inputs,
                          splits=() if split is None else (split,),
                          packed=() if packed is None else (packed,))


def commit_key(owner: int, geometry: Geometry | None, n: int,
               inputs: Mapping[str, torch.Tensor] | None = None) -> GraphKey:
    """Key of ``commit(n)`` alone (program ``"commit:n"``; n is baked, C is not)."""
    return GraphKey.build(owner=owner, geometry=geometry, tokens=n, program=f"commit:{n}",
                          inputs=inputs)


def chunk_labels(tokens: int, *, denoise_steps: int, denoise_block: int | None = None,
                 clean_block: int | None = None, commit: bool | int = True) -> list[str]:
    """Step labels of a chunk program (see `chunk_key`)."""
    if isinstance(denoise_steps, bool) or not isinstance(denoise_steps, int) or denoise_steps < 0:
        raise ValueError(f"denoise_steps must be an integer >= 0, got {denoise_steps!r}")
    labels = [str(denoise_block or tokens)] * denoise_steps
    if clean_block is not None:
        labels.append(f"clean{clean_block}")
    n = tokens if commit is True else (commit or 0)
    if n:
        labels.append("commit" if n == tokens else f"commit:{n}")
    return labels


def chunk_key(owner: int, geometry: Geometry | None, tokens: int, *, denoise_steps: int,
              denoise_block: int | None = None, clean_block: int | None = None,
              commit: bool | int = True,
              inputs: Mapping[str, torch.Tensor] | None = None,
              splits: tuple[int, ...] = (), batch: int = 1,
              packed: tuple[bool, ...] = ()) -> GraphKey:
    """Key of a whole chunk: ``denoise_steps`` forwards, a clean forward, a commit.

    Args:
        denoise_block: block size of the denoising forwards (default: the whole chunk).
        clean_block: block size of the clean forward, or None when there is none.
        commit: True commits the chunk's ``tokens``; an int commits that many; False
            or 0 commits nothing.
        splits: split-KV S of each forward (``block_sizes`` order), or empty.
        batch: B, the sequences each forward runs.
        packed: GQA query packing of each forward (``block_sizes`` order), or empty.
    Example: ``chunk_key(o, g, 1576, denoise_steps=4, clean_block=394)`` has program
    ``"chunk:4x1576+clean394+commit"`` and block sizes ``(1576,) * 4 + (394,)``.
    """
    labels = chunk_labels(tokens, denoise_steps=denoise_steps, denoise_block=denoise_block,
                          clean_block=clean_block, commit=commit)
    blocks = (denoise_block or tokens,) * denoise_steps
    blocks += (clean_block,) if clean_block is not None else ()
    return GraphKey.build(owner=owner, geometry=geometry, tokens=tokens, block_sizes=blocks,
                          program=program_string("chunk", labels), inputs=inputs, splits=splits,
                          batch=batch, packed=packed)
