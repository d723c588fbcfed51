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

Graph keys (`DecoderRows._key`) hold the batch, the frames and the stage ("first": the
chunk starts the rows' videos; "steady": every row continues one)."""
from __future__ import annotations

import dataclasses
import math

import torch

from framekv.graphs import GraphCache, GraphKey, owner_token

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
    is [S, C_l, 2, H_l, W_l], zero-filled, at a fixed address for the arena's life.
    ``channels_last``: stored as ``rows_last`` [S, 2, H_l, W_l, C_l] (the fused
    program's layout), ``tensors`` being views of them (else ``rows_last`` is None)."""

    def __init__(self, layout: CacheLayout, sequences: int, device: torch.device, *,
                 channels_last: bool = False):
        self.layout, self.sequences = layout, sequences
        self._arena = make_arena(device, carved_bytes(layout.entry_bytes(sequences)))
        last = (lambda s: (*s[1:], s[0])) if channels_last else (lambda s: s)
        made = [self._arena.zeros((sequences, *last(s)), d, name=f"vae_cache{i}")
                for i, (s, d) in enumerate(zip(layout.shapes, layout.dtypes))]
        self.rows_last = made if channels_last else None
        self.tensors = [t.movedim(-1, 1) for t in made] if channels_last else made

    @property
    def nbytes(self) -> int:
        """Bytes the arena maps (the tensors, aligned, rounded up to its chunk)."""
        return 0 if self._arena.closed else self._arena.mapped_bytes

    def gather(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Rows ``rows`` [B] int64 of each entry, copied, as stored (channels last or not)."""
        return [t.index_select(0, rows) for t in self.rows_last or self.tensors]

    def scatter(self, rows: torch.Tensor, cache: list) -> None:
        """Write ``cache`` (`gather`'s layout) back to rows ``rows`` (distinct)."""
        for t, c in zip(self.rows_last or self.tensors, cache):
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


class DecoderRows:
    """What a streaming decoder (`StreamingVAEDecoder`, `TinyStreamingDecoder`) keeps per
    sequence and does the same way: latent frames decoded per row (``_frames``), the
    arena (``_cache``), the graphs (``_graphs``, ``_programs``), ``closed``; rows checked,
    reset and staged ("first" or "steady"); `decode`, `snapshot`, `restore`, `capture`.
    Subclasses set those attributes and ``sequences``, ``device``, ``dtype``,
    ``use_graphs``, ``latent_channels``, and define ``PROGRAM`` (the graph keys' program
    name), ``MISMATCH`` (why a state does not fit, in `restore`'s error), ``_layout``
    (a latent size's `CacheLayout`) and ``_chunk(first, write)`` (the chunk program)."""

    CACHE_CHANNELS_LAST = False   # the arena's layout (`CacheArena`)

    def _start_rows(self) -> None:
        """No row decoded yet, no arena, graphs or programs (the constructors' end, once
        ``sequences``, ``device`` and ``use_graphs`` are set)."""
        self._frames = None if self.sequences is None else [0] * self.sequences
        self._cache: CacheArena | None = None
        self._programs: dict = {}
        self._graphs = GraphCache(self.device) if self.use_graphs else None
        self.closed = False

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, rows=None) -> torch.Tensor:
        """Decode the next chunk of sequences ``rows``: latents [B, C, F, H, W] (batch row
        i is sequence rows[i]; host ints, default 0..B-1) -> frames [B, 3, F', 8H, 8W]
        in [-1, 1], the decoder's dtype. The rows must all start a video or all
        continue one."""
        self._check_open()
        B, F, H, W = self._check_latents(latents)
        S = self.sequences or B
        rows = self._check_rows(range(B) if rows is None else rows, B, S)
        self._ensure(S, (H, W))
        stage = self._stage(rows)
        # pinned, not waited for: a pageable copy would wait for all the stream's work
        index = torch.tensor(rows, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        inputs = {"latents": latents.to(self.dtype).contiguous(),  # [B, C, F, H, W]
                  "rows": index.to(self.device, non_blocking=True)}
        if self.use_graphs:
            out = self._graphs.run(self._key(stage, inputs), self._program(stage), inputs,
                                   warmup_fn=self._program(stage, write=False)).clone()
        else:
            out = self._program(stage)(**inputs)
        for r in rows:
            self._frames[r] += F
        return out

    def snapshot(self, row: int) -> dict:
        """Sequence ``row``'s video state on the host: {"frames": latent frames decoded,
        "cache": a host copy of each of its arena entries (empty before the first
        decode), "latent_size": (H, W) they are sized for (None before it)}, for
        `restore` into any row of a decoder of the same layout and latent size. The
        copies share no memory with the decoder (on a CPU device too), so the row may
        decode another video meanwhile."""
        self.frames_decoded(row)                      # checks row
        if self._cache is None:
            return {"frames": self._frames[row], "cache": [], "latent_size": None}
        return {"frames": self._frames[row],
                "cache": [t[row].to("cpu", copy=True).contiguous() for t in self._cache.tensors],
                "latent_size": tuple(self._cache.layout.latent_size)}

    @torch.no_grad()
    def restore(self, row: int, state: dict) -> None:
        """Sequence ``row`` goes on with the video ``state`` (`snapshot`) holds; a decoder
        that has not decoded yet sizes its arena for the state's latent size first.
        ValueError for a state that does not fit (nothing changed)."""
        self.frames_decoded(row)
        cache = state["cache"]
        if not cache:                                 # nothing decoded yet
            self.reset(rows=[row])
            return
        if self._cache is None and state.get("latent_size") is not None:
            self._ensure(self.sequences, tuple(state["latent_size"]))
        have = [] if self._cache is None else self._cache.tensors
        want = [(tuple(t.shape[1:]), t.dtype) for t in have]
        got = [(tuple(t.shape), t.dtype) for t in cache]
        if want != got:
            raise ValueError(f"state's decoder cache is {got}, this decoder's {want} "
                             f"({self.MISMATCH})")
        for t, x in zip(have, cache):
            t[row].copy_(x)
        self._frames[row] = int(state["frames"])

    @torch.no_grad()
    def capture(self, batch: int, frames: int, latent_size) -> int:
        """Capture the chunk graphs of both stages for ``batch`` sequences (the first
        ``batch`` rows at capture; any rows at replay) and ``frames`` latent frames of
        size ``latent_size`` (H, W), ahead of the first decode (a server's warm-up).
        Sizes the arena as a decode would. No sequence's state changes. Returns the
        graphs captured by this call."""
        self._check_open()
        if not self.use_graphs:
            raise ValueError(f"capture() needs use_graphs=True on a CUDA device, got "
                             f"use_graphs={self.use_graphs} on {self.device}")
        for name, v, high in (("batch", batch, self.sequences), ("frames", frames, None)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v > (high or v):
                raise ValueError(f"{name} must be an integer in [1, {high or 'inf'}], got {v!r}")
        size = tuple(latent_size) if isinstance(latent_size, (tuple, list)) else ()
        if len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                 for v in size):
            raise ValueError(f"latent_size must be (H, W) positive integers, got {latent_size!r}")
        self._ensure(self.sequences or batch, size)
        inputs = {"latents": torch.zeros(batch, self.latent_channels, frames, *size,
                                         device=self.device, dtype=self.dtype),
                  "rows": torch.arange(batch, device=self.device)}
        captured = 0
        for stage in STAGES:
            key = self._key(stage, inputs)
            if key not in self._graphs:
                self._graphs.capture(key, self._program(stage), inputs,
                                     warmup_fn=self._program(stage, write=False))
                captured += 1
        return captured

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

    def _ensure(self, sequences: int, latent_size: tuple[int, int]) -> None:
        """Size the arena for S sequences at ``latent_size`` on first use."""
        latent_size = tuple(latent_size)
        if self._cache is None:
            self._cache = CacheArena(self._layout(latent_size), sequences, self.device,
                                     channels_last=self.CACHE_CHANNELS_LAST)
            self.sequences = sequences
            self._frames = self._frames or [0] * sequences
        elif self._cache.layout.latent_size != latent_size:
            raise ValueError(f"latents must be {list(self._cache.layout.latent_size)} (H, W), the "
                             f"size the decoder's arena was sized for, got {list(latent_size)}")

    def _program(self, stage: str, write: bool = True):
        fn = self._programs.get((stage, write))
        if fn is None:
            fn = self._programs[(stage, write)] = self._chunk(stage == "first", write)
        return fn

    def _key(self, stage: str, inputs: dict) -> GraphKey:
        """The key of a chunk graph: stage and frames in the program, batch in ``batch``."""
        latents = inputs["latents"]
        return GraphKey.build(owner=owner_token(self), inputs=inputs, batch=latents.shape[0],
                              program=f"{self.PROGRAM}:{stage}:{latents.shape[2]}f")

    def _check_latents(self, latents) -> tuple[int, int, int, int]:
        if not isinstance(latents, torch.Tensor) or latents.dim() != 5:
            got = (f"ndim {latents.dim()}" if isinstance(latents, torch.Tensor)
                   else type(latents).__name__)
            raise ValueError(f"latents must be a [B, C, F, H, W] tensor, got {got}")
        B, C, F, H, W = latents.shape
        z = self.latent_channels
        if C != z or min(B, F, H, W) < 1 or not latents.is_floating_point():
            raise ValueError(f"latents must be a floating [B, {z}, F, H, W] tensor (the "
                             f"decoder's latent channels, sizes >= 1), got "
                             f"{list(latents.shape)} {latents.dtype}")
        if latents.device != self.device:
            raise ValueError(f"latents must be on the decoder's device {self.device}, got "
                             f"{latents.device}")
        return B, F, H, W

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} was closed: its arena and graphs "
                               "are freed; build a new one")
