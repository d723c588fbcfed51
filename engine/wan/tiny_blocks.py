"""What the two tiny coders share (`TinyStreamingDecoder` of ``tiny_decoder.py``,
`TinyStreamingEncoder` of ``tiny_encoder.py``), networks of per-frame 2-D convolutions
in the layout of TAEHV's ``taew2_1`` (MIT, madebyollin/taehv): the memory block, a
network's TAEHV weights (names, loading with the keys checked both ways, a local
file), seeded random weights (`random_init`), and what the coders do alike
(`TinyCoder`).

A memory block is a residual block over a frame and the block's input one frame
earlier (zeros before a video's first frame)::

    out_t = relu(c3(relu(c2(relu(c1([x_t, x_{t-1}]))))) + x_t)       every conv 3x3

so a stream carries, per block, its last input frame from one chunk to the next.

Every conv followed by a ReLU runs through `conv_relu`: on CUDA in half precision one
cuDNN call applies the conv, its bias, the residual and the ReLU (PyTorch's ``conv2d``
adds a cuDNN conv's bias in a pass of its own, and the ReLU and the residual are two
more); the bias and the residual join the fp32 accumulator before the one rounding,
so the result differs from the separate ops by bf16 rounding only. Elsewhere (the
CPU, fp32) the separate ops run.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from framekv.specs.checks import check_count

from .vae_cache import CacheLayout
from .weights import read_checkpoint

__all__ = ["MemoryBlock", "TaehvNet", "TinyCoder", "conv2d", "conv_relu", "load_file", "per_frame",
           "place", "random_init", "read_taehv", "unset"]

_BLOCK_CONVS = {"c1": 0, "c2": 2, "c3": 4}  # a block's convs in a checkpoint


def conv2d(n_in: int, n_out: int, *, bias: bool = True, kernel: int = 3,
           stride: int = 1) -> torch.nn.Conv2d:
    """A 2-D conv padded to keep the size (``stride`` 2: to halve an even one)."""
    return torch.nn.Conv2d(n_in, n_out, kernel, padding=kernel // 2, bias=bias, stride=stride)


def conv_relu(conv: torch.nn.Conv2d, x: torch.Tensor, residual: torch.Tensor | None = None,
              weight: torch.Tensor | None = None) -> torch.Tensor:
    """relu(conv(x) + bias [+ residual]) for x [N, C_in, h, w] (any layout; channels-last
    data gives channels-last output) and ``residual`` [N, C_out, h', w'] in the output's
    layout; ``weight`` replaces the conv's (a padded copy). One fused cuDNN call on CUDA
    in fp16 / bf16 (module doc), the separate ops elsewhere."""
    w = conv.weight if weight is None else weight
    if x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and conv.bias is not None:
        args = (conv.stride, conv.padding, conv.dilation, conv.groups)
        if residual is None:
            return torch.cudnn_convolution_relu(x, w, conv.bias, *args)
        return torch.cudnn_convolution_add_relu(x, w, residual, 1.0, conv.bias, *args)
    y = F.conv2d(x, w, conv.bias, conv.stride, conv.padding, conv.dilation, conv.groups)
    return F.relu(y if residual is None else y.add_(residual))


def per_frame(fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` over the frames of ``x`` [B, T, C, h, w], as one batch of B T images."""
    y = fn(x.flatten(0, 1))
    return y.unflatten(0, x.shape[:2])


