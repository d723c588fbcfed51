"""The rows of a streaming coder: what a streaming decoder (`StreamingVAEDecoder`,
`TinyStreamingDecoder`) and a streaming encoder (`StreamingVAEEncoder`,
`TinyStreamingEncoder`) keep per sequence and do the same way.

A coder holds S sequences (rows of one pool); each goes on with its own video, its
state in one persistent arena (`CacheArena`) sized at the first call. A call names
the rows its batch continues (host ints, default 0..B-1, distinct); the rows of one
call must all start a video ("first") or all continue one ("steady"), the two stages
of the chunk program. On CUDA each chunk is one graph replay (`framekv.graphs.
GraphCache`) keyed on the stage, the input's frames (the program) and the batch; on
CPU, or with ``use_graphs=False``, the same program runs eagerly. A row's state goes
to the host and back (`snapshot` / `restore`), into any row of a coder of the same
layout and input size, so a stream can be swapped out, checkpointed or moved; `reset`
starts rows over. Nothing changes on a refused call.
"""
from __future__ import annotations

import torch

from framekv.graphs import GraphCache, GraphKey, owner_token
from framekv.specs.checks import check_flag

from .vae_cache import CacheArena, CacheLayout

STAGES = ("first", "steady")


class CoderRows:
    """The rows of the module doc. Subclasses set ``sequences``, ``device``, ``dtype``,
    ``use_graphs`` (then call `_start_rows`) and define ``ROLE`` ("decoder" or
    "encoder"), ``INPUT`` (the input's name: the chunk program's first argument),
    ``SIZE_KEY`` (the input size's name in a snapshot), ``PROGRAM`` (the graph keys'
    program name), ``MISMATCH`` (why a state does not fit, in `restore`'s error),
    ``_check_input`` (the input's checks -> B, F, (H, W)), ``_check_frames`` (the
    frame count for a stage), ``_capture_input`` (zeros a capture runs on),
    ``_layout`` (an input size's `CacheLayout`) and ``_chunk(first, write)`` (the chunk
    program ``fn(<INPUT>, rows)``)."""

    CACHE_CHANNELS_LAST = False   # the arena's layout (`CacheArena`)

    @staticmethod
    def _graphs_on(use_graphs, device: torch.device) -> bool:
        """``use_graphs`` checked (default True), and only on CUDA."""
        graphs = True if use_graphs is None else check_flag("use_graphs", use_graphs)
        return graphs and device.type == "cuda"

    def _start_rows(self) -> None:
        """No row run yet, no arena, graphs or programs (the constructors' end, once
        ``sequences``, ``device`` and ``use_graphs`` are set)."""
        self._frames = None if self.sequences is None else [0] * self.sequences
        self._cache: CacheArena | None = None
        self._programs: dict = {}
        self._keys: dict = {}
        self._graphs = GraphCache(self.device) if self.use_graphs else None
        self.closed = False

    # ------------------------------------------------------------------ a chunk
    @torch.no_grad()
    def _run(self, x: torch.Tensor, rows) -> torch.Tensor:
        """One chunk of rows ``rows`` (module doc): the input checked, the arena sized
        on first use, one program run (replayed on CUDA); a fresh output."""
        self._check_open()
        B, F, size = self._check_input(x)
        S = self.sequences or B
        rows = self._check_rows(range(B) if rows is None else rows, B, S)
        stage = self._stage(rows)
        self._check_frames(F, stage)
        self._ensure(S, size)
        # pinned, not waited for: a pageable copy would wait for all the stream's work
        index = torch.tensor(rows, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        inputs = {self.INPUT: x.to(self.dtype).contiguous(),  # [B, C, F, H, W]
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
        """Sequence ``row``'s video state on the host: {"frames": input frames run since
        its video started, "cache": a host copy of each of its arena entries (empty
        before the first call), SIZE_KEY: the input (H, W) they are sized for (None
        before it)}, for `restore` into any row of a coder of the same layout and size.
        The copies share no memory with the coder (on a CPU device too), so the row may
        run another video meanwhile."""
        self._frames_of(row)                         # checks row
        if self._cache is None:
            return {"frames": self._frames[row], "cache": [], self.SIZE_KEY: None}
        return {"frames": self._frames[row],
                "cache": [t[row].to("cpu", copy=True).contiguous() for t in self._cache.tensors],
                self.SIZE_KEY: tuple(self._cache.layout.latent_size)}

    @torch.no_grad()
    def restore(self, row: int, state: dict) -> None:
        """Sequence ``row`` goes on with the video ``state`` (`snapshot`) holds; a coder
        that has not run yet sizes its arena for the state's input size first.
        ValueError for a state that does not fit (nothing changed)."""
        self._frames_of(row)
        cache = state["cache"]
        if not cache:                                 # nothing run yet
            self.reset(rows=[row])
            return
        if self._cache is None and state.get(self.SIZE_KEY) is not None:
            self._ensure(self.sequences, tuple(state[self.SIZE_KEY]))
        have = [] if self._cache is None else self._cache.tensors
        want = [(tuple(t.shape[1:]), t.dtype) for t in have]
        got = [(tuple(t.shape), t.dtype) for t in cache]
        if want != got:
            raise ValueError(f"state's {self.ROLE} cache is {got}, this {self.ROLE}'s {want} "
                             f"({self.MISMATCH})")
        for t, x in zip(have, cache):
            t[row].copy_(x)
        self._frames[row] = int(state["frames"])

    @torch.no_grad()
    def _capture(self, batch: int, frames: int, size) -> int:
        """Capture both stages' chunk graphs for ``batch`` sequences, ``frames`` chunk
        frames (`_capture_input`'s unit) and input size ``size``; returns how many."""
        self._check_open()
        if not self.use_graphs:
            raise ValueError(f"capture() needs use_graphs=True on a CUDA device, got "
                             f"use_graphs={self.use_graphs} on {self.device}")
        for name, v, high in (("batch", batch, self.sequences), ("frames", frames, None)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v > (high or v):
                raise ValueError(f"{name} must be an integer in [1, {high or 'inf'}], got {v!r}")
        size = self._check_size(size)
        self._ensure(self.sequences or batch, size)
        captured = 0
        for stage in STAGES:
            inputs = {self.INPUT: self._capture_input(stage, batch, frames, size),
                      "rows": torch.arange(batch, device=self.device)}
            key = self._key(stage, inputs)
            if key not in self._graphs:
                self._graphs.capture(key, self._program(stage), inputs,
                                     warmup_fn=self._program(stage, write=False))
                captured += 1
        return captured

    def _check_size(self, size) -> tuple[int, int]:
        size = tuple(size) if isinstance(size, (tuple, list)) else ()
        if len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 1
                                 for v in size):
            raise ValueError(f"{self.SIZE_KEY} must be (H, W) positive integers, got {size!r}")
        return size

    def _frames_of(self, row: int) -> int:
        S = self.sequences or 0
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < S:
            raise ValueError(f"row must be an integer in [0, {S}) (the {self.ROLE}'s "
                             f"sequences), got {row!r}")
        return self._frames[row]

    @property
    def state(self) -> tuple[int, ...]:
        """Input frames run per sequence since its video started (empty while S is
        unknown)."""
        return tuple(self._frames or ())

    @property
    def arena_bytes(self) -> int:
        """Bytes the carried arena maps (0 before the first call and after `close`)."""
        return 0 if self._cache is None else self._cache.nbytes

    @property
    def graph_count(self) -> int:
        """Chunk graphs captured (0 when eager)."""
        return 0 if self._graphs is None else len(self._graphs)

    def reset(self, rows=None) -> None:
        """Sequences ``rows`` (default all) start a new video at their next call."""
        self._check_open()
        if rows is None:
            self._frames = None if self._frames is None else [0] * len(self._frames)
            return
        for r in self._check_rows(rows, None, self.sequences or 0):
            self._frames[r] = 0

    def close(self) -> None:
        """Free the graphs and the arena; the coder is unusable after (idempotent)."""
        if self.closed:
            return
        self.closed = True
        if self._graphs is not None:
            self._graphs.clear()
        self._programs.clear()
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    # ------------------------------------------------------------------ internals
    def _stage(self, rows: tuple[int, ...]) -> str:
        done = self._frames or [0] * (max(rows) + 1)
        start = [r for r in rows if done[r] == 0]
        if start and len(start) < len(rows):
            going = [r for r in rows if done[r] > 0]
            raise ValueError(f"rows must all start a video or all continue one: rows {start} "
                             f"start, rows {going} continue (reset them, or run them apart)")
        return "first" if start else "steady"

    def _check_rows(self, rows, batch: int | None, sequences: int) -> tuple[int, ...]:
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
                             f"{self.ROLE}'s sequences), got {list(rows)}")
        return rows

    def _ensure(self, sequences: int, size: tuple[int, int]) -> None:
        """Size the arena for S sequences at input size ``size`` on first use."""
        size = tuple(size)
        if self._cache is None:
            self._cache = CacheArena(self._layout(size), sequences, self.device,
                                     channels_last=self.CACHE_CHANNELS_LAST)
            self.sequences = sequences
            self._frames = self._frames or [0] * sequences
        elif self._cache.layout.latent_size != size:
            raise ValueError(f"{self.INPUT} must be {list(self._cache.layout.latent_size)} (H, "
                             f"W), the size the {self.ROLE}'s arena was sized for, got "
                             f"{list(size)}")

    def _program(self, stage: str, write: bool = True):
        fn = self._programs.get((stage, write))
        if fn is None:
            fn = self._programs[(stage, write)] = self._chunk(stage == "first", write)
        return fn

    def _key(self, stage: str, inputs: dict) -> GraphKey:
        """The key of a chunk graph: stage and frames in the program, batch in ``batch``."""
        x = inputs[self.INPUT]
        # built once per stage and input shape: a replayed chunk builds no key
        key = self._keys.get((stage, x.shape))
        if key is None:
            key = self._keys[(stage, x.shape)] = GraphKey.build(
                owner=owner_token(self), inputs=inputs, batch=x.shape[0],
                program=f"{self.PROGRAM}:{stage}:{x.shape[2]}f")
        return key

    def _check_video(self, x, channels: int, what: str) -> tuple[int, int, int, int]:
        """``x`` a floating [B, channels, F, H, W] tensor on the device -> B, F, H, W."""
        if not isinstance(x, torch.Tensor) or x.dim() != 5:
            got = f"ndim {x.dim()}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{self.INPUT} must be a [B, C, F, H, W] tensor, got {got}")
        B, C, F, H, W = x.shape
        if C != channels or min(B, F, H, W) < 1 or not x.is_floating_point():
            raise ValueError(f"{self.INPUT} must be a floating [B, {channels}, F, H, W] tensor "
                             f"({what}, sizes >= 1), got {list(x.shape)} {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"{self.INPUT} must be on the {self.ROLE}'s device {self.device}, "
                             f"got {x.device}")
        return B, F, H, W

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"this {type(self).__name__} was closed: its arena and graphs "
                               "are freed; build a new one")


