"""`TinyStreamingDecoder`: Wan 2.1 latents to frames chunk by chunk with a small network
of per-frame 2-D convolutions, interchangeable with `StreamingVAEDecoder`.

Weights are in the layout of TAEHV's ``taew2_1`` (MIT, madebyollin/taehv), so its
checkpoints load as they are.

Contract. ``decode(latents, rows)`` takes latents [B, C, F, H, W] (C = 16 for Wan 2.1)
as the transformer gives them (no de-normalisation, as the ``taew2_1`` weights expect)
and returns frames [B, 3, F', 8H, 8W] in [-1, 1], in the decoder's dtype, a fresh
tensor, with F' = 4F - 3 for a chunk that starts a video and 4F for a later one (as
`StreamingVAEDecoder.video_frames`). A video decoded in chunks of any split,
concatenated along time, equals its decode in one call.

The network over a video's latent frames z_t (every conv is 2-D over one frame, 3x3
unless noted)::

    x_t = relu(stem(3 tanh(z_t / 3)))                                  [256, H, W]
    for stage s = 0, 1, 2 (width C = 256, 128, 64; time factor k = 1, 2, 2):
        3 times: x_t = relu(c3(relu(c2(relu(c1([x_t, x_{t-1}]))))) + x_t)
                 (x_{t-1}: the block's input one frame earlier, zeros before a video's
                 first frame)
        y = grow(x_t)            1x1, C -> k C: channel group j is frame k t + j
        x = narrow(up2(y))       nearest 2x upsampling, 3x3 to the next width, no bias
    rgb_t = head(relu(x_t))                                            [3, 8H, 8W]
    frames = 2 clamp(rgb, 0, 1) - 1, the first 3 frames of a video dropped

(``grow`` runs before the upsampling, the checkpoint's network after it: a 1x1 conv
commutes with nearest upsampling, so the values are the same over a quarter of the
pixels.) Widths are the checkpoint layout's; `TinyDecoderNet` takes smaller ones for
a network of the same structure. Stage 0 runs F frames at
H x W, stage 1 F frames at 2H x 2W, stage 2 2F frames at 4H x 4W, the head 4F.

State carried between chunks, per sequence: each of the 9 blocks' last input frame,
[256, H, W] x 3, [128, 2H, 2W] x 3, [64, 4H, 4W] x 3, in one arena ([S, ...] per
block) sized at the first decode; a chunk reads them for its first frame at every
stage and writes its last. A chunk that starts a video reads zeros and drops 3 frames.

Rows, stages ("first" or "steady", never mixed in one call), graphs (one CUDA graph
per stage, batch, frames and latent size; eager on CPU or with ``use_graphs=False``),
`snapshot` / `restore` and `close` behave as `StreamingVAEDecoder`'s.
"""
from __future__ import annotations

import os

import torch

from framekv.graphs import GraphCache, GraphKey, owner_token
from framekv.specs.checks import check_count, check_flag

from .tiny_net import WIDTHS, TinyDecoderNet, random_init, read_taehv, unset_net
from .vae import StreamingVAEDecoder
from .vae_graph import STAGES, CacheArena, CacheLayout, DecoderRows

__all__ = ["TinyDecoderNet", "TinyStreamingDecoder", "WIDTHS", "random_init"]

TRIM = 3                     # frames dropped at a video's start (4F - 3 frames)


