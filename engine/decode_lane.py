"""`DecodeLane`: a streaming decoder's chunks decoded beside the transformer's next one;
`to_uint8`: the one conversion of decoded video in [-1, 1] to uint8 RGB (a served
chunk's frames, a generated MP4's), made where the frames are decoded.

On CUDA (``overlap`` not False), `submit` queues a chunk's decode on a stream of the
lane's own, after the work already queued on the caller's stream (the transformer that
made the latents), then its uint8 frames into pinned host memory; `take` waits for the
oldest chunk submitted and returns its frames. A caller that queues the next chunk's
transformer between the two has it run while the decode does::

    lane.submit(rollout.step(noise_0))
    for i in 1 .. n-1:
        latents = rollout.step(noise_i)     # queued on the caller's stream
        lane.submit(latents)                # waits for it, on the lane's stream
        write(lane.take())                  # chunk i-1, decoded beside chunk i
    write(lane.take())

The lane's stream has the higher priority (-1 against the default streams' 0): whenever
both streams have work ready its kernels go first, so a chunk's frames reach the host
soonest and the transformer fills what the decode leaves of the GPU. Nothing in `submit`
waits for the device (the NaN / inf check of the frames is made on the device and read
at `take`).

Without overlap (a CPU, or ``overlap=False``) `submit` decodes at once on the caller's
stream. Either way the frames are the same: the same decoder, graphs and kernels, the
chunks in the order submitted. While chunks are in flight the decoder belongs to the
lane (its state rows are written on the lane's stream): call `drain` before using it
directly (reset, snapshot, restore).
"""
from __future__ import annotations

import collections

import torch

__all__ = ["DecodeLane", "to_uint8"]


def to_uint8(frames: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """Frames in [-1, 1] as uint8 RGB, channels last, on the frames' device (so that
    only the pixels cross to the host).

    Args:
        frames: a float tensor [3, F, H, W] (one video) or [B, 3, F, H, W] (B videos).

    Returns:
        uint8 [F, H, W, 3] for one video, [B, F, H, W, 3] for B (``out[b]`` is video
        b): round((x + 1) * 127.5), ties to even, clamped to [0, 255].

    ``check=False`` skips the NaN / inf check, which waits for the frames on the host:
    a caller that must not wait checks them itself (`DecodeLane`).

    Raises:
        ValueError: not such a tensor, not floating point, or NaN or inf in it.
    """
    if not isinstance(frames, torch.Tensor) or frames.dim() not in (4, 5) or frames.shape[-4] != 3:
        got = tuple(frames.shape) if isinstance(frames, torch.Tensor) else type(frames).__name__
        raise ValueError(f"frames must be a tensor [3, F, H, W] or [B, 3, F, H, W], got {got}")
    if not frames.is_floating_point():
        raise ValueError(f"frames must be floating point in [-1, 1], got {frames.dtype}")
    x = frames.detach().float()
    if check and not bool(torch.isfinite(x).all()):
        raise ValueError("frames must be finite, got NaN or inf values")
    x = ((x + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8)
    return x.movedim(-4, -1).contiguous()  # [..., F, H, W, 3]


class DecodeLane:
    """Chunks decoded on a stream of their own (module doc). ``decoder``: a streaming
    decoder (``decode(latents, rows)``); ``device``: where it decodes (default its
    ``device``, else the CPU); ``overlap``: None (on CUDA), or False (decode at once);
    ``priority``: the lane stream's CUDA priority (lower is higher; default -1, above
    the default streams' 0)."""

    def __init__(self, decoder, *, overlap: bool | None = None, priority: int | None = None,
                 device=None):
        if overlap not in (None, True, False):
            raise ValueError(f"overlap must be None, True or False, got {overlap!r}")
        self.decoder = decoder
        self.device = torch.device(device or getattr(decoder, "device", None) or "cpu")
        self.overlap = self.device.type == "cuda" and overlap is not False
        self.stream = None
        if self.overlap:
            self.stream = torch.cuda.Stream(self.device, priority=-1 if priority is None
                                            else priority)
        self._pending: collections.deque = collections.deque()   # (done, frames, finite)

    def __len__(self) -> int:
        """Chunks submitted and not yet taken."""
        return len(self._pending)

    def submit(self, latents: torch.Tensor, rows=None) -> None:
        """Queue the decode of ``latents`` [B, C, F, H, W] for decoder rows ``rows``
        (`decode`'s), after the work queued so far on the current stream."""
        if not self.overlap:
            self._pending.append((None, to_uint8(self.decoder.decode(latents, rows)).cpu(),
                                  None))
            return
        made = torch.cuda.Event()
        made.record()                                    # the caller's stream
        self.stream.wait_event(made)
        with torch.cuda.stream(self.stream):
            frames = self.decoder.decode(latents, rows)  # [B, 3, F', 8H, 8W]
            u8 = to_uint8(frames, check=False)           # [B, F', 8H, 8W, 3]
            host = torch.empty(u8.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(u8, non_blocking=True)
            finite = torch.empty((), dtype=torch.bool, pin_memory=True)
            finite.copy_(torch.isfinite(frames).all(), non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        latents.record_stream(self.stream)               # freed only once decoded
        self._pending.append((done, host, finite))

    def take(self) -> torch.Tensor:
        """The oldest submitted chunk's frames, host uint8 [B, F', H, W, 3], waiting for
        them. IndexError when none is in flight; ValueError for NaN or inf frames."""
        if not self._pending:
            raise IndexError("take() with no chunk submitted")
        done, host, finite = self._pending.popleft()
        if done is not None:
            done.synchronize()
            if not bool(finite):
                raise ValueError("frames must be finite, got NaN or inf values")
        return host

    def drain(self) -> list[torch.Tensor]:
        """Every chunk in flight, oldest first (`take` each)."""
        return [self.take() for _ in range(len(self._pending))]

    def discard(self) -> None:
        """Drop every chunk in flight once its work is done, whatever it raises (what a
        failed decode leaves behind); the decoder is free after."""
        while self._pending:
            try:
                self.take()
            except Exception:   # the chunk is dropped either way
                pass