class DecoderRows(CoderRows):
    """A streaming decoder's rows: `decode` latents [B, C, F, H, W] -> frames; any
    number of latent frames per chunk. Subclasses set ``latent_channels`` besides
    `CoderRows`' attributes."""

    ROLE, INPUT, SIZE_KEY = "decoder", "latents", "latent_size"

    def decode(self, latents: torch.Tensor, rows=None) -> torch.Tensor:
        """Decode the next chunk of sequences ``rows``: latents [B, C, F, H, W] (batch row
        i is sequence rows[i]; host ints, default 0..B-1) -> frames [B, 3, F', 8H, 8W]
        in [-1, 1], the decoder's dtype. The rows must all start a video or all
        continue one."""
        return self._run(latents, rows)

    def capture(self, batch: int, frames: int, latent_size) -> int:
        """Capture the chunk graphs of both stages for ``batch`` sequences (the first
        ``batch`` rows at capture; any rows at replay) and ``frames`` latent frames of
        size ``latent_size`` (H, W), ahead of the first decode (a server's warm-up).
        Sizes the arena as a decode would. No sequence's state changes. Returns the
        graphs captured by this call."""
        return self._capture(batch, frames, latent_size)

    def frames_decoded(self, row: int) -> int:
        """Latent frames sequence ``row`` has decoded since its video started."""
        return self._frames_of(row)

    def _check_input(self, latents):
        B, F, H, W = self._check_video(latents, self.latent_channels,
                                       "the decoder's latent channels")
        return B, F, (H, W)

    def _check_frames(self, frames: int, stage: str) -> None:
        """Any number of latent frames decodes."""

    def _capture_input(self, stage: str, batch: int, frames: int, size) -> torch.Tensor:
        return torch.zeros(batch, self.latent_channels, frames, *size, device=self.device,
                           dtype=self.dtype)