def _chunk_program(net: TinyDecoderNet, arena: CacheArena, *, first: bool, write: bool = True):
    """``fn(latents, rows) -> frames`` for one chunk: latents [B, C, F, H, W] in the net's
    dtype, rows [B] int64 (distinct); reads (zeros when ``first``) and, with ``write``,
    writes the rows' carried frames (a graph's warm-up must not advance them)."""
    layout = arena.layout

    @torch.no_grad()
    def fn(latents: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        B = latents.shape[0]
        if first:
            memory = [torch.zeros(B, *s, dtype=d, device=latents.device)
                      for s, d in zip(layout.shapes, layout.dtypes)]
        else:
            memory = arena.gather(rows)
        rgb, carried = net.stream(latents, memory)                  # [B, 3, 4F, 8H, 8W]
        if write:
            arena.scatter(rows, carried)
        if first:
            rgb = rgb[:, :, TRIM:]
        return (rgb.clamp(0, 1) * 2 - 1).contiguous()

    return fn


class TinyStreamingDecoder(DecoderRows):
    """Decode Wan 2.1 latents chunk by chunk with a `TinyDecoderNet` (module doc),
    each sequence's carried frames kept between calls.

    Args:
        net: a `TinyDecoderNet`, used as it is (moved to ``device`` when elsewhere).
        sequences: S, the sequences the decoder holds (default: the batch of the first
            `decode` or `capture`).
        use_graphs: replay each chunk as a CUDA graph (default True on CUDA; always
            eager on CPU).
        device: default the net's.

    Attributes: net, device, dtype (the net's: frames come back in it), sequences (None
    until known), use_graphs, latent_channels.
    """

    video_frames = staticmethod(StreamingVAEDecoder.video_frames)

    def __init__(self, net: TinyDecoderNet, *, sequences=None, use_graphs=None, device=None):
        from framekv.ops import resolve_device

        if not isinstance(net, TinyDecoderNet):
            raise ValueError(f"net must be a TinyDecoderNet, got {type(net).__name__}")
        self.sequences = check_count("sequences", sequences)
        self.device = resolve_device(next(net.parameters()).device if device is None else device)
        self.net = net.to(self.device).eval().requires_grad_(False)
        self.dtype, self.latent_channels = next(net.parameters()).dtype, net.latent_channels
        graphs = True if use_graphs is None else check_flag("use_graphs", use_graphs)
        self.use_graphs = graphs and self.device.type == "cuda"
        self._frames = None if sequences is None else [0] * sequences
        self._cache: CacheArena | None = None
        self._programs: dict = {}
        self._graphs = GraphCache(self.device) if self.use_graphs else None
        self.closed = False

    @classmethod
    def random(cls, *, seed: int = 0, latent_channels: int = 16, device=None, dtype=None,
               widths: tuple[int, ...] = WIDTHS, **kwargs) -> "TinyStreamingDecoder":
        """A decoder of random weights drawn from ``seed`` (`random_init`), of the
        checkpoint layout's widths unless ``widths`` says otherwise (`TinyDecoderNet`);
        dtype default bf16 on CUDA, fp32 on CPU; ``kwargs`` go to the constructor."""
        check_count("latent_channels", latent_channels)
        net = unset_net(latent_channels, widths)
        random_init(net, seed)
        return cls._of(net, device, dtype, kwargs)

    @classmethod
    def from_file(cls, path, *, device=None, dtype=None, **kwargs) -> "TinyStreamingDecoder":
        """A decoder of a local TAEHV checkpoint (``taew2_1.pth``, ``torch.load`` with
        ``weights_only``, or ``.safetensors``): its decoder keys, the encoder's ignored;
        latent channels from ``decoder.1.weight``; ``kwargs`` go to the constructor.
        ValueError naming the path for a file that is absent or unreadable, or the keys
        for another layout (`TinyDecoderNet.load_taehv`)."""
        state = read_taehv(path)
        stem = state.get("decoder.1.weight")
        channels = stem.shape[1] if isinstance(stem, torch.Tensor) and stem.dim() == 4 else 16
        net = unset_net(channels)
        net.load_taehv(state, where=f"checkpoint {os.fspath(path)!r}")
        return cls._of(net, device, dtype, kwargs)

    @classmethod
    def _of(cls, net, device, dtype, kwargs) -> "TinyStreamingDecoder":
        from framekv.ops import resolve_device

        dev = resolve_device(device)
        dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        return cls(net.to(dev, dtype), device=dev, **kwargs)

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, rows=None) -> torch.Tensor:
        """Decode the next chunk of sequences ``rows``: latents [B, C, F, H, W] (batch row
        i is sequence rows[i]; host ints, default 0..B-1) -> frames [B, 3, F', 8H, 8W]
        in [-1, 1], the decoder's dtype (module doc). The rows must all start a video or
        all continue one."""
        self._check_open()
        B, F_, H, W = self._check_latents(latents)
        S = self.sequences or B
        rows = self._check_rows(range(B) if rows is None else rows, B, S)
        self._ensure(S, (H, W))
        stage = self._stage(rows)
        inputs = {"latents": latents.to(self.dtype).contiguous(),
                  "rows": torch.tensor(rows, dtype=torch.int64, device=self.device)}
        if self.use_graphs:
            out = self._graphs.run(self._key(stage, inputs), self._program(stage), inputs,
                                   warmup_fn=self._program(stage, write=False)).clone()
        else:
            out = self._program(stage)(**inputs)
        for r in rows:
            self._frames[r] += F_
        return out

    def snapshot(self, row: int) -> dict:
        """Sequence ``row``'s video state on the host: {"frames": latent frames decoded,
        "cache": its carried frames, a host copy per block (empty before the first
        decode), "latent_size": (H, W) they are sized for (None before it)}, for
        `restore` into any row of a decoder of the same layout and latent size. The
        copies share no memory with the decoder, so the row may go on meanwhile."""
        self.frames_decoded(row)
        if self._cache is None:
            return {"frames": self._frames[row], "cache": [], "latent_size": None}
        return {"frames": self._frames[row],
                "cache": [t[row].to("cpu", copy=True) for t in self._cache.tensors],
                "latent_size": tuple(self._cache.layout.latent_size)}

    @torch.no_grad()
    def restore(self, row: int, state: dict) -> None:
        """Sequence ``row`` goes on with the video ``state`` (`snapshot`) holds; a decoder
        that has not decoded yet sizes its arena for the state's latent size first.
        ValueError for a state of another layout or latent size (nothing changed)."""
        self.frames_decoded(row)
        cache = state["cache"]
        if not cache:
            self.reset(rows=[row])
            return
        if self._cache is None and state.get("latent_size") is not None:
            self._ensure(self.sequences, tuple(state["latent_size"]))
        have = [] if self._cache is None else self._cache.tensors
        want = [(tuple(t.shape[1:]), t.dtype) for t in have]
        got = [(tuple(t.shape), t.dtype) for t in cache]
        if want != got:
            raise ValueError(f"state's carried frames are {got}, this decoder's {want} "
                             "(another layout, dtype or latent size)")
        for t, x in zip(have, cache):
            t[row].copy_(x)
        self._frames[row] = int(state["frames"])

    @torch.no_grad()
    def capture(self, batch: int, frames: int, latent_size) -> int:
        """Capture the chunk graphs of both stages for ``batch`` sequences and ``frames``
        latent frames of size ``latent_size`` (H, W) ahead of the first decode, as
        `StreamingVAEDecoder.capture`. No sequence's state changes. Returns the graphs
        captured by this call."""
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

    # ------------------------------------------------------------------ internals
    def _ensure(self, sequences: int, latent_size: tuple[int, int]) -> None:
        """Size the arena for S sequences at ``latent_size`` on first use."""
        if self._cache is None:
            shapes = self.net.memory_shapes(latent_size)
            layout = CacheLayout(slots=len(shapes), shapes=shapes, latent_size=tuple(latent_size),
                                 dtypes=(self.dtype,) * len(shapes))
            self._cache = CacheArena(layout, sequences, self.device)
            self.sequences = sequences
            self._frames = self._frames or [0] * sequences
        elif self._cache.layout.latent_size != tuple(latent_size):
            raise ValueError(f"latents must be {list(self._cache.layout.latent_size)} (H, W), the "
                             f"size the decoder's arena was sized for, got {list(latent_size)}")

    def _program(self, stage: str, write: bool = True):
        fn = self._programs.get((stage, write))
        if fn is None:
            fn = _chunk_program(self.net, self._cache, first=stage == "first", write=write)
            self._programs[(stage, write)] = fn
        return fn

    def _key(self, stage: str, inputs: dict) -> GraphKey:
        latents = inputs["latents"]
        return GraphKey.build(owner=owner_token(self), inputs=inputs, batch=latents.shape[0],
                              program=f"tiny-decode:{stage}:{latents.shape[2]}f")

    def _check_latents(self, latents) -> tuple[int, int, int, int]:
        if not isinstance(latents, torch.Tensor) or latents.dim() != 5:
            got = (f"ndim {latents.dim()}" if isinstance(latents, torch.Tensor)
                   else type(latents).__name__)
            raise ValueError(f"latents must be a [B, C, F, H, W] tensor, got {got}")
        B, C, F_, H, W = latents.shape
        z = self.latent_channels
        if C != z or min(B, F_, H, W) < 1 or not latents.is_floating_point():
            raise ValueError(f"latents must be a floating [B, {z}, F, H, W] tensor (the "
                             f"decoder's latent channels, sizes >= 1), got "
                             f"{list(latents.shape)} {latents.dtype}")
        if latents.device != self.device:
            raise ValueError(f"latents must be on the decoder's device {self.device}, got "
                             f"{latents.device}")
        return B, F_, H, W

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this TinyStreamingDecoder was closed: its arena and graphs are "
                               "freed; build a new one")
