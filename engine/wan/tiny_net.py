"""`TinyDecoderNet`: the network of `TinyStreamingDecoder` (``tiny_decoder.py``, whose
module doc gives its formulas), its weights in the layout of TAEHV's ``taew2_1`` (MIT,
madebyollin/taehv) and their loading (keys checked both ways), `random_init`.

`TinyDecoderNet.stream` runs one chunk of latent frames given each memory block's
input one frame before the chunk, and returns the block inputs of the chunk's last
frame for the next one.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .weights import read_checkpoint

__all__ = ["TinyDecoderNet", "WIDTHS", "random_init", "read_taehv", "unset_net"]

WIDTHS = (256, 128, 64, 64)  # stage widths, then the head's input width
TIME_FACTORS = (1, 2, 2)     # frames per input frame at each stage's grow
BLOCKS = 3                   # memory blocks per stage
_BLOCK_CONVS = {"c1": 0, "c2": 2, "c3": 4}  # a block's convs in the checkpoint


def _conv(n_in: int, n_out: int, *, bias: bool = True, kernel: int = 3) -> torch.nn.Conv2d:
    return torch.nn.Conv2d(n_in, n_out, kernel, padding=kernel // 2, bias=bias)


def _per_frame(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` over the frames of ``x`` [B, T, C, h, w], as one batch of B T images."""
    y = fn(x.flatten(0, 1))
    return y.unflatten(0, x.shape[:2])


class _MemoryBlock(torch.nn.Module):
    """Residual block over a frame and the block's input one frame earlier."""

    def __init__(self, width: int):
        super().__init__()
        self.c1 = _conv(2 * width, width)
        self.c2, self.c3 = _conv(width, width), _conv(width, width)

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(torch.cat([x, past], dim=1)))
        return F.relu(self.c3(F.relu(self.c2(h))) + x)

    def over_time(self, x: torch.Tensor, before: torch.Tensor):
        """x [B, T, C, h, w] and ``before`` [B, C, h, w], the input frame preceding x[:, 0]
        -> (outputs [B, T, C, h, w], x's last frame: the next chunk's ``before``)."""
        past = torch.cat([before.unsqueeze(1), x[:, :-1]], dim=1)
        out = self(x.flatten(0, 1), past.flatten(0, 1)).unflatten(0, x.shape[:2])
        return out, x[:, -1]


