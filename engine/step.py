"""One step of a pool of streams, as data: the `StepPlan` a scheduler builds and the
`StepResult` `ChunkRunner.execute` returns, and the noise a stream's chunk draws.

A plan names every piece of GPU work of one step, in the order it runs::

    swap_outs   slot -> host: the stream in the slot copied out (`ChunkRunner.snapshot`),
                its state in the result (the slot is then free for a swap in)
    swap_ins    host -> slot: a stream restored into a slot (`ChunkRunner.restore`), or
                started there at position 0 under its prompt (no state yet); then a
                prompt change it got while off the pool (a rewrite)
    rewrites    prompt changes of streams in their slots (history re-cached)
    restarts    rows started over before the step (scratch rows a failure left stale)
    rows        the batch: the streams' slots, then scratch rows up to a batch size
    noise       [B, C, F, H, W] fp32, each stream's `chunk_noise` (scratch rows: zeros)
    inputs      the sampler's static inputs beyond noise and frame0, name -> [B, *shape]
                fp32 (`framekv.engine.samplers.Sampler.input_shapes`; the self_forcing
                sampler's fresh noise, say): each stream's `Sampler.row_inputs`, drawn
                from its key, or taken from its ``sources`` entry (what it brings
                beside its noise), so a stream's chunk is a function of its own seed,
                index and source wherever and beside whatever it runs (scratch rows:
                zeros)
    frame0      each row's first rope frame

A failed swap fails its stream alone (its slot is started over under the default
prompt, so the batch still runs: its chunk is dropped); a failed rewrite leaves the
stream under its old prompt (`ChunkRunner.prefill_rows` is all or nothing); a failed
chunk is the result's ``error``, the swaps before it done. A plan
without rows is a step of swaps and rewrites alone. Noise is drawn on the CPU from
(seed, index) alone: the same on every device and in every batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["StepPlan", "StepResult", "Swap", "chunk_noise", "chunk_renoise", "noise_seed",
           "sampler_inputs"]

_MASK64 = (1 << 64) - 1
#: Offset of the re-noise streams in `noise_seed`'s ``sequence``: far above any pool row.
_RENOISE = 1 << 32


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, index: int, sequence: int = 0) -> int:
    """The generator seed of chunk ``index`` of sequence ``sequence`` under ``seed``: the
    three hashed together (splitmix64) and folded to 32 bits, because torch's CPU
    generator seeds its Mersenne Twister from the low 32 bits only (shifted sums of
    seed and index would collide)."""
    h = 0
    for part in (seed, sequence, index):
        h = _splitmix64(h ^ (int(part) & _MASK64))
    return h & 0xFFFFFFFF


def chunk_noise(seed: int, index: int, shape, sequence: int = 0) -> torch.Tensor:
    """The starting noise of chunk ``index`` of sequence ``sequence`` seeded ``seed``:
    fp32, drawn on the CPU so that every device sees the same."""
    gen = torch.Generator().manual_seed(noise_seed(seed, index, sequence))
    return torch.randn(*shape, generator=gen)


def chunk_renoise(seed: int, index: int, steps: int, shape, sequence: int = 0) -> torch.Tensor:
    """The self_forcing sampler's fresh noise of chunk ``index`` (of sequence
    ``sequence`` seeded ``seed``), one per denoising step after the first:
    [steps - 1, *shape] fp32, drawn on the CPU from its own generator."""
    gen = torch.Generator().manual_seed(noise_seed(seed, index, sequence + _RENOISE))
    return torch.randn(max(steps - 1, 0), *shape, generator=gen)


def sampler_inputs(sampler, keys, shape, *, pad: int = 0, sequences=None,
                   sources=None) -> dict[str, torch.Tensor]:
    """A batch's static sampler inputs (`framekv.engine.samplers.Sampler`), name ->
    [len(keys) + pad, *shape of a row]: row r is ``sampler.row_inputs(*keys[r], shape,
    sequences[r], sources[r])`` (keys: (seed, chunk index); sequences default 0,
    sources None), then ``pad`` rows of zeros (fp32 on the CPU, or like the rows)."""
    n = len(keys)
    sequences = [0] * n if sequences is None else list(sequences)
    sources = [None] * n if sources is None else list(sources)
    rows = [sampler.row_inputs(seed, index, shape, q, src)
            for (seed, index), q, src in zip(keys, sequences, sources)]
    out = {}
    for name, row in sampler.input_shapes(shape).items():
        got = [r[name] for r in rows]
        zeros = (got[0] if got else torch.zeros(())).new_zeros(row)
        out[name] = torch.stack(got + [zeros] * pad)
    return out


@dataclass(eq=False)
class Swap:
    """One stream moving into or out of a slot, or rewriting its prompt there.

    ``stream``: its id; ``slot``: the pool sequence; ``state``: a swap in's
    `StreamState` (None: the stream starts at position 0); ``prompt``: a start's prompt
    [L, text_dim], or a rewrite's new prompt (None: the runner's default for a start,
    nothing for a swap in). A decoding caller names its decoder rows' swaps apart
    (`framekv.engine.decode_stage.DecodePlan`)."""

    stream: str
    slot: int
    state: object = None
    prompt: torch.Tensor | None = None


@dataclass(eq=False)
class StepPlan:
    """One step's GPU work (module doc). ``streams``: the ids of ``rows[:len(streams)]``;
    ``keys``: each stream's (seed, chunk index), what its noise is drawn from;
    ``sources``: each stream's source for its sampler inputs (`Sampler.row_inputs`;
    empty: None for every stream)."""

    rows: list[int] = field(default_factory=list)
    streams: list[str] = field(default_factory=list)
    keys: list[tuple[int, int]] = field(default_factory=list)
    frame0: list[int] = field(default_factory=list)
    sources: list = field(default_factory=list)
    noise: torch.Tensor | None = None
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    swap_outs: list[Swap] = field(default_factory=list)
    swap_ins: list[Swap] = field(default_factory=list)
    rewrites: list[Swap] = field(default_factory=list)
    restarts: list[int] = field(default_factory=list)

    def draw_noise(self, shape, sampler=None) -> None:
        """``noise`` of every row ([C, F, H, W] ``shape`` each) and, with a ``sampler``
        (the runner's `ChunkRunner.sampling`), its static ``inputs``: each stream's
        from its key (and source), zeros for the scratch rows (host work)."""
        pad = len(self.rows) - len(self.keys)
        self.noise = torch.stack([chunk_noise(s, i, shape) for s, i in self.keys]
                                 + [torch.zeros(shape)] * pad)
        self.inputs = {} if sampler is None else sampler_inputs(
            sampler, self.keys, tuple(shape), pad=pad, sources=self.sources or None)


@dataclass(eq=False)
class StepResult:
    """What a plan's GPU work gave: ``latents`` [B, C, F, H, W] fp32 on the runner's
    device (None: the plan had no rows); ``parked``: stream id -> the `StreamState` of
    each swap out (host memory, copied); ``failed``: stream id -> why its swap failed;
    ``rewrite_errors``: stream id -> the exception of its failed prompt change;
    ``error``: what the chunk (or a restart) raised, None if it ran: the swaps before
    it took place either way; ``swap_seconds``: stream id -> host seconds of its swap."""

    latents: torch.Tensor | None = None
    parked: dict = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    rewrite_errors: dict[str, BaseException] = field(default_factory=dict)
    error: BaseException | None = None
    swap_seconds: dict[str, float] = field(default_factory=dict)
