"""The key of a whole chunk: every forward of a chunk and its commit as one graph.

A chunk of an autoregressive rollout is several denoising forwards, one clean forward
(frame-causal blocks, its K/V become history) and a commit. Captured as one graph it
replays with one launch and no Python between the steps. Nothing special is needed
for that: any callable that runs the steps in order is captured like any other.
`chunk_key` names such a graph: its ``program`` string and ``block_sizes`` list the
steps, e.g. ``"chunk:4x1576+clean394+commit"``, and the sampler between them where one
is given (``"chunk[euler]:..."``).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import torch

from framekv.specs import Geometry

from .keys import GraphKey


def _program_string(name: str, labels: Sequence[str]) -> str:
    """``name:`` plus the step labels joined by ``+``, runs of equal labels as ``NxL``:
    ``_program_string("chunk", ["1576"] * 4 + ["clean394", "commit"])`` is
    ``"chunk:4x1576+clean394+commit"``."""
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


def _chunk_labels(tokens: int, *, denoise_steps: int, denoise_block: int | None,
                  clean_block: int | None, commit: bool | int) -> list[str]:
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
              packed: tuple[bool, ...] = (), sampler: str | None = None) -> GraphKey:
    """Key of a whole chunk: ``denoise_steps`` forwards, a clean forward, a commit.

    Args:
        denoise_block: block size of the denoising forwards (default: the whole chunk).
        clean_block: block size of the clean forward, or None when there is none.
        commit: True commits the chunk's ``tokens``; an int commits that many; False
            or 0 commits nothing.
        splits: split-KV S of each forward (``block_sizes`` order), or empty.
        batch: B, the sequences each forward runs.
        packed: GQA query packing of each forward (``block_sizes`` order), or empty.
        sampler: the sampler's label (its name and options: what it computes between
            the forwards and what its static inputs mean), or None for none.
    Example: ``chunk_key(o, g, 1576, denoise_steps=4, clean_block=394)`` has program
    ``"chunk:4x1576+clean394+commit"`` and block sizes ``(1576,) * 4 + (394,)``;
    runs of equal steps are written ``NxL``, a partial commit ``commit:N``; with
    ``sampler="euler"`` the program is ``"chunk[euler]:4x1576+clean394+commit"``.
    """
    labels = _chunk_labels(tokens, denoise_steps=denoise_steps, denoise_block=denoise_block,
                           clean_block=clean_block, commit=commit)
    blocks = (denoise_block or tokens,) * denoise_steps
    blocks += (clean_block,) if clean_block is not None else ()
    if sampler is not None and (not isinstance(sampler, str) or not sampler.strip()):
        raise ValueError(f"sampler must be None or a non-empty string, got {sampler!r}")
    name = "chunk" if sampler is None else f"chunk[{sampler}]"
    return GraphKey.build(owner=owner, geometry=geometry, tokens=tokens, block_sizes=blocks,
                          program=_program_string(name, labels), inputs=inputs,
                          splits=splits, batch=batch, packed=packed)
