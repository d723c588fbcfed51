"""Which streaming decoder turns a Wan pipeline's latents into frames: ``"wan"`` (the
Wan VAE, `StreamingVAEDecoder`) or ``"tiny"`` / ``"tiny:PATH"`` (`TinyStreamingDecoder`
of a TAEHV ``taew2_1`` checkpoint), the ``--decoder`` of ``framekv serve`` and
``framekv generate``; and the encoder that follows a choice, for frames in
(`build_encoder`): the same VAE's `StreamingVAEEncoder`, or the `TinyStreamingEncoder`
of the same checkpoint.

``tiny`` without a path takes ``taew2_1.safetensors`` or ``taew2_1.pth`` from the
pipeline's diffusers folder; a pipeline of random parts (a config, no folder) gets a
random tiny decoder (seed 0) of its transformer's latent channels, as its VAE would be
random. Every choice is checked (`check_decoder`) before anything
loads, and a tiny checkpoint is read and checked (`read_tiny`) before any model is
built; a ValueError names the decoder and the value given.
"""
from __future__ import annotations

import os

#: the decoders one may name
DECODERS = ("wan", "tiny")
#: video pixels per latent pixel along H and W, for every decoder and encoder here
SPATIAL_SCALE = 8
#: what a tiny decoder's checkpoint may be (`TinyStreamingDecoder.from_file`)
TINY_SUFFIXES = (".pth", ".pt", ".safetensors")
#: the checkpoint ``tiny`` looks for in a diffusers folder, in this order
TINY_NAMES = ("taew2_1.safetensors", "taew2_1.pth")


def parse_decoder(value, *, name: str = "decoder") -> tuple[str, str | None]:
    """``(kind, path)`` of a decoder choice: ``"wan"``, ``"tiny"`` or ``"tiny:PATH"``
    (PATH a file of `TINY_SUFFIXES`). ValueError naming ``name`` and the value
    otherwise."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be wan, tiny or tiny:PATH, got {value!r}")
    kind, sep, path = value.partition(":")
    if kind not in DECODERS or (sep and (kind != "tiny" or not path)):
        raise ValueError(f"{name} must be wan, tiny or tiny:PATH (a TAEHV taew2_1 "
                         f"checkpoint), got {value!r}")
    if not sep:
        return kind, None
    if not os.path.isfile(path) or not path.lower().endswith(TINY_SUFFIXES):
        why = "no such file" if not os.path.isfile(path) else "not " + " / ".join(TINY_SUFFIXES)
        raise ValueError(f"{name} tiny:PATH must name a TAEHV checkpoint file "
                         f"({', '.join(TINY_SUFFIXES)}), got {path!r} ({why})")
    return kind, path


def tiny_checkpoint(path: str | None, weights, *, name: str = "decoder") -> str | None:
    """The tiny decoder's checkpoint: ``path``, else the one `TINY_NAMES` finds in the
    diffusers folder ``weights``; None (random weights) without a folder. ValueError
    for a folder holding none."""
    if path is not None or weights is None:
        return path
    for file in TINY_NAMES:
        found = os.path.join(weights, file)
        if os.path.isfile(found):
            return found
    raise ValueError(f"{name} tiny needs a TAEHV checkpoint: tiny:PATH, or "
                     f"{' or '.join(TINY_NAMES)} in the weights folder; got tiny and none "
                     f"in {os.fspath(weights)!r}")


def check_decoder(value, weights=None, *, name: str = "decoder") -> tuple[str, str | None]:
    """``(kind, checkpoint)`` of the choice ``value`` for a pipeline of the diffusers
    folder ``weights`` (None: random parts): `parse_decoder`, then `tiny_checkpoint`
    for a tiny one. ValueError naming ``name``."""
    kind, path = parse_decoder(value, name=name)
    return kind, tiny_checkpoint(path, weights, name=name) if kind == "tiny" else None


def read_tiny(path: str, *, name: str = "decoder"):
    """The `TinyDecoderNet` of the tiny checkpoint ``path`` on the CPU, read and checked
    (`TinyStreamingDecoder.read_net`); a ValueError naming ``name`` for a file that
    cannot be read or holds another layout."""
    from .tiny_decoder import TinyStreamingDecoder

    try:
        return TinyStreamingDecoder.read_net(path)
    except ValueError as exc:
        raise ValueError(f"{name} tiny:PATH: {exc}") from None


def build_decoder(kind: str, path: str | None, *, vae, sequences, use_graphs, device, dtype,
                  latent_channels: int, net=None):
    """The streaming decoder of a checked choice (`parse_decoder`, `tiny_checkpoint`):
    `StreamingVAEDecoder` over ``vae``, or `TinyStreamingDecoder` of ``net`` (`read_tiny`
    read it) or of ``path`` (None: random, seed 0, ``latent_channels``), in ``dtype``
    (None: the decoder's default)."""
    from .tiny_decoder import TinyStreamingDecoder
    from .vae import StreamingVAEDecoder

    return _build(StreamingVAEDecoder, TinyStreamingDecoder, kind, path, vae=vae,
                  sequences=sequences, use_graphs=use_graphs, device=device, dtype=dtype,
                  latent_channels=latent_channels, net=net)


def build_encoder(kind: str, path: str | None, *, vae, sequences, use_graphs, device, dtype,
                  latent_channels: int, net=None):
    """The streaming encoder that follows a checked decoder choice, so a video's frames
    come in through the same latent space its frames go out of: `StreamingVAEEncoder`
    over ``vae`` for ``wan``, or the `TinyStreamingEncoder` of the same TAEHV checkpoint
    ``path`` for ``tiny`` (None: random, seed 0, ``latent_channels``; ``net``: its
    encoder half read already, `TinyStreamingEncoder.read_net`), in ``dtype`` (None:
    the encoder's default). Arguments as `build_decoder`'s."""
    from .tiny_encoder import TinyStreamingEncoder
    from .vae_encoder import StreamingVAEEncoder

    return _build(StreamingVAEEncoder, TinyStreamingEncoder, kind, path, vae=vae,
                  sequences=sequences, use_graphs=use_graphs, device=device, dtype=dtype,
                  latent_channels=latent_channels, net=net)


def _build(wan, tiny, kind, path, *, vae, sequences, use_graphs, device, dtype,
           latent_channels, net):
    if kind == "wan":
        return wan(vae, sequences=sequences, use_graphs=use_graphs, device=device)
    opts = {"sequences": sequences, "use_graphs": use_graphs, "device": device, "dtype": dtype}
    if net is not None:
        return tiny.from_net(net, **opts)
    if path is None:
        return tiny.random(seed=0, latent_channels=latent_channels, **opts)
    return tiny.from_file(path, **opts)
