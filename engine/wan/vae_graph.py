"""The Wan VAE decoder's causal cache as persistent arena tensors, and the one chunk
program `StreamingVAEDecoder` runs eagerly or replays as a CUDA graph.

diffusers' ``WanDecoder3d`` decodes one latent frame per call and keeps, per causal
layer, a cache list entry: ``None`` before a video's first frame; after it, the
layer's last input step (one time step) or, for a time-upsampling ``WanResample``,
the marker ``"Rep"``; from the second frame on, the last ``CACHE_T = 2`` steps. Both
first-frame forms are the steady two-step form with zeros in front, exactly:

* a cached causal conv concatenates ``[cache, x]`` and zero-pads the rest of its
  kernel's time extent, so ``[c]`` and ``[0, c]`` feed it the same values, and the
  next cache takes ``[c, x]`` either way (the last step of ``[0, c]`` is ``c``);
* ``"Rep"`` runs the time conv zero-padded and caches ``[0, x]``: what a cache of
  zeros gives.

So after a video's first frame every entry is widened to two steps (`to_steady`),
and every later frame of every sequence runs one shape. The arena holds, per used
entry, ``[S, C_l, 2, H_l, W_l]`` for S sequences (shapes from an eager dry run,
`CacheLayout.probe`), and a chunk is one program over static inputs (`chunk_program`):

    cache = [None] * n (first chunk) | [arena_l[rows] for l]      # gather
    x = post_quant_conv(latents / inv_std + mean)                  # WanPipeline's denorm
    frames = [decoder(x[:, :, i], cache, first_chunk=(first and i == 0)) for i in F]
    arena_l[rows] = cache_l                                        # scatter
    return clamp(cat(frames), -1, 1)

Graph keys (`graph_key`) hold the batch, the frames and the stage ("first": the
chunk starts the rows' videos; "steady": every row continues one).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from framekv.graphs import GraphKey

from ..arena import carved_bytes, make_arena

STAGES = ("first", "steady")


def causal_slots(vae) -> int:
    """Length of the decoder's cache list (its causal convs, as diffusers counts them)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return sum(isinstance(m, WanCausalConv3d) for m in vae.decoder.modules())


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """The decoder's steady cache at one latent size.

    Attributes:
        slots: the cache list's length (diffusers counts every causal conv; only the
            first ``len(shapes)`` entries are used).
        shapes: per used entry, [C_l, 2, H_l, W_l] of one sequence.
        dtypes: per used entry, its dtype.
        latent_size: (H, W) of the latents it was probed at.
    """

    slots: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    latent_size: tuple[int, int]

    @classmethod
    @torch.no_grad()
    def probe(cls, vae, latent_size: tuple[int, int], device: torch.device) -> "CacheLayout":
        """Decode two zero frames of one sequence eagerly and read the cache entries'
        shapes after the second (the steady form)."""
        slots = causal_slots(vae)
        H, W = latent_size
        z = torch.zeros(1, vae.config.z_dim, 2, H, W, device=device,
                        dtype=vae.dtype)  # [1, C, 2, H, W]
        x = vae.post_quant_conv(z)
        cache: list = [None] * slots
        used = 0
        for i in range(2):
            idx = [0]
            vae.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=idx, first_chunk=i == 0)
            used = idx[0]
        entries = cache[:used]
        if any(not isinstance(c, torch.Tensor) or c.dim() != 5 or c.shape[2] != 2 for c in entries):
            raise RuntimeError("the decoder's cache is not two-step tensors after two frames: "
                               "this diffusers version caches differently")
        return cls(slots=slots, shapes=tuple(tuple(c.shape[1:]) for c in entries),
                   dtypes=tuple(c.dtype for c in entries), latent_size=(H, W))

    def entry_bytes(self, sequences: int) -> list[int]:
        """Bytes of each arena tensor for ``sequences`` sequences."""
        return [sequences * math.prod(s) * torch.empty((), dtype=d).element_size()
                for s, d in zip(self.shapes, self.dtypes)]


def to_steady(cache: list, layout: CacheLayout, batch: int, device: torch.device) -> list:
    """The cache after a video's first frame in its steady two-step form (module doc):
    ``"Rep"`` becomes zeros, a one-step entry gets a zero step in front."""
    out = []
    for c, shape, dtype in zip(cache, layout.shapes, layout.dtypes):
        if isinstance(c, str):  # diffusers' "Rep": the time conv has seen no frame yet
            c = torch.zeros(batch, *shape, dtype=dtype, device=device)
        elif c.shape[2] < 2:
            c = torch.cat([torch.zeros_like(c), c], dim=2)
        if tuple(c.shape) != (batch, *shape):
            raise RuntimeError(f"cache entry {len(out)} is {list(c.shape)} after the first "
                               f"frame, expected {[batch, *shape]}")
        out.append(c)
    return out + cache[len(out):]


