"""A video file as the input of ``framekv generate --video-in``: `VideoSource`, checked
before any model is built, then read, encoded and handed to each chunk.

`VideoSource.check(path, strength, chunks, family, options)` runs every check a video
input needs before anything is loaded or built (only the model's configs and the
file's header are read; the file is decoded only where its header does not count its
frames), in this order: ``strength`` is a number in (0, 1]; the model family has an
encoder, and its chunks' latent frames F and video size (H, W) come from its configs
(`ModelFamily.video_chunks`); the file exists, is a video and holds at least one whole
chunk (`framekv.tools.video_in.VideoInput`: 1 + 4 (F - 1) frames, then 4 F a chunk);
the model options become the video-to-video sampler over the sampler and steps they
would run, whose schedule must leave a step at that strength
(`ModelFamily.video_options`). ``chunks`` caps the chunks run (None: every whole chunk
the file holds; frames past the last whole chunk are not read). Each refusal is a
ValueError naming the argument or the file.

Once the model is loaded, `VideoSource.encoder(loaded)` builds the streaming encoder
that follows the decoder choice (`LoadedModel.encoder`: the Wan VAE's, or the tiny
encoder of the same checkpoint; on CUDA its two chunk graphs captured up front), and
`VideoSource.latents(encoder)` yields each chunk's input latents [C, F, H / 8, W / 8]
as the chunk is reached: its frames decoded from the file, resized to cover the
model's size (aspect kept) and center-cropped, in [-1, 1], then encoded, the
encoder's causal cache carried from chunk to chunk. A file that ends or breaks part way
is a RuntimeError: the run failed, its arguments did not.
"""
from __future__ import annotations

import dataclasses

from .video_in import VideoInput

__all__ = ["VideoSource"]


@dataclasses.dataclass(frozen=True)
class VideoSource:
    """A checked video input (module doc).

    Attributes:
        video: the file, as `VideoInput` chunks of the model's size.
        strength: how far back towards noise each chunk's input goes, in (0, 1].
        chunks: the chunks to run (at most the file's whole chunks).
        options: the model options with the video-to-video sampler.
    """

    video: VideoInput
    strength: float
    chunks: int
    options: object

    @classmethod
    def check(cls, path, strength, chunks: int | None, family, options) -> "VideoSource":
        """The video input ``path`` at ``strength`` for the model ``family`` of
        ``options`` (`ModelOptions`), at most ``chunks`` chunks (None: all the file's
        whole chunks). ValueError naming the first bad argument, before anything is
        built."""
        from framekv.engine.samplers import check_strength

        strength = check_strength(strength)
        frames, size = family.video_chunks(options)
        video = VideoInput(path, size=size, latent_frames=frames)
        options = family.video_options(options, strength)
        count = video.chunks if chunks is None else min(chunks, video.chunks)
        return cls(video=video, strength=strength, chunks=count, options=options)

    @property
    def fps(self) -> int:
        """The file's frame rate rounded to a whole number (16 where it names none)."""
        return max(1, round(self.video.fps)) if self.video.fps else 16

    def encoder(self, loaded, *, use_graphs: bool):
        """The loaded model's streaming encoder (one row), its graphs captured for this
        input's chunks where it runs them."""
        enc = loaded.encoder(use_graphs=use_graphs)
        if enc.use_graphs:
            enc.capture(1, self.video.latent_frames, self.video.size)
        return enc

    def latents(self, encoder):
        """Each chunk's input latents [C, F, H / 8, W / 8] in turn (module doc)."""
        chunks = self.video.read(self.chunks)
        while True:
            try:
                frames = next(chunks, None)                       # [3, F', H, W] fp32
            except ValueError as exc:                             # ended or broke part way
                raise RuntimeError(str(exc)) from None
            if frames is None:
                return
            yield encoder.encode(frames[None].to(encoder.device))[0]

    def describe(self, loaded) -> str:
        """The input in a phrase: the file, what is read of it, the encoder (a header)."""
        v = self.video
        rate = f" at {v.fps:g} fps" if v.fps else ""
        return (f"video in {v.path}: {v.frames} frames{rate}, {self.chunks} of its "
                f"{v.chunks} whole chunk(s) at {v.size[1]}x{v.size[0]} (resized to cover, "
                f"center-cropped), strength {self.strength:g} over "
                f"{self.options.sampler_options['base']}, {loaded.encoder_title}")
