"""A streaming coder's per-sequence state as persistent arena tensors: `CacheLayout` (the
entries' shapes at one input size), `CacheArena` (every sequence's entries, fixed
addresses a captured graph reads and writes), and the Wan VAE's causal caches in their
steady form (`to_steady`, `module_cache`).

diffusers' Wan VAE keeps, per causal conv of its encoder or decoder, a cache list
entry: ``None`` before a video's first call, then the conv input's last steps (up to
``CACHE_T = 2``; one for the encoder's strided time convs, which keep their last input
step only), or, for the decoder's time upsample before its first frame, the marker
``"Rep"``. A causal conv concatenates ``[cache, x]`` and zero-pads the rest of its
kernel's time extent, so a one-step cache ``[c]`` and ``[0, c]`` feed it the same values
and leave the same next cache; ``"Rep"`` runs the time conv zero-padded and caches
``[0, x]``, what a cache of zeros gives. So after a video's first call every entry is
widened to its steady step count with zeros in front (`to_steady`), and every later
call of every sequence runs one shape; the layout is read from an eager dry run
(`CacheLayout.probe`) after the second call, in the steady form.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from framekv.ops.copy_rows import copy_rows_, copy_rows_reference, prepare_copy_rows

from ..arena import carved_bytes, make_arena

#: What `CacheLayout.probe` runs, per part of the VAE: its steps per entry when steady.
_STEADY_STEPS = {"decoder": (2,), "encoder": (1, 2)}


def causal_slots(coder) -> int:
    """Length of a Wan encoder's or decoder's cache list (its causal convs, as diffusers
    counts them: 1x1x1 shortcuts too, which never cache)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    return sum(isinstance(m, WanCausalConv3d) for m in coder.modules())


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """A coder's steady state of one sequence at one input size.

    Attributes:
        slots: the cache list's length (diffusers counts every causal conv; only the
            first ``len(shapes)`` entries are used).
        shapes: per used entry, its shape for one sequence ([C_l, steps, H_l, W_l] for
            the Wan VAE's causal caches).
        dtypes: per used entry, its dtype.
        latent_size: (H, W) of the input it was sized for (the decoder's latents, the
            encoder's frames).
    """

    slots: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    latent_size: tuple[int, int]

    @classmethod
    @torch.no_grad()
    def probe(cls, vae, size: tuple[int, int], device: torch.device,
              part: str = "decoder") -> "CacheLayout":
        """The Wan VAE ``part``'s steady cache at input size ``size``: two calls of one
        sequence's zeros run eagerly (the decoder: two latent frames; the encoder: a
        first frame, then four) and the entries read after the second."""
        coder = getattr(vae, part)
        slots, (H, W) = causal_slots(coder), size
        if part == "decoder":
            x = vae.post_quant_conv(torch.zeros(1, vae.config.z_dim, 2, H, W, device=device,
                                                dtype=vae.dtype))   # [1, C, 2, H, W]
            calls = [(x[:, :, :1], {"first_chunk": True}), (x[:, :, 1:], {"first_chunk": False})]
        else:
            x = torch.zeros(1, 3, 5, H, W, device=device, dtype=vae.dtype)
            calls = [(x[:, :, :1], {}), (x[:, :, 1:], {})]
        cache: list = [None] * slots
        for chunk, kw in calls:
            idx = [0]
            coder(chunk, feat_cache=cache, feat_idx=idx, **kw)
        entries = cache[:idx[0]]
        if any(not isinstance(c, torch.Tensor) or c.dim() != 5
               or c.shape[2] not in _STEADY_STEPS[part] for c in entries):
            raise RuntimeError(f"the {part}'s cache is not {_STEADY_STEPS[part]}-step tensors "
                               "after two calls: this diffusers version caches differently")
        return cls(slots=slots, shapes=tuple(tuple(c.shape[1:]) for c in entries),
                   dtypes=tuple(c.dtype for c in entries), latent_size=(H, W))

    def entry_bytes(self, sequences: int) -> list[int]:
        """Bytes of each arena tensor for ``sequences`` sequences."""
        return [sequences * math.prod(s) * torch.empty((), dtype=d).element_size()
                for s, d in zip(self.shapes, self.dtypes)]


def to_steady(cache: list, layout: CacheLayout, batch: int, device: torch.device) -> list:
    """The cache after a video's first call in its steady form (module doc): ``"Rep"``
    becomes zeros, an entry of fewer steps than the layout's gets zero steps in front."""
    out = []
    for c, shape, dtype in zip(cache, layout.shapes, layout.dtypes):
        if isinstance(c, str):  # diffusers' "Rep": the time conv has seen no frame yet
            c = torch.zeros(batch, *shape, dtype=dtype, device=device)
        elif c.shape[2] < shape[1]:
            c = torch.cat([c.new_zeros(batch, shape[0], shape[1] - c.shape[2], *shape[2:]), c],
                          dim=2)
        if tuple(c.shape) != (batch, *shape):
            raise RuntimeError(f"cache entry {len(out)} is {list(c.shape)} after the first "
                               f"call, expected {[batch, *shape]}")
        out.append(c)
    return out + cache[len(out):]


