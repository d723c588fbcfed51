"""`EncodeStage`: the encoder's half of a served step, frames in, each video stream's
input latents out, before the runner's chunk (the sampler reads them as its source).

A scheduler whose streams take video keeps one streaming encoder row per slot of the
pool, as it keeps one decoder row (`framekv.engine.decode_stage`); a stream's encoder
row holds its causal cache (the frames it encoded so far) and leaves with it on a swap
out, a move or a checkpoint. An `EncodePlan` names one step's encoder work::

    swap_outs   rows copied to the host (`snapshot`): each video stream's row state in
                the result's ``parked``
    swap_ins    rows restored from a video stream's row state, or started over (a new
                stream: no state)
    rows        the encoder row (slot) of each video stream of the batch, ``index`` its
                batch row, ``frames`` its chunk's frames [3, n, H, W] fp32 in [-1, 1]
    first       whether each is its stream's first chunk (1 + 4k frames; the encoder
                runs first chunks and later ones as two calls)

`EncodeStage.run` does the swaps (every swap out first), then the encode of each stage,
and reports an `EncodeResult`: the parked row states, the streams whose row swap
failed, and each batch row's input latents [C, F, H, W] (fp32, left on the encoder's
device: the runner reads them there, no wait on a copy to the host). An encode
that raises fails every video stream of the step (``failed``); their rows get zeros as
their source so the batch still runs (their chunks are dropped at the commit).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .decode_stage import RowSwap, swap_rows

__all__ = ["EncodePlan", "EncodeResult", "EncodeStage"]


@dataclass(eq=False)
class EncodePlan:
    """The encoder's work of one step (module doc); ``streams``: each video row's
    stream id."""

    swap_outs: list[RowSwap] = field(default_factory=list)
    swap_ins: list[RowSwap] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    streams: list[str] = field(default_factory=list)
    frames: list[torch.Tensor] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)

    def stages(self) -> list[list[int]]:
        """The indices (into ``rows``) of each encode call: first chunks, then later
        ones (the empty one left out)."""
        runs = ([i for i, f in enumerate(self.first) if f == want] for want in (True, False))
        return [idx for idx in runs if idx]


@dataclass(eq=False)
class EncodeResult:
    """What the encoder's work of a step gave: ``parked``: stream id -> the row state
    of each swap out; ``failed``: stream id -> why its row swap or encode failed;
    ``latents``: batch row -> its input latents [C, F, H, W] fp32 on the encoder's
    device."""

    parked: dict[str, dict] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    latents: dict[int, torch.Tensor] = field(default_factory=dict)


class EncodeStage:
    """A streaming encoder (``encode(frames, rows=)``, ``reset(rows=)``,
    ``snapshot(row)``, ``restore(row, state)``, ``close()``,
    `framekv.engine.wan.StreamingVAEEncoder`) running `EncodePlan` s (module doc)."""

    def __init__(self, encoder):
        self.encoder = encoder
        self.device = getattr(encoder, "device", None) or torch.device("cpu")

    def run(self, plan: EncodePlan, chunk_shape) -> EncodeResult:
        """The plan's row swaps, then the encode of its rows; a fresh result. A row whose
        latents are not ``chunk_shape`` [C, F, H, W] fails its stream."""
        res = EncodeResult()
        swap_rows(self.encoder, plan.swap_outs, plan.swap_ins, res)
        for idx in plan.stages():
            idx = [i for i in idx if plan.streams[i] not in res.failed]
            if idx:
                self._encode(plan, idx, tuple(chunk_shape), res)
        for i, r in enumerate(plan.index):          # the batch still runs: zeros for them
            if plan.streams[i] in res.failed:
                res.latents[r] = torch.zeros(chunk_shape, device=self.device)
        return res

    def _encode(self, plan: EncodePlan, idx: list[int], shape: tuple, res: EncodeResult):
        """One encode call of rows ``idx`` of ``plan``; what it raises fails them."""
        try:
            frames = torch.stack([plan.frames[i] for i in idx]).to(self.device)  # [b, 3, n, H, W]
            out = self.encoder.encode(frames, rows=[plan.rows[i] for i in idx])  # [b, C, F, h, w]
            if tuple(out.shape[1:]) != shape:
                raise ValueError(f"the encoder gave input latents {list(out.shape[1:])}, the "
                                 f"runner's chunk is {list(shape)}")
            out = out.float()
        except Exception as exc:
            for i in idx:
                res.failed[plan.streams[i]] = f"encoding its input failed: {exc!r}"
            return
        for j, i in enumerate(idx):
            res.latents[plan.index[i]] = out[j]

    def close(self) -> None:
        """Free the encoder."""
        self.encoder.close()
