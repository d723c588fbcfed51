"""`TinyEncoderNet`: the network of `TinyStreamingEncoder` (``tiny_encoder.py``, whose
module doc gives its formulas), its weights in the layout of TAEHV's ``taew2_1``
encoder (MIT, madebyollin/taehv); the memory blocks, the loading (keys checked both
ways) and `random_init` are ``tiny_blocks.py``'s.

`TinyEncoderNet.stream` runs one chunk of frames (a multiple of 4) given each memory
block's input one frame before the chunk, and returns the block inputs of the chunk's
last frame for the next one.

Layout. Past the stem every activation is channels last ([B, T, C, h, w] views of
[B, T, h, w, C] storage): cuDNN's and oneDNN's 2-D convs in bf16 run their fast kernels
on channels-last data and weights (`TinyStreamingEncoder` keeps its net's weights so),
and the two copies the network needs anyway, a pool's k frames side by side and a
memory block's [x_t, x_{t-1}], are written straight into channels-last buffers. The
values are the NCHW network's; only the convs' summation order may differ.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .tiny_blocks import MemoryBlock, TaehvNet, conv2d, conv_relu, per_frame

__all__ = ["TIME_FACTORS", "TinyEncoderNet", "WIDTH"]

WIDTH = 64                   # the checkpoint layout's width, every stage
TIME_FACTORS = (2, 2, 1)     # input frames per frame at each stage's pool
BLOCKS = 3                   # memory blocks per stage
#: Channels the stem reads: the frames' three, zero-padded (with zero weights) to the
#: multiple of 8 cuDNN's channels-last kernels want.
STEM_WIDTH = 8


class _Stage(torch.nn.Module):
    """k frames to one, half the size, then memory blocks."""

    def __init__(self, width: int, factor: int):
        super().__init__()
        self.factor = factor
        self.pool = conv2d(width * factor, width, bias=False, kernel=1)
        self.down = conv2d(width, width, bias=False, stride=2)
        self.blocks = torch.nn.ModuleList(MemoryBlock(width) for _ in range(BLOCKS))

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C, h, w] -> [B, T / k, C, h / 2, w / 2] (module doc), channels last."""
        B, T, C, h, w = x.shape
        k = self.factor
        y = _last(x).reshape(B, T // k, k, h, w, C).permute(0, 1, 3, 4, 2, 5)
        y = y.reshape(B * T // k, h, w, k * C)                      # frames k t + j: group j
        return self.down(self.pool(y.permute(0, 3, 1, 2))).unflatten(0, (B, T // k))


def _last(x: torch.Tensor) -> torch.Tensor:
    """[B, T, C, h, w] -> its [B, T, h, w, C] view (contiguous for channels-last data)."""
    return x.permute(0, 1, 3, 4, 2)


def over_time(block: MemoryBlock, x: torch.Tensor, before: torch.Tensor):
    """`MemoryBlock.over_time`, channels last (module doc): x [B, T, C, h, w] and
    ``before`` [B, C, h, w] -> (outputs [B, T, C, h, w], x's last frame)."""
    B, T, C, h, w = x.shape
    pair = x.new_empty(B, T, h, w, 2 * C)                  # [x_t, x_{t-1}] per frame
    pair[..., :C].copy_(_last(x))
    pair[:, :1, ..., C:].copy_(before.unsqueeze(1).permute(0, 1, 3, 4, 2))
    pair[:, 1:, ..., C:].copy_(_last(x[:, :-1]))
    out = block.of_pair(pair.flatten(0, 1).permute(0, 3, 1, 2), x.flatten(0, 1))
    return out.unflatten(0, (B, T)), x[:, -1]                  # [B, T, C, h, w]


class TinyEncoderNet(TaehvNet):
    """The network of ``tiny_encoder.py``'s module doc for ``latent_channels`` latent
    channels; ``width`` is the checkpoint layout's by default, another makes a smaller
    network of the same structure (no checkpoint fits it)."""

    PART = "encoder"

    def __init__(self, latent_channels: int = 16, width: int = WIDTH):
        super().__init__()
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"width must be a positive integer, got {width!r}")
        self.latent_channels, self.width = latent_channels, width
        self.stem = conv2d(3, width)
        self.stages = torch.nn.ModuleList(_Stage(width, k) for k in TIME_FACTORS)
        self.head = conv2d(width, latent_channels)

    def memory_shapes(self, frame_size) -> tuple[tuple[int, int, int], ...]:
        """Per block, in order, the shape [C, h, w] of one sequence's carried frame."""
        H, W = frame_size
        return tuple((self.width, H >> (s + 1), W >> (s + 1)) for s in range(len(self.stages))
                     for _ in range(BLOCKS))

    def stream(self, frames: torch.Tensor, memory: list):
        """frames [B, 3, T, H, W] in [-1, 1] (T a multiple of 4) and each
        block's carried frame [B, C, h_l, w_l] -> (latents [B, z, T / 4, H / 8, W / 8];
        the blocks' new carried frames)."""
        B, _, T, H, W = frames.shape
        rgb = frames.new_zeros(B * T, H, W, STEM_WIDTH)             # channels last, padded
        rgb[..., :3].copy_(frames.permute(0, 2, 3, 4, 1).flatten(0, 1))
        rgb[..., :3].add_(1).mul_(0.5)                              # TAEHV reads [0, 1]
        stem = F.pad(self.stem.weight, (0, 0, 0, 0, 0, STEM_WIDTH - 3))      # zero taps
        x = conv_relu(self.stem, rgb.permute(0, 3, 1, 2),                    # [B T, C, H, W]
                      weight=stem.contiguous(memory_format=torch.channels_last))
        x = x.unflatten(0, (B, T))
        carried, before = [], iter(memory)
        for stage in self.stages:
            x = stage.shrink(x)
            for block in stage.blocks:
                x, last = over_time(block, x, next(before))
                carried.append(last)
        z = per_frame(self.head, x)                                  # [B, T / 4, z, h, w]
        return z.transpose(1, 2).contiguous(), carried

    def taehv_names(self) -> dict[str, str]:
        """This network's parameter names -> the TAEHV checkpoint's (``encoder.<i>...``)."""
        names = {"stem.weight": "encoder.0.weight", "stem.bias": "encoder.0.bias",
                 "head.weight": "encoder.17.weight", "head.bias": "encoder.17.bias"}
        for s in range(len(self.stages)):
            base = 2 + 5 * s  # pool, down, 3 blocks
            names[f"stages.{s}.pool.weight"] = f"encoder.{base}.conv.weight"
            names[f"stages.{s}.down.weight"] = f"encoder.{base + 1}.weight"
            for b in range(BLOCKS):
                names.update(MemoryBlock.taehv_names(f"stages.{s}.blocks.{b}",
                                                     f"encoder.{base + 2 + b}"))
        return names

    @staticmethod
    def init_rule(name: str) -> tuple[bool, float, float]:
        """`random_init`'s (linear, gain, bias) of conv ``name``: the pools, the
        downsampling convs and the head feed no ReLU; each block's last conv drawn 0.3
        times smaller; biases 0."""
        last = name.rsplit(".", 1)[-1]
        return last in ("pool", "down", "head"), 0.3 if last == "c3" else 1.0, 0.0

    @staticmethod
    def latent_channels_of(state: dict) -> int:
        """The latent channels of a TAEHV checkpoint's encoder (its head's output; 16
        when the head is missing, for `load_taehv` to name it)."""
        head = state.get("encoder.17.weight")
        return head.shape[0] if isinstance(head, torch.Tensor) and head.dim() == 4 else 16
