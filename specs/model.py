"""The shapes of a Wan-style causal video DiT."""
from __future__ import annotations

from typing import Any

import msgspec

from .checks import check_choice, check_int, check_int_tuple, check_power_of_two, check_str

#: Weight and K/V element types. The GPU path runs bf16/fp16; float32 exists for the
#: CPU reference path and tests.
DTYPES: tuple[str, ...] = ("bfloat16", "float16", "float32")

#: Largest K/V cache page; a page must fit a kernel's shared-memory tile comfortably.
MAX_TOKENS_PER_PAGE = 1024


def check_dtype(owner: str, value: Any) -> None:
    """Raise ValueError unless ``value`` names a supported dtype."""
    check_choice(f"{owner}.dtype" if owner else "dtype", value, DTYPES)


def check_head_dim(owner: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a head size the attention kernels accept."""
    check_int(owner, "head_dim", value, minimum=1)
    # cuDNN and the 16-byte vectorised copies need rows of whole 8-element groups.
    if value % 8:
        raise ValueError(f"{owner}.head_dim must be a multiple of 8, got {value}")


def check_tokens_per_page(owner: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a power of two in [1, MAX_TOKENS_PER_PAGE]."""
    check_power_of_two(owner, "tokens_per_page", value, maximum=MAX_TOKENS_PER_PAGE)


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A causal video DiT: self-attention over prompt, window and chunk; a patchified latent.

    Attributes:
        name: a label for reports.
        num_layers: transformer blocks.
        hidden_size: model width, ``num_heads * head_dim``.
        num_heads: query heads.
        num_kv_heads: K/V heads; ``num_heads`` must be a multiple (GQA; equal is MHA).
        head_dim: elements per head, a multiple of 8.
        ffn_size: inner width of each block's MLP.
        in_channels: latent channels (also the channels the model predicts).
        patch_size: (t, h, w) patch in latent pixels. t must be 1: a token frame is one
            latent frame, which is what lets frame-causal blocks be whole frames.
        latent_height: latent frame height, a multiple of the patch height.
        latent_width: latent frame width, a multiple of the patch width.
        text_dim: width of the text-encoder embeddings the prompt tokens come from.
        freq_dim: width of the sinusoidal timestep embedding (even).
        dtype: weight and K/V dtype: "bfloat16", "float16" or "float32".
        tokens_per_page: K/V cache page size, a power of two in [1, 1024].
        seed: seed of the random weights the reference model draws.
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    in_channels: int
    patch_size: tuple[int, int, int]
    latent_height: int
    latent_width: int
    text_dim: int
    freq_dim: int = 256
    dtype: str = "bfloat16"
    tokens_per_page: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        check_str("ModelSpec", "name", self.name)
        for field in ("num_layers", "num_heads", "num_kv_heads", "ffn_size",
                      "in_channels", "text_dim", "freq_dim"):
            check_int("ModelSpec", field, getattr(self, field), minimum=1)
        check_head_dim("ModelSpec", self.head_dim)
        self._check_heads()
        self._check_patch()
        if self.freq_dim % 2:
            raise ValueError(f"ModelSpec.freq_dim must be even, got {self.freq_dim}")
        check_dtype("ModelSpec", self.dtype)
        check_tokens_per_page("ModelSpec", self.tokens_per_page)
        check_int("ModelSpec", "seed", self.seed, minimum=0)

    def _check_heads(self) -> None:
        check_int("ModelSpec", "hidden_size", self.hidden_size, minimum=1)
        if self.hidden_size != self.num_heads * self.head_dim:
            raise ValueError(
                "ModelSpec.hidden_size must equal num_heads * head_dim "
                f"({self.num_heads} * {self.head_dim} = {self.num_heads * self.head_dim}), "
                f"got {self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec.num_kv_heads must divide num_heads ({self.num_heads}), "
                f"got {self.num_kv_heads}")

    def _check_patch(self) -> None:
        patch = check_int_tuple("ModelSpec", "patch_size", self.patch_size, minimum=1)
        if len(patch) != 3:
            raise ValueError(f"ModelSpec.patch_size must hold 3 entries (t, h, w), got {patch}")
        if patch[0] != 1:
            raise ValueError(
                f"ModelSpec.patch_size[0] must be 1 (one latent frame per token frame), "
                f"got {patch[0]}")
        for field, size, p in (("latent_height", self.latent_height, patch[1]),
                               ("latent_width", self.latent_width, patch[2])):
            check_int("ModelSpec", field, size, minimum=1)
            if size % p:
                raise ValueError(
                    f"ModelSpec.{field} must be a multiple of the patch size ({p}), got {size}")
        msgspec.structs.force_setattr(self, "patch_size", patch)

    @property
    def tokens_per_frame(self) -> int:
        """Tokens one latent frame becomes: (H / ph) * (W / pw)."""
        _, ph, pw = self.patch_size
        return (self.latent_height // ph) * (self.latent_width // pw)

    @property
    def patch_dim(self) -> int:
        """Latent values one token holds: in_channels * pt * ph * pw."""
        pt, ph, pw = self.patch_size
        return self.in_channels * pt * ph * pw

    @property
    def torch_dtype(self):
        """The torch dtype of the weights (imports torch only when asked)."""
        import torch

        return getattr(torch, self.dtype)

    def parameter_count(self) -> int:
        """Weights of the reference model of these shapes (`CausalVideoDiT`), counted
        from the shapes alone, so that a size can be checked before anything is built.

        Per block: fused QKV (hidden -> (H + 2 H_kv) * D), the two per-head QK norms, the
        output projection, the MLP and its 6-row modulation; around the blocks: the
        patch, text and time embeddings, the time projection (6 modulation rows), the
        head and its 2-row modulation. Every Linear has a bias.
        """
        hid, H, Hkv, D, ffn = (self.hidden_size, self.num_heads, self.num_kv_heads,
                               self.head_dim, self.ffn_size)
        qkv = (H + 2 * Hkv) * D
        block = (hid * qkv + qkv + 2 * D + H * D * hid + hid + hid * ffn + ffn + ffn * hid
                 + hid + 6 * hid)
        embed = (self.patch_dim * hid + hid + self.text_dim * hid + hid + hid * hid + hid
                 + self.freq_dim * hid + hid + hid * hid + hid + hid * 6 * hid + 6 * hid)
        head = 2 * hid + hid * self.patch_dim + self.patch_dim
        return self.num_layers * block + embed + head