class EncoderRows(CoderRows):
    """A streaming encoder's rows: `encode` frames [B, 3, F, H, W] in [-1, 1] -> latents
    [B, C, F', H / 8, W / 8], F' = 1 + k for a video's first chunk of 1 + 4k frames
    (k >= 0), k for a later chunk of 4k (k >= 1). Subclasses set ``latent_channels``
    besides `CoderRows`' attributes."""

    ROLE, INPUT, SIZE_KEY = "encoder", "frames", "frame_size"
    #: frames per latent frame (time), pixels per latent pixel (height and width)
    TIME, SPACE = 4, 8

    def encode(self, frames: torch.Tensor, rows=None) -> torch.Tensor:
        """Encode the next chunk of sequences ``rows``: frames [B, 3, F, H, W] in [-1, 1]
        (batch row i is sequence rows[i]; host ints, default 0..B-1; H and W multiples
        of 8) -> latents [B, C, F', H / 8, W / 8] in the encoder's dtype
        (`latent_frames`). The rows must all start a video (F = 1 + 4k) or all continue
        one (F = 4k)."""
        return self._run(frames, rows)

    def capture(self, batch: int, latent_frames: int, frame_size) -> int:
        """Capture the chunk graphs of both stages for ``batch`` sequences (the first
        ``batch`` rows at capture; any rows at replay) giving ``latent_frames`` latent
        frames each (a video's first chunk of 1 + 4 (F - 1) frames, a later one of 4 F)
        of size ``frame_size`` (H, W), ahead of the first encode. Sizes the arena as an
        encode would. No sequence's state changes. Returns the graphs captured."""
        return self._capture(batch, latent_frames, frame_size)

    def frames_encoded(self, row: int) -> int:
        """Video frames sequence ``row`` has encoded since its video started."""
        return self._frames_of(row)

    @classmethod
    def latent_frames(cls, frames: int, first: bool) -> int:
        """Latent frames a chunk of ``frames`` video frames encodes to: 1 + (F - 1) / 4
        for a video's first chunk, F / 4 for a later one. ValueError for a count that
        is not 1 + 4k (first) or 4k, k >= 1 (later)."""
        T = cls.TIME
        ok = (frames % T == 1) if first else (frames % T == 0 and frames >= T)
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1 or not ok:
            want = "1 + 4k frames (k >= 0) for rows that start a video" if first else \
                "4k frames (k >= 1) for rows that continue one"
            raise ValueError(f"frames must be {want}, got {frames!r}")
        return (frames - 1) // T + 1 if first else frames // T

    @staticmethod
    def video_frames(latent_frames: int, first: bool) -> int:
        """Video frames a chunk must take to give ``latent_frames``: 1 + 4 (F - 1) for a
        video's first chunk, 4 F for a later one."""
        return 1 + 4 * (latent_frames - 1) if first else 4 * latent_frames

    def _check_input(self, frames):
        B, F, H, W = self._check_video(frames, 3, "RGB")
        if H % self.SPACE or W % self.SPACE:
            raise ValueError(f"frames must have H and W multiples of {self.SPACE} (the "
                             f"encoder's spatial factor), got [{H}, {W}]")
        return B, F, (H, W)

    def _check_frames(self, frames: int, stage: str) -> None:
        self.latent_frames(frames, stage == "first")

    def _check_size(self, size) -> tuple[int, int]:
        size = super()._check_size(size)
        if any(v % self.SPACE for v in size):
            raise ValueError(f"frame_size must be multiples of {self.SPACE}, got {size!r}")
        return size

    def _capture_input(self, stage: str, batch: int, frames: int, size) -> torch.Tensor:
        return torch.zeros(batch, 3, self.video_frames(frames, stage == "first"), *size,
                           device=self.device, dtype=self.dtype)
