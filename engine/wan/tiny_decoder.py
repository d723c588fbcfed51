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

import torch

from .coder_rows import DecoderRows
from .tiny_blocks import TinyCoder, random_init
from .tiny_net import WIDTHS, TinyDecoderNet
from .vae import StreamingVAEDecoder

__all__ = ["TinyDecoderNet", "TinyStreamingDecoder", "WIDTHS", "random_init"]

TRIM = 3                     # frames dropped at a video's start (4F - 3 frames)


class TinyStreamingDecoder(TinyCoder, DecoderRows):
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

    NET = TinyDecoderNet

    @classmethod
    def random(cls, *, seed: int = 0, latent_channels: int = 16, device=None, dtype=None,
               widths: tuple[int, ...] = WIDTHS, **kwargs) -> "TinyStreamingDecoder":
        """A decoder of random weights drawn from ``seed`` (`random_init`), of the
        checkpoint layout's widths unless ``widths`` says otherwise (`TinyDecoderNet`);
        dtype default bf16 on CUDA, fp32 on CPU; ``kwargs`` go to the constructor.
        (`from_file`: a decoder of a TAEHV checkpoint's decoder keys, latent channels
        from ``decoder.1.weight``.)"""
        return cls._random(seed, latent_channels, widths, device, dtype, kwargs)

    # ------------------------------------------------------------------ internals
    PROGRAM = "tiny-decode"
    MISMATCH = "another layout, dtype or latent size"

    @staticmethod
    def _net_input(latents: torch.Tensor, first: bool) -> torch.Tensor:
        return latents                                              # [B, C, F, H, W]

    @staticmethod
    def _output(rgb: torch.Tensor, first: bool) -> torch.Tensor:
        """rgb [B, 3, 4F, 8H, 8W] -> frames in [-1, 1], a video's first 3 dropped."""
        if first:
            rgb = rgb[:, :, TRIM:]
        return (rgb.clamp(0, 1) * 2 - 1).contiguous()
