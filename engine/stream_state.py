"""`StreamState`: one stream of a `ChunkRunner` outside its pool, in memory or in a file.

A stream (a runner's sequence s, with guidance also its unconditional branch S + s) is,
between chunks::

    sequences   one `SequenceSnapshot` per pool row: C and the kept K/V
    prompts     each pool row's prompt [L, text_dim] as it was given; a model that keeps
                the prompt outside the store (Wan's cross-attention K/V) recomputes it
                from these at restore (the same computation, so the same values)
    history     the clean latents of each pool row's visible frames (a model that
                ``keeps_history``), what a later prompt change re-caches
    chunks, frames   the sequence's position: chunks made, latent frames made
    noise       (seed, sequence): `chunk_noise(seed, chunk, shape, sequence)` draws its
                next chunk's noise wherever it goes on, and the sampler's static inputs
                come from the same (seed, chunk, sequence) (`Sampler.row_inputs`: the
                self_forcing sampler's fresh noise is `chunk_renoise` of them, on the
                CPU), so no generator state goes with it
    model       what a runner must match to take it: the model type, latent and prompt
                shapes, chunk layout, schedule (the steps a chunk runs), sampler (with
                its options), guidance and the pool's shape

`ChunkRunner.snapshot` / `ChunkRunner.restore` make and take one. ``save`` writes one
file (`framekv.engine.cache.tensorfile`: safetensors layout, versioned JSON header,
CRC; atomic), ``load`` reads it back or raises `CorruptFile` (a ValueError) for a
corrupt, truncated or foreign file, one whose header does not describe its tensors, or
one declaring more tensor bytes than its caller's bound. ``extra`` carries a caller's
JSON-able fields (a server's session record) and ``extra_tensors`` its tensors
(undelivered chunks).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache.snapshot import SequenceSnapshot, check_format
from .cache.tensorfile import CorruptFile, read_tensors, write_tensors

__all__ = ["StreamState"]

FORMAT, VERSION = "framekv.stream", 1


def differences(have, want, name: str = "") -> list[str]:
    """Each field, nested ones by dotted name, where ``have`` (a state's model) differs
    from ``want`` (a runner's `ChunkRunner.describe`)."""
    if not (isinstance(have, dict) and isinstance(want, dict)):
        return [] if have == want else [f"{name}: the state has {have!r}, the runner {want!r}"]
    return [d for k in sorted(set(have) | set(want), key=str)
            for d in differences(have.get(k), want.get(k), f"{name}.{k}" if name else str(k))]


@dataclass(eq=False)
class StreamState:
    """One stream's state (module doc)."""

    model: dict
    sequences: list[SequenceSnapshot]
    prompts: list[torch.Tensor]
    history: list[list[tuple[int, torch.Tensor]]] | None
    chunks: int
    frames: int
    noise: tuple[int, int]
    extra: dict = field(default_factory=dict)
    extra_tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Host bytes held: K/V, prompts, history latents and extra tensors."""
        n = sum(s.nbytes for s in self.sequences)
        tensors = list(self.prompts) + list(self.extra_tensors.values())
        tensors += [t for rows in self.history or () for _, t in rows]
        return n + sum(t.numel() * t.element_size() for t in tensors)

    def synchronize(self) -> None:
        """Wait for every copy from the device."""
        for s in self.sequences:
            s.synchronize()

    def check_fits(self, want: dict) -> None:
        """ValueError naming every field, nested ones by dotted name, where this state's
        model differs from ``want`` (a runner's `ChunkRunner.describe`)."""
        diff = differences(self.model, want)
        if diff:
            raise ValueError("stream state does not fit this runner: " + "; ".join(diff))

    # ------------------------------------------------------------------ files
    def save(self, path) -> int:
        """Write the state to ``path`` atomically; returns the file's bytes."""
        tensors, seqs = {}, []
        for r, (snap, prompt) in enumerate(zip(self.sequences, self.prompts)):
            tensors.update(snap.tensors(f"seq{r}."))
            tensors[f"prompt{r}"] = prompt.detach().cpu()
            seqs.append(snap.header())
        frames = []
        for r, rows in enumerate(self.history or ()):
            frames.append([f for f, _ in rows])
            tensors.update({f"history{r}.{f}": t.cpu() for f, t in rows})
        tensors.update({f"extra.{k}": t.detach().cpu() for k, t in self.extra_tensors.items()})
        header = {"format": FORMAT, "version": VERSION, "model": self.model,
                  "sequences": seqs, "history": None if self.history is None else frames,
                  "chunks": self.chunks, "frames": self.frames, "noise": list(self.noise),
                  "extra": self.extra, "extra_tensors": list(self.extra_tensors)}
        return write_tensors(path, tensors, header)

    @classmethod
    def load(cls, path, *, pin_memory: bool = False,
             max_bytes: int | None = None) -> "StreamState":
        """The state `save` wrote; `CorruptFile` (a ValueError) for a truncated,
        corrupt or foreign file, or one declaring over ``max_bytes`` bytes of tensors
        (None: no bound; nothing is allocated for such a file)."""
        tensors, h = read_tensors(path, pin_memory=pin_memory, max_bytes=max_bytes)
        check_format(path, h, FORMAT, VERSION)
        try:
            return cls._of(h, tensors)
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise CorruptFile(f"{path}: stream state header is incomplete or wrong: "
                              f"{type(exc).__name__}: {str(exc)[:200]}") from None

    @classmethod
    def _of(cls, h: dict, tensors: dict) -> "StreamState":
        """The state of a file's header ``h`` and its tensors (KeyError, TypeError or
        ValueError where they disagree)."""
        if not isinstance(h["model"], dict) or not isinstance(h["extra"], dict):
            raise TypeError("model and extra must be JSON objects")
        seqs = [SequenceSnapshot.from_parts(s, tensors, f"seq{r}.")
                for r, s in enumerate(h["sequences"])]
        prompts = [tensors[f"prompt{r}"] for r in range(len(seqs))]
        history = None if h["history"] is None else [
            [(f, tensors[f"history{r}.{f}"]) for f in frames]
            for r, frames in enumerate(h["history"])]
        extra_tensors = {k: tensors[f"extra.{k}"] for k in h["extra_tensors"]}
        seed, sequence = h["noise"]
        return cls(h["model"], seqs, prompts, history, int(h["chunks"]), int(h["frames"]),
                   (int(seed), int(sequence)), dict(h["extra"]), extra_tensors)