class MemoryBlock(torch.nn.Module):
    """Residual block over a frame and the block's input one frame earlier (module doc)."""

    def __init__(self, width: int):
        super().__init__()
        self.c1 = conv2d(2 * width, width)
        self.c2, self.c3 = conv2d(width, width), conv2d(width, width)

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.of_pair(torch.cat([x, past], dim=1), x)

    def of_pair(self, pair: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The block of ``pair`` [N, 2C, h, w], [x_t, x_{t-1}] already side by side (in
        whatever layout), and x [N, C, h, w] (module doc)."""
        h = conv_relu(self.c2, conv_relu(self.c1, pair))
        return conv_relu(self.c3, h, residual=x)

    def over_time(self, x: torch.Tensor, before: torch.Tensor):
        """x [B, T, C, h, w] and ``before`` [B, C, h, w], the input frame preceding x[:, 0]
        -> (outputs [B, T, C, h, w], x's last frame: the next chunk's ``before``)."""
        past = torch.cat([before.unsqueeze(1), x[:, :-1]], dim=1)
        out = self(x.flatten(0, 1), past.flatten(0, 1)).unflatten(0, x.shape[:2])
        return out, x[:, -1]

    @staticmethod
    def taehv_names(mine: str, theirs: str) -> dict[str, str]:
        """This block's parameter names under ``mine`` -> a checkpoint's under ``theirs``."""
        return {f"{mine}.{conv}.{p}": f"{theirs}.conv.{j}.{p}"
                for conv, j in _BLOCK_CONVS.items() for p in ("weight", "bias")}


class TaehvNet(torch.nn.Module):
    """A network holding one part of a TAEHV checkpoint. Subclasses define ``PART``
    ("decoder" or "encoder": the checkpoint keys' prefix), ``taehv_names``, the
    `random_init` rule ``init_rule(name) -> (linear, gain, bias)`` and
    ``latent_channels_of(state)``, and set ``latent_channels``."""

    PART = ""

    def taehv_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights under the TAEHV checkpoint's names (this part's keys only)."""
        own = self.state_dict()
        return {theirs: own[mine] for mine, theirs in self.taehv_names().items()}

    def load_taehv(self, state: dict, where: str = "state") -> None:
        """Load this part's keys of a TAEHV state dict (the other part's keys are
        ignored). ValueError naming the missing and unexpected keys of this part, or a
        key of another shape; nothing is loaded then."""
        names = self.taehv_names()
        want = list(names.values())
        other = "encoder." if self.PART == "decoder" else "decoder."
        given = [k for k in state if not k.startswith(other)]
        missing = [k for k in want if k not in state]
        unexpected = sorted(set(given) - set(want))
        if missing or unexpected:
            raise ValueError(f"{where} is not a TAEHV {self.PART} of this layout "
                             f"({self.latent_channels} latent channels): {len(missing)} missing "
                             f"{self.PART} keys {missing[:5]}, {len(unexpected)} unexpected "
                             f"keys {unexpected[:5]}")
        own = self.state_dict()
        for mine, theirs in names.items():
            if tuple(state[theirs].shape) != tuple(own[mine].shape):
                raise ValueError(f"{where}: {theirs} has shape {list(state[theirs].shape)}, this "
                                 f"layout's is {list(own[mine].shape)}")
        self.load_state_dict({mine: state[theirs] for mine, theirs in names.items()})


@torch.no_grad()
def random_init(net: TaehvNet, seed: int = 0) -> None:
    """Draw ``net``'s weights from a generator seeded with ``seed`` (the global RNG is
    untouched), conv by conv in module order: normal, std gain * sqrt(2 / fan_in) before
    a ReLU and gain * sqrt(1 / fan_in) before none (``linear``), biases filled; the
    net's ``init_rule(name)`` gives (linear, gain, bias) per conv."""
    g = torch.Generator().manual_seed(seed)
    for name, m in net.named_modules():
        if isinstance(m, torch.nn.Conv2d):
            linear, gain, bias = net.init_rule(name)
            std = gain * ((1.0 if linear else 2.0) / m.weight[0].numel()) ** 0.5
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * std)
            if m.bias is not None:
                m.bias.fill_(bias)


def unset(net_class, *args) -> TaehvNet:
    """A ``net_class(*args)`` on the CPU whose weights are left unset (no draw from the
    global RNG), for `random_init` or `TaehvNet.load_taehv` to set every one."""
    with torch.device("meta"):
        net = net_class(*args)
    return net.to_empty(device="cpu")


def read_taehv(path) -> dict[str, torch.Tensor]:
    """The state dict of a local TAEHV checkpoint (``.pth`` / ``.pt`` / ``.safetensors``)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"path {path!r} is not a local checkpoint file (nothing is downloaded)")
    return read_checkpoint(path)


def load_file(net_class, path) -> TaehvNet:
    """A ``net_class`` of the default widths holding its part of the local TAEHV
    checkpoint ``path`` (latent channels read from it); ValueError naming the path
    for a file that is absent or unreadable, or the keys for another layout."""
    state = read_taehv(path)
    net = unset(net_class, net_class.latent_channels_of(state))
    net.load_taehv(state, where=f"checkpoint {os.fspath(path)!r}")
    return net


class TinyCoder:
    """What the tiny streaming coders (`TinyStreamingDecoder`, `TinyStreamingEncoder`) do
    alike over a net of class ``NET``: the constructor (``net``, ``sequences``,
    ``use_graphs``, ``device``: their docstrings say what each means), checked, setting
    ``net`` (moved to ``device``, default the net's), ``sequences``, ``device``,
    ``dtype`` (the net's), ``latent_channels``, ``use_graphs``; a coder of random
    weights (`_random`) or of a checkpoint (`from_file`, or `read_net` then `from_net`:
    a file read and checked before anything else is built); the state's layout, each
    memory block's carried frame (`_layout`); the chunk program (`_chunk`), between the
    coder's ``_net_input`` and ``_output``."""

    NET = TaehvNet

    def __init__(self, net, *, sequences=None, use_graphs=None, device=None):
        from framekv.ops import resolve_device

        if not isinstance(net, self.NET):
            raise ValueError(f"net must be a {self.NET.__name__}, got {type(net).__name__}")
        self.sequences = check_count("sequences", sequences)
        self.device = resolve_device(next(net.parameters()).device if device is None else device)
        self.net = net.to(self.device).eval().requires_grad_(False)
        self.dtype, self.latent_channels = next(net.parameters()).dtype, net.latent_channels
        self.use_graphs = self._graphs_on(use_graphs, self.device)
        self._start_rows()

    @classmethod
    def _random(cls, seed: int, latent_channels: int, size, device, dtype, kwargs):
        """A coder of a ``NET(latent_channels, size)`` of weights drawn from ``seed``."""
        check_count("latent_channels", latent_channels)
        net = unset(cls.NET, latent_channels, size)
        random_init(net, seed)
        return place(cls, net, device, dtype, kwargs)

    @classmethod
    def from_file(cls, path, *, device=None, dtype=None, **kwargs):
        """A coder of a local TAEHV checkpoint (``taew2_1.pth``, ``torch.load`` with
        ``weights_only``, or ``.safetensors``): its keys of this coder's part, the other
        part's ignored; latent channels read from it (``NET.latent_channels_of``); dtype
        default bf16 on CUDA, fp32 on CPU; ``kwargs`` go to the constructor. ValueError
        naming the path for a file that is absent or unreadable, or the keys for another
        layout (`TaehvNet.load_taehv`: the missing and the unexpected keys named)."""
        return cls.from_net(cls.read_net(path), device=device, dtype=dtype, **kwargs)

    @classmethod
    def read_net(cls, path):
        """The ``NET`` of a local TAEHV checkpoint, read and checked on the CPU (as
        `from_file` reads it), for `from_net` once the rest is built."""
        return load_file(cls.NET, path)

    @classmethod
    def from_net(cls, net, *, device=None, dtype=None, **kwargs):
        """A coder of ``net`` (`read_net`'s) on ``device`` in ``dtype`` (default bf16 on
        CUDA, fp32 on CPU); ``kwargs`` go to the constructor."""
        return place(cls, net, device, dtype, kwargs)

    def _chunk(self, first: bool, write: bool):
        """The chunk program ``fn(rows, <INPUT>)``: the rows' carried frames read (zeros
        when ``first``: a video's start), ``NET.stream`` over ``_net_input(x, first)``,
        the new carried frames written back with ``write`` (a graph's warm-up must not
        advance them), ``_output(y, first)`` returned."""
        net, arena, name, cls = self.net, self._cache, self.INPUT, type(self)

        @torch.no_grad()
        def fn(rows: torch.Tensor, **inputs) -> torch.Tensor:
            memory = arena.read(rows, first)
            y, carried = net.stream(cls._net_input(inputs[name], first), memory)
            if write:
                arena.scatter(rows, carried)
            return cls._output(y, first)

        return fn

    def _layout(self, size: tuple[int, int]) -> CacheLayout:
        shapes = self.net.memory_shapes(size)
        return CacheLayout(slots=len(shapes), shapes=shapes, latent_size=tuple(size),
                           dtypes=(self.dtype,) * len(shapes))


def place(cls, net, device, dtype, kwargs):
    """``cls(net, **kwargs)`` with the net on ``device`` in ``dtype`` (default bf16 on
    CUDA, fp32 on CPU)."""
    from framekv.ops import resolve_device

    dev = resolve_device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return cls(net.to(dev, dtype), device=dev, **kwargs)
