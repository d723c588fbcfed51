"""`TinyStreamingEncoder`: frames to Wan 2.1 latents chunk by chunk with a small network
of per-frame 2-D convolutions, interchangeable with `StreamingVAEEncoder`.

Weights are in the layout of TAEHV's ``taew2_1`` encoder (MIT, madebyollin/taehv), so
its checkpoints load as they are; it is the encoder half of `TinyStreamingDecoder`'s
checkpoint.

Contract. ``encode(frames, rows)`` takes frames [B, 3, F, H, W] in [-1, 1] (H and W
multiples of 8) and returns latents [B, C, F', H / 8, W / 8] (C = 16 for Wan 2.1) as
the transformer reads them (TAEHV's latents are the normalised ones: no mean or std
applied), in the encoder's dtype, a fresh tensor, with `StreamingVAEEncoder`'s frame
counts: a video's first chunk takes 1 + 4k frames and gives 1 + k latent frames, a
later chunk 4k frames and k. A video encoded in chunks of any cut, concatenated along
time, equals its encode in one call.

Every latent frame is made of a group of 4 frames. A video's first frame fills its
group alone: the network sees it 4 times, then the video's frames 1-4 as the next
group, and so on; so latent t >= 1 covers frames 4t - 3 .. 4t, as the Wan VAE's does
(the tiny decoder mirrors it: its first 3 frames of a video are dropped).

The network over a video's frames x_t (every conv is 2-D over one frame, 3x3 unless
noted; widths C = 64, the checkpoint's)::

    x_t = relu(stem((x_t + 1) / 2))                      [C, H, W]   TAEHV reads [0, 1]
    for stage s = 0, 1, 2 (time factor k = 2, 2, 1):
        x_t = down(pool([x_{k t}, .., x_{k t + k - 1}]))  pool 1x1 over the k frames'
                                                           channels; down stride 2; no bias
        3 times: x_t = relu(c3(relu(c2(relu(c1([x_t, x_{t-1}]))))) + x_t)
                 (x_{t-1}: the block's input one frame earlier, zeros before a video's
                 first frame)
    z_t = head(x_t)                                     [C_z, H / 8, W / 8]

State carried between chunks, per sequence: each of the 9 blocks' last input frame,
[64, H / 2, W / 2] x 3, [64, H / 4, W / 4] x 3, [64, H / 8, W / 8] x 3, in one arena
([S, ...] per block) sized at the first encode; a chunk reads them for its first
frame at every stage and writes its last (a chunk's frames are whole groups, so no
pool waits on frames of a later chunk). A chunk that starts a video reads zeros.

Rows, stages ("first" or "steady", never mixed in one call), graphs (one CUDA graph
per stage, batch, frames and frame size; eager on CPU or with ``use_graphs=False``),
`snapshot` / `restore`, `capture` and `close` behave as `StreamingVAEEncoder`'s.
"""
from __future__ import annotations

import torch

from .coder_rows import EncoderRows
from .tiny_blocks import TinyCoder
from .tiny_encoder_net import WIDTH, TinyEncoderNet

__all__ = ["TinyEncoderNet", "TinyStreamingEncoder"]


class TinyStreamingEncoder(TinyCoder, EncoderRows):
    """Encode frames to Wan 2.1 latents chunk by chunk with a `TinyEncoderNet` (module
    doc), each sequence's carried frames kept between calls. Arguments and attributes
    are `TinyStreamingDecoder`'s, the encoder's where it says decoder: ``net`` (a
    `TinyEncoderNet`), ``sequences`` (default: the batch of the first `encode` or
    `capture`), ``use_graphs``, ``device``; latents come back in the net's dtype.
    `from_file` reads a TAEHV checkpoint's encoder keys (the decoder's ignored), latent
    channels from ``encoder.17.weight``.
    """

    NET = TinyEncoderNet

    def __init__(self, net, **kwargs):
        super().__init__(net, **kwargs)
        # the net runs channels last (tiny_encoder_net's doc): its weights kept so
        self.net.to(memory_format=torch.channels_last)

    @classmethod
    def random(cls, *, seed: int = 0, latent_channels: int = 16, device=None, dtype=None,
               width: int = WIDTH, **kwargs) -> "TinyStreamingEncoder":
        """An encoder of random weights drawn from ``seed`` (`random_init`), of the
        checkpoint layout's width unless ``width`` says otherwise (`TinyEncoderNet`);
        dtype default bf16 on CUDA, fp32 on CPU; ``kwargs`` go to the constructor."""
        return cls._random(seed, latent_channels, width, device, dtype, kwargs)

    # ------------------------------------------------------------------ internals
    PROGRAM = "tiny-encode"
    MISMATCH = "another layout, dtype or frame size"

    @staticmethod
    def _net_input(frames: torch.Tensor, first: bool) -> torch.Tensor:
        """frames [B, 3, F, H, W]; a video's first frame fills its group alone (module doc)."""
        if not first:
            return frames
        group = frames[:, :, :1].expand(-1, -1, EncoderRows.TIME, -1, -1)
        return torch.cat([group, frames[:, :, 1:]], dim=2)

    @staticmethod
    def _output(latents: torch.Tensor, first: bool) -> torch.Tensor:
        return latents                                              # [B, z, F', H/8, W/8]
