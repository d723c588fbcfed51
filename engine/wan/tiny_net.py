"""`TinyDecoderNet`: the network of `TinyStreamingDecoder` (``tiny_decoder.py``, whose
module doc gives its formulas), its weights in the layout of TAEHV's ``taew2_1`` (MIT,
madebyollin/taehv); the memory blocks, the loading (keys checked both ways) and
`random_init` are ``tiny_blocks.py``'s.

`TinyDecoderNet.stream` runs one chunk of latent frames given each memory block's
input one frame before the chunk, and returns the block inputs of the chunk's last
frame for the next one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .tiny_blocks import (MemoryBlock, TaehvNet, conv2d, conv_relu, per_frame, random_init,
                          read_taehv)

__all__ = ["TinyDecoderNet", "WIDTHS", "random_init", "read_taehv"]

WIDTHS = (256, 128, 64, 64)  # stage widths, then the head's input width
TIME_FACTORS = (1, 2, 2)     # frames per input frame at each stage's grow
BLOCKS = 3                   # memory blocks per stage


class _Stage(torch.nn.Module):
    """Memory blocks, then k frames per frame, 2x the size and the next width."""

    def __init__(self, width: int, next_width: int, factor: int):
        super().__init__()
        self.factor = factor
        self.blocks = torch.nn.ModuleList(MemoryBlock(width) for _ in range(BLOCKS))
        self.grow = conv2d(width, width * factor, bias=False, kernel=1)
        self.narrow = conv2d(width, next_width, bias=False)

    def upscale(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C, h, w] -> [B, k T, C', 2h, 2w] (module doc)."""
        y = per_frame(self.grow, x)                                  # [B, T, k C, h, w]
        B, T, _, h, w = y.shape
        y = y.reshape(B, T * self.factor, -1, h, w)                   # group j -> frame k t + j
        return per_frame(lambda f: self.narrow(F.interpolate(f, scale_factor=2.0)), y)


class TinyDecoderNet(TaehvNet):
    """The network of the module doc for ``latent_channels`` latent channels; ``widths``
    (the stages', then the head's input) are the checkpoint layout's by default, other
    widths make a smaller network of the same structure (no checkpoint fits it)."""

    PART = "decoder"

    def __init__(self, latent_channels: int = 16, widths: tuple[int, ...] = WIDTHS):
        super().__init__()
        widths = tuple(widths) if isinstance(widths, (tuple, list)) else ()
        if len(widths) != len(TIME_FACTORS) + 1 or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in widths):
            raise ValueError(f"widths must be {len(TIME_FACTORS) + 1} positive integers, got "
                             f"{widths or None!r}")
        self.latent_channels, self.widths = latent_channels, widths
        self.stem = conv2d(latent_channels, widths[0])
        self.stages = torch.nn.ModuleList(_Stage(widths[s], widths[s + 1], TIME_FACTORS[s])
                                          for s in range(len(TIME_FACTORS)))
        self.head = conv2d(widths[-1], 3)

    def memory_shapes(self, latent_size) -> tuple[tuple[int, int, int], ...]:
        """Per block, in order, the shape [C, h, w] of one sequence's carried frame."""
        H, W = latent_size
        return tuple((self.widths[s], H << s, W << s) for s in range(len(self.stages))
                     for _ in range(BLOCKS))

    def stream(self, latents: torch.Tensor, memory: list):
        """latents [B, C, F, H, W] and each block's carried frame [B, C_l, h_l, w_l] ->
        (rgb [B, 3, 4F, 8H, 8W] unclamped, every frame; the blocks' new carried frames)."""
        x = per_frame(lambda z: conv_relu(self.stem, torch.tanh(z / 3) * 3),
                       latents.transpose(1, 2))                     # [B, F, C, H, W]
        carried, before = [], iter(memory)
        for stage in self.stages:
            for block in stage.blocks:
                x, last = block.over_time(x, next(before))
                carried.append(last)
            x = stage.upscale(x)
        rgb = per_frame(lambda f: self.head(F.relu(f)), x)          # [B, 4F, 3, 8H, 8W]
        return rgb.transpose(1, 2), carried

    def taehv_names(self) -> dict[str, str]:
        """This network's parameter names -> the TAEHV checkpoint's (``decoder.<i>...``)."""
        names = {"stem.weight": "decoder.1.weight", "stem.bias": "decoder.1.bias",
                 "head.weight": "decoder.22.weight", "head.bias": "decoder.22.bias"}
        for s in range(len(self.stages)):
            base = 3 + 6 * s  # 3 blocks, upsample, grow, narrow
            for b in range(BLOCKS):
                names.update(MemoryBlock.taehv_names(f"stages.{s}.blocks.{b}",
                                                     f"decoder.{base + b}"))
            names[f"stages.{s}.grow.weight"] = f"decoder.{base + 4}.conv.weight"
            names[f"stages.{s}.narrow.weight"] = f"decoder.{base + 5}.weight"
        return names

    @staticmethod
    def init_rule(name: str) -> tuple[bool, float, float]:
        """`random_init`'s (linear, gain, bias) of conv ``name``: the head and the grows
        feed no ReLU; each block's last conv and the head drawn 0.3 times smaller;
        biases 0 but the head's, 0.5. Frames then spread over [-1, 1] with some clamped."""
        last = name.rsplit(".", 1)[-1]
        return last in ("head", "grow"), 0.3 if last in ("head", "c3") else 1.0, \
            0.5 if last == "head" else 0.0

    @staticmethod
    def latent_channels_of(state: dict) -> int:
        """The latent channels of a TAEHV checkpoint's decoder (its stem's input; 16
        when the stem is missing, for `load_taehv` to name it)."""
        stem = state.get("decoder.1.weight")
        return stem.shape[1] if isinstance(stem, torch.Tensor) and stem.dim() == 4 else 16