class CacheArena:
    """Every sequence's causal cache in one persistent arena (`make_arena`): tensor l
    is [S, C_l, 2, H_l, W_l], zero-filled, at a fixed address for the arena's life."""

    def __init__(self, layout: CacheLayout, sequences: int, device: torch.device):
        self.layout, self.sequences = layout, sequences
        self._arena = make_arena(device, carved_bytes(layout.entry_bytes(sequences)))
        self.tensors = [self._arena.zeros((sequences, *s), d, name=f"vae_cache{i}")
                        for i, (s, d) in enumerate(zip(layout.shapes, layout.dtypes))]

    @property
    def nbytes(self) -> int:
        """Bytes the arena maps (the tensors, aligned, rounded up to its chunk)."""
        return 0 if self._arena.closed else self._arena.mapped_bytes

    def gather(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Copies of rows ``rows`` [B] int64 of every entry, each [B, C_l, 2, H_l, W_l]."""
        return [t.index_select(0, rows) for t in self.tensors]

    def scatter(self, rows: torch.Tensor, cache: list) -> None:
        """Write the used entries of ``cache`` back to rows ``rows`` (distinct)."""
        for t, c in zip(self.tensors, cache):
            t.index_copy_(0, rows, c)

    def close(self) -> None:
        self.tensors = []
        self._arena.close()


def chunk_program(vae, arena: CacheArena, *, first: bool, mean: torch.Tensor,
                  inv_std: torch.Tensor, write: bool = True):
    """The chunk callable ``fn(latents, rows) -> frames`` (module doc): latents [B, C, F,
    H, W] normalised, in the vae's dtype; rows [B] int64 the sequences, distinct; frames
    [B, 3, F', 8H, 8W] clamped to [-1, 1]. ``write=False`` skips the scatter (a graph's
    warm-up calls must not advance the caches)."""
    layout = arena.layout

    @torch.no_grad()
    def fn(latents: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        B, F = latents.shape[0], latents.shape[2]
        x = vae.post_quant_conv(latents / inv_std + mean)  # [B, C, F, H, W]
        cache = [None] * layout.slots if first else arena.gather(rows) + \
            [None] * (layout.slots - len(layout.shapes))
        frames = []
        for i in range(F):
            frames.append(vae.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0],
                                      first_chunk=first and i == 0))  # [B, 3, 1 or 4, 8H, 8W]
            if first and i == 0:
                cache = to_steady(cache, layout, B, x.device)
        if write:
            arena.scatter(rows, cache)
        return torch.clamp(torch.cat(frames, dim=2), min=-1.0, max=1.0)

    return fn


def graph_key(owner: int, stage: str, inputs: dict) -> GraphKey:
    """The key of a chunk graph: stage and frames in the program, batch in ``batch``."""
    latents = inputs["latents"]
    return GraphKey.build(owner=owner, program=f"vae-decode:{stage}:{latents.shape[2]}f",
                          inputs=inputs, batch=latents.shape[0])


class DecoderRows:
    """What a streaming decoder (`StreamingVAEDecoder`, `TinyStreamingDecoder`) keeps per
    sequence and shares: latent frames decoded per row (``_frames``), the arena
    (``_cache``), the graphs (``_graphs``, ``_programs``), ``closed``; the rows checked,
    reset and staged ("first" or "steady") the same way. Subclasses set those attributes
    and define ``sequences`` and ``_check_open``."""

    def frames_decoded(self, row: int) -> int:
        """Latent frames sequence ``row`` has decoded since its video started."""
        S = self.sequences or 0
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < S:
            raise ValueError(f"row must be an integer in [0, {S}) (the decoder's sequences), "
                             f"got {row!r}")
        return self._frames[row]

    @property
    def state(self) -> tuple[int, ...]:
        """Latent frames decoded per sequence (empty while S is unknown)."""
        return tuple(self._frames or ())

    @property
    def arena_bytes(self) -> int:
        """Bytes the carried arena maps (0 before the first decode and after `close`)."""
        return 0 if self._cache is None else self._cache.nbytes

    @property
    def graph_count(self) -> int:
        """Chunk graphs captured (0 when eager)."""
        return 0 if self._graphs is None else len(self._graphs)

    def reset(self, rows=None) -> None:
        """Sequences ``rows`` (default all) start a new video at their next decode."""
        self._check_open()
        if rows is None:
            self._frames = None if self._frames is None else [0] * len(self._frames)
            return
        for r in self._check_rows(rows, None, self.sequences or 0):
            self._frames[r] = 0

    def close(self) -> None:
        """Free the graphs and the arena; the decoder is unusable after (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self._graphs is not None:
            self._graphs.clear()
        self._programs.clear()
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    def _stage(self, rows: tuple[int, ...]) -> str:
        start = [r for r in rows if self._frames[r] == 0]
        if start and len(start) < len(rows):
            going = [r for r in rows if self._frames[r] > 0]
            raise ValueError(f"rows must all start a video or all continue one: rows {start} "
                             f"start, rows {going} continue (reset them, or decode them apart)")
        return "first" if start else "steady"

    @staticmethod
    def _check_rows(rows, batch: int | None, sequences: int) -> tuple[int, ...]:
        """Distinct host ints in [0, sequences), ``batch`` of them when given."""
        if isinstance(rows, torch.Tensor):
            rows = rows.tolist()
        try:
            rows = tuple(rows)
        except TypeError:
            rows = (rows,)
        bad = [r for r in rows if isinstance(r, bool) or not isinstance(r, int)
               or not 0 <= r < sequences]
        if bad or len(set(rows)) != len(rows) or (batch is not None and len(rows) != batch):
            count = "" if batch is None else f"{batch} "
            raise ValueError(f"rows must be {count}distinct integers in [0, {sequences}) (the "
                             f"decoder's sequences), got {list(rows)}")
        return rows