class CacheArena:
    """Every sequence's state in one persistent arena (`make_arena`): tensor l is [S,
    *shapes[l]], zero-filled, at a fixed address for the arena's life. ``channels_last``:
    stored with the first dimension of each shape last ([S, steps, H_l, W_l, C_l] for
    [C_l, steps, H_l, W_l]) as ``rows_last``, ``tensors`` being views of them in the
    layout's order (else ``rows_last`` is None)."""

    def __init__(self, layout: CacheLayout, sequences: int, device: torch.device, *,
                 channels_last: bool = False):
        self.layout, self.sequences = layout, sequences
        self._arena = make_arena(device, carved_bytes(layout.entry_bytes(sequences)))
        last = (lambda s: (*s[1:], s[0])) if channels_last else (lambda s: s)
        made = [self._arena.zeros((sequences, *last(s)), d, name=f"vae_cache{i}")
                for i, (s, d) in enumerate(zip(layout.shapes, layout.dtypes))]
        self.rows_last = made if channels_last else None
        self.tensors = [t.movedim(-1, 1) for t in made] if channels_last else made
        prepare_copy_rows(torch.device(device))   # no compile inside a chunk's capture

    @property
    def nbytes(self) -> int:
        """Bytes the arena maps (the tensors, aligned, rounded up to its chunk)."""
        return 0 if self._arena.closed else self._arena.mapped_bytes

    def gather(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Rows ``rows`` [B] int64 of each entry, copied, as stored (channels last or not)."""
        return [t.index_select(0, rows) for t in self.rows_last or self.tensors]

    def read(self, rows: torch.Tensor, first: bool) -> list[torch.Tensor]:
        """What a chunk starts from, as stored: zeros for rows that start a video
        (``first``), else `gather`."""
        if first:
            return [t.new_zeros(rows.shape[0], *t.shape[1:]) for t in self.rows_last or self.tensors]
        return self.gather(rows)

    def scatter(self, rows: torch.Tensor, cache: list) -> None:
        """Write ``cache`` (`gather`'s layout) back to rows ``rows`` (distinct)."""
        for t, c in zip(self.rows_last or self.tensors, cache):
            t.index_copy_(0, rows, c)

    def chunk(self, rows: torch.Tensor, first: bool, write: bool) -> "ChunkCache":
        """A chunk's entries of rows ``rows`` (distinct), read and written in place
        (`ChunkCache`): zeros for rows that start a video (``first``); ``write=False``
        leaves the arena as it is (a graph's warm-up)."""
        return ChunkCache(self.rows_last or self.tensors, rows, first, write)

    def close(self) -> None:
        self.tensors = []
        self._arena.close()


class ChunkCache:
    """One chunk's view of its rows' entries in an arena, for programs that copy an
    entry straight into the buffer a conv reads and write its next value straight from
    that buffer, with no per-chunk copy of the state in between (`CacheArena.read`
    and `CacheArena.scatter` make one each way). ``tensors``: the arena's, as stored;
    ``batch``: the rows' count. Entry i reads as zeros until stored when ``first``
    (with ``write`` the rows are zeroed in the arena then, so an entry the chunk never
    stores starts the next one at zero, as the rows' state after a video's first
    chunk is); with ``write`` a store goes to the arena at once (a later `load` in the
    chunk reads it there), without it a copy is held for the rest of the chunk and
    the arena is left alone. A load from the arena and a store to it are one
    `framekv.ops.copy_rows_` each (on CUDA one kernel: no sync, capturable)."""

    def __init__(self, tensors: list, rows: torch.Tensor, first: bool, write: bool):
        self.tensors, self.batch = tensors, rows.shape[0]
        self._rows, self._first, self._write = rows, first, write
        self._held: dict[int, torch.Tensor] = {}
        self._stored: set[int] = set()
        if first and write:
            for t in tensors:
                t.index_fill_(0, rows, 0)

    def empty(self, i: int, steps: int) -> torch.Tensor:
        """A new [batch, steps, *entry i's per-step shape] tensor of its dtype."""
        t = self.tensors[i]
        return t.new_empty(self.batch, steps, *t.shape[2:])

    def load(self, i: int, out: torch.Tensor, steps: slice = slice(None)) -> torch.Tensor:
        """``out`` (any strides, the shape of entry i's ``steps`` for the rows) = those
        steps of entry i (all of them by default), in one pass."""
        if i in self._held:
            return out.copy_(self._held[i][:, steps])
        if self._first and i not in self._stored:
            return out.zero_()
        _copy_rows(out, self.tensors[i][:, steps], src_rows=self._rows)
        return out

    def get(self, i: int) -> torch.Tensor:
        """Entry i of the rows, a new tensor."""
        return self.load(i, self.empty(i, self.tensors[i].shape[1]))

    def store(self, i: int, value: torch.Tensor) -> None:
        """Entry i of the rows = ``value`` (module doc: written, or held)."""
        self._stored.add(i)
        if self._write:
            _copy_rows(self.tensors[i], value, dst_rows=self._rows)
        else:            # a copy: a view would keep its whole buffer alive till the end
            self._held[i] = value.clone()


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, **rows) -> None:
    """`copy_rows_` (one kernel on CUDA, graph-capturable), or its torch reference where
    a last dimension is strided (outside the op's contract)."""
    if all(t.shape[-1] == 1 or t.stride(-1) == 1 for t in (dst, src)):
        copy_rows_(dst, src, **rows)
    else:
        copy_rows_reference(dst, src, **rows)


def module_cache(arena: CacheArena, rows: torch.Tensor, first: bool) -> list:
    """diffusers' cache list for a chunk of ``rows``: all None when they start a video,
    else their steady entries (gathered) and None for the slots that never cache."""
    layout = arena.layout
    if first:
        return [None] * layout.slots
    return arena.gather(rows) + [None] * (layout.slots - len(layout.shapes))
