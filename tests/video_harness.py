"""Video sessions on the CPU for tests/test_video_in.py and tests/test_serve_video_in.py: a
tiny Wan model (loaded once per process, `tiny_parts`), schedulers over its runner
sampling video to video at a strength (`video_scheduler`), frames and frames_in
messages, and the chunks the engine makes of given frames by hand (`by_hand`: a fresh
encoder, the v2v sampler's inputs with the input latents as source, a fresh rollout)."""
from __future__ import annotations

import argparse
import functools

import numpy as np
import torch

from framekv.engine.samplers import VIDEO_SAMPLER
from framekv.engine.serving import StreamScheduler
from framekv.engine.step import chunk_noise, sampler_inputs
from framekv.specs import wire


@functools.lru_cache(maxsize=None)
def tiny_parts():
    """The tiny Wan model (random weights, its text encoder, a tiny VAE) on the CPU."""
    from framekv.tools.model_flags import wan_factory

    return wan_factory(argparse.Namespace(config="tiny", preset=None, weights=None,
                                          device="cpu", cache_dir=None), use_graphs=False)


def v2v_runner(strength: float, **more):
    """A runner factory of the tiny model sampling video to video at ``strength``."""
    parts = tiny_parts()
    options = {"base": "euler", "strength": strength}
    return lambda **kw: parts.rollout(use_graphs=False, sampler=VIDEO_SAMPLER,
                                      sampler_options=options, **more, **kw)


def video_scheduler(strength: float = 0.5, *, decode: bool = False, encode: bool = True,
                    **kw) -> StreamScheduler:
    """A scheduler over `v2v_runner` with the tiny encoder (and decoder: ``decode``)."""
    parts = tiny_parts()
    return StreamScheduler(runner_factory=v2v_runner(strength),
                           encoder_factory=(lambda n: parts.encoder(n, use_graphs=False))
                           if encode else None,
                           decoder_factory=parts.decoder if decode else None, **kw)


def random_frames(n: int, size, seed: int) -> torch.Tensor:
    """``n`` frames fp32 [n, 3, H, W] in [-1, 1] of ``size`` (H, W), seeded."""
    return torch.rand(n, 3, *size, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def pictures(n: int, width: int, height: int, seed: int) -> list[np.ndarray]:
    """``n`` smooth uint8 [height, width, 3] pictures (they survive JPEG), seeded."""
    g = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    out = []
    for _ in range(n):
        a, b, c = g.uniform(0.02, 0.2, 3)
        img = np.stack([np.sin(a * x + c), np.cos(b * y), np.sin(a * x + b * y)], -1)
        out.append(((img + 1) * 127.5).astype(np.uint8))
    return out


def frames_in(images: list, fmt: str = "jpeg", **header) -> bytes:
    """A frames_in message of uint8 [H, W, 3] ``images`` as ``fmt`` (``header`` overrides
    fields)."""
    from framekv.tools.video import encode_image

    h, w = images[0].shape[:2]
    if fmt == "rgb24":
        blobs, sizes = [np.ascontiguousarray(i).tobytes() for i in images], None
    elif fmt == "png":
        blobs = [_png(i) for i in images]
        sizes = [len(b) for b in blobs]
    else:
        blobs = [encode_image(i, fmt, 90) for i in images]
        sizes = [len(b) for b in blobs]
    head = {"type": "frames_in", "format": fmt, "width": w, "height": h, "count": len(images),
            **({} if sizes is None else {"sizes": sizes}), **header}
    return wire.encode(head, b"".join(blobs))


def _png(image) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def by_hand(strength: float, seed: int, chunks: list[torch.Tensor], shape) -> list[torch.Tensor]:
    """The latents [C, F, H, W] of a video stream of ``seed`` whose chunk i's input is
    ``chunks[i]`` ([n, 3, H, W]), made by hand: a fresh encoder, the sampler's inputs
    with the input latents as source, a fresh one-sequence rollout."""
    parts = tiny_parts()
    runner = v2v_runner(strength)(sequences=1)
    runner.prefill_rows([0])
    enc = parts.encoder(1, use_graphs=False)
    out = []
    try:
        for i, frames in enumerate(chunks):
            source = enc.encode(frames.permute(1, 0, 2, 3)[None])[0].float()   # [C, F, h, w]
            inputs = sampler_inputs(runner.sampling, [(seed, i)], tuple(shape), sources=[source])
            out.append(runner.step(chunk_noise(seed, i, tuple(shape))[None], inputs)[0])
    finally:
        runner.close()
        enc.close()
    return out