class _Stage(torch.nn.Module):
    """Memory blocks, then k frames per frame, 2x the size and the next width."""

    def __init__(self, width: int, next_width: int, factor: int):
        super().__init__()
        self.factor = factor
        self.blocks = torch.nn.ModuleList(_MemoryBlock(width) for _ in range(BLOCKS))
        self.grow = _conv(width, width * factor, bias=False, kernel=1)
        self.narrow = _conv(width, next_width, bias=False)

    def upscale(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, C, h, w] -> [B, k T, C', 2h, 2w] (module doc)."""
        y = _per_frame(self.grow, x)                                  # [B, T, k C, h, w]
        B, T, _, h, w = y.shape
        y = y.reshape(B, T * self.factor, -1, h, w)                   # group j -> frame k t + j
        return _per_frame(lambda f: self.narrow(F.interpolate(f, scale_factor=2.0)), y)


class TinyDecoderNet(torch.nn.Module):
    """The network of the module doc for ``latent_channels`` latent channels; ``widths``
    (the stages', then the head's input) are the checkpoint layout's by default, other
    widths make a smaller network of the same structure (no checkpoint fits it)."""

    def __init__(self, latent_channels: int = 16, widths: tuple[int, ...] = WIDTHS):
        super().__init__()
        widths = tuple(widths) if isinstance(widths, (tuple, list)) else ()
        if len(widths) != len(TIME_FACTORS) + 1 or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in widths):
            raise ValueError(f"widths must be {len(TIME_FACTORS) + 1} positive integers, got "
                             f"{widths or None!r}")
        self.latent_channels, self.widths = latent_channels, widths
        self.stem = _conv(latent_channels, widths[0])
        self.stages = torch.nn.ModuleList(_Stage(widths[s], widths[s + 1], TIME_FACTORS[s])
                                          for s in range(len(TIME_FACTORS)))
        self.head = _conv(widths[-1], 3)

    def memory_shapes(self, latent_size) -> tuple[tuple[int, int, int], ...]:
        """Per block, in order, the shape [C, h, w] of one sequence's carried frame."""
        H, W = latent_size
        return tuple((self.widths[s], H << s, W << s) for s in range(len(self.stages))
                     for _ in range(BLOCKS))

    def stream(self, latents: torch.Tensor, memory: list):
        """latents [B, C, F, H, W] and each block's carried frame [B, C_l, h_l, w_l] ->
        (rgb [B, 3, 4F, 8H, 8W] unclamped, every frame; the blocks' new carried frames)."""
        x = _per_frame(lambda z: F.relu(self.stem(torch.tanh(z / 3) * 3)),
                       latents.transpose(1, 2))                     # [B, F, C, H, W]
        carried, before = [], iter(memory)
        for stage in self.stages:
            for block in stage.blocks:
                x, last = block.over_time(x, next(before))
                carried.append(last)
            x = stage.upscale(x)
        rgb = _per_frame(lambda f: self.head(F.relu(f)), x)          # [B, 4F, 3, 8H, 8W]
        return rgb.transpose(1, 2), carried

    def taehv_names(self) -> dict[str, str]:
        """This network's parameter names -> the TAEHV checkpoint's (``decoder.<i>...``)."""
        names = {"stem.weight": "decoder.1.weight", "stem.bias": "decoder.1.bias",
                 "head.weight": "decoder.22.weight", "head.bias": "decoder.22.bias"}
        for s in range(len(self.stages)):
            base = 3 + 6 * s  # 3 blocks, upsample, grow, narrow
            for b in range(BLOCKS):
                for conv, j in _BLOCK_CONVS.items():
                    for p in ("weight", "bias"):
                        mine = f"stages.{s}.blocks.{b}.{conv}.{p}"
                        names[mine] = f"decoder.{base + b}.conv.{j}.{p}"
            names[f"stages.{s}.grow.weight"] = f"decoder.{base + 4}.conv.weight"
            names[f"stages.{s}.narrow.weight"] = f"decoder.{base + 5}.weight"
        return names

    def taehv_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under the TAEHV checkpoint's names (decoder keys only)."""
        own = self.state_dict()
        return {theirs: own[mine] for mine, theirs in self.taehv_names().items()}

    def load_taehv(self, state: dict, where: str = "state") -> None:
        """Load the decoder keys of a TAEHV state dict (``encoder.*`` keys are ignored).
        ValueError naming the missing and unexpected decoder keys, or a key of another
        shape; nothing is loaded then."""
        names = self.taehv_names()
        want = list(names.values())
        given = [k for k in state if not k.startswith("encoder.")]
        missing = [k for k in want if k not in state]
        unexpected = sorted(set(given) - set(want))
        if missing or unexpected:
            raise ValueError(f"{where} is not a TAEHV decoder of this layout "
                             f"({self.latent_channels} latent channels): {len(missing)} missing "
                             f"decoder keys {missing[:5]}, {len(unexpected)} unexpected keys "
                             f"{unexpected[:5]}")
        own = self.state_dict()
        for mine, theirs in names.items():
            if tuple(state[theirs].shape) != tuple(own[mine].shape):
                raise ValueError(f"{where}: {theirs} has shape {list(state[theirs].shape)}, this "
                                 f"layout's is {list(own[mine].shape)}")
        self.load_state_dict({mine: state[theirs] for mine, theirs in names.items()})


@torch.no_grad()
def random_init(net: TinyDecoderNet, seed: int = 0) -> None:
    """Draw ``net``'s weights from a generator seeded with ``seed`` (the global RNG is
    untouched): normal, std sqrt(2 / fan_in) before a ReLU and sqrt(1 / fan_in) before
    none, 0.3 times that for each block's last conv and the head; biases 0 but the
    head's, 0.5. Frames then spread over [-1, 1] with some clamped."""
    g = torch.Generator().manual_seed(seed)
    for name, m in net.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            linear = name == "head" or name.endswith("grow")
            gain = 0.3 if name == "head" or name.endswith("c3") else 1.0
            std = gain * ((1.0 if linear else 2.0) / m.weight[0].numel()) ** 0.5
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
            if m.bias is not None:
                m.bias.fill_(0.5 if name == "head" else 0.0)


def unset_net(latent_channels: int, widths: tuple[int, ...] = WIDTHS) -> TinyDecoderNet:
    """A net on the CPU whose weights are left unset (no draw from the global RNG), for
    `random_init` or `TinyDecoderNet.load_taehv` to set every one."""
    with torch.device("meta"):
        net = TinyDecoderNet(latent_channels, widths)
    return net.to_empty(device="cpu")


def read_taehv(path) -> dict[str, torch.Tensor]:
    """The state dict of a local TAEHV checkpoint (``.pth`` / ``.pt`` / ``.safetensors``)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"path {path!r} is not a local checkpoint file (nothing is downloaded)")
    return read_checkpoint(path)
