"""`TinyEncoderNet`: the network of `TinyStreamingEncoder` (``tiny_encoder.py``, whose
module doc gives its formulas), its weights in the layout of TAEHV's ``taew2_1``
encoder (MIT, madebyollin/taehv); the memory blocks, the loading (keys checked both
ways) and `random_init` are ``tiny_blocks.py``'s.

`TinyEncoderNet.stream` runs one chunk of frames (a multiple of 4) given each memory
block's input one frame before the chunk, and returns the block inputs of the chunk's
last frame for the next one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .tiny_blocks import MemoryBlock, TaehvNet, conv2d, per_frame

__all__ = ["TIME_FACTORS", "TinyEncoderNet", "WIDTH"]

WIDTH = 64                   # the checkpoint layout's width, every stage
TIME_FACTORS = (2, 2, 1)     # input frames per frame at each stage's pool
BLOCKS = 3                   # memory blocks per stage


class _Stage(torch.nn.Module):
    """k frames to one, half the size, then memory blocks."""

    def __init__(self, width: int, factor: int):
        super().__init__()
        self.factor = factor
        self.pool = conv2d(width * factor, width, bias=False, kernel=1)
        self.down = conv2d(width, width, bias=False, stride=2)
        self.blocks = torch.nn.ModuleList(MemoryBlock(width) for _ in range(BLOCKS))

    def shrink(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C, h, w] -> [B, T / k, C, h / 2, w / 2] (module doc)."""
        B, T, C, h, w = x.shape
        y = x.reshape(B, T // self.factor, self.factor * C, h, w)   # frames k t + j: group j
        return per_frame(lambda f: self.down(self.pool(f)), y)


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
        x = (frames.transpose(1, 2) + 1) * 0.5                       # [B, T, 3, H, W] in [0, 1]
        x = per_frame(lambda f: F.relu(self.stem(f)), x)             # [B, T, C, H, W]
        carried, before = [], iter(memory)
        for stage in self.stages:
            x = stage.shrink(x)
            for block in stage.blocks:
                x, last = block.over_time(x, next(before))
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
