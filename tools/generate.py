"""`framekv generate`: a text prompt in, an H.264 MP4 out.

    framekv generate --prompt "a cat" --chunks 6 --out cat.mp4 [--config tiny|1.3b]
                     [--weights DIR] [--checkpoint FILE] [--decoder wan|tiny[:PATH]]
                     [PRESET] [--seed S] [--fp8-gemm] ...
    framekv generate --prompt "a watercolour cat" --video-in IN.mp4 --strength S
                     [--chunks N] [--decoder wan|tiny[:PATH]] --out OUT.mp4 ...

The prompt is encoded once (the text encoder), the transformer rolls out ``--chunks``
chunks of latents (`WanRollout`, one graph replay per chunk on CUDA), and one
streaming decoder decodes each chunk as it comes, so the MP4 is written chunk by
chunk and memory stays flat in the number of chunks: the Wan VAE's
(`StreamingVAEDecoder`), or with ``--decoder tiny[:PATH]`` the tiny TAEHV decoder's
(`TinyStreamingDecoder`: PATH, else ``taew2_1.safetensors``/``.pth`` in ``--weights``,
else random weights with ``--config``), which has the same frame counts. On CUDA each
chunk's decode runs on a stream of its own beside the next chunk's transformer
(`framekv.engine.decode_lane.DecodeLane`; ``--no-overlap``: one after the other),
with the same frames. A video of N chunks of F latent
frames (H x W) has 1 + 4 (F - 1) + 4 F (N - 1) frames of 8H x 8W pixels (the VAE's
first chunk starts with one frame, then four per latent frame).

Weights: ``--config`` (default tiny) builds transformer, VAE and text encoder with
random weights (the video is noise, but the whole path runs); ``--weights DIR`` loads
all three from a local diffusers folder; ``--checkpoint FILE`` replaces the
transformer's weights with a Self-Forcing generator checkpoint (VAE and text encoder
from ``--weights``, or random from ``--config``), sampled as Self-Forcing samples: the
``self_forcing`` sampler over the preset's steps warped by shift 5 (1000, 937.5, 833.3,
625 for four steps); ``--sampler`` (a registered sampler,
`framekv.engine.samplers`) and ``--shift`` override. ``--steps N`` runs N of the
preset's S steps: those at indices floor(i S / N), i = 0 .. N - 1 (evenly spaced, the
first always; `framekv.engine.samplers.pick_steps`), N in [1, S]. Nothing is
downloaded. The parts load as the server's do: ``--model`` (default wan-diffusers) is
the model family (`framekv.engine.models`, `framekv.tools.model_flags`), any with a
text encoder; diffusers' Wan loads through `framekv.engine.wan.pipeline.WanPipeline`.

``--fp8-gemm`` runs the transformer blocks' linear layers as fp8 GEMMs
(`framekv.engine.fp8_linear`; the config's in and out features must be multiples of
16: 1.3b's are, tiny's are not); ``--kv-dtype fp8`` keeps the K/V pool in float8 e4m3.

The sizes are those of PRESET (or ``--preset``; default: the config's,
`framekv.engine.wan.PRESETS`; with ``--weights``, the shipped config the transformer
matches). ``--seed`` seeds the chunks' noise as a server session of that seed draws it
(`framekv.engine.step.chunk_noise`, and the sampler's own static inputs, such as the
``self_forcing`` sampler's fresh noise, `framekv.engine.step.sampler_inputs`): the same
seed gives the same video, as a server session of it would; random weights are always
those of seed 0, so that the same config is the same model.

Video in (``--video-in IN.mp4 --strength S``, `framekv.tools.video_source`): the
chunks start from the input video's instead of from noise alone. The file is read with
PyAV, each frame resized (aspect kept) to cover the model's video size and
center-cropped; each chunk's 1 + 4 (F - 1), then 4 F frames are encoded by the encoder
that follows ``--decoder`` (the Wan VAE's, or the tiny encoder of the same checkpoint)
and sampled by the ``v2v`` sampler (`framekv.engine.samplers.VideoToVideoSampler`) over
the sampler and steps the run would otherwise take: the input latents noised with the
chunk's own noise to the first step at or below S x 1000, then the remaining steps
(strength 1: the input is not used, the text-to-video video bit for bit). The prompt
steers the restyle. ``--chunks N`` is then at most N (default every whole chunk of the
input), the video has a text-to-video run's frame count for that many chunks, and
``--fps`` defaults to the input's rate. A missing, unreadable or too short file, a
strength outside (0, 1] or one that runs none of the steps, ``--strength`` without
``--video-in``, and ``--sampler v2v`` by hand (``--video-in`` picks it; ``--sampler``
names its base) exit 2 before any model is built.

Progress goes to stderr, the summary line to stdout. A bad argument, missing weights
or an ``--out`` whose folder takes no new file exit 2 before any work, with one line
on stderr; a failure during the run exits 1;
either way nothing is left at ``--out`` (`MP4Writer` renames its file there only
after a clean finish).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time

from framekv.specs.checks import check_text

from .args import (nonnegative_int, positive_int, positive_number, prompt_text, strength,
                   writable_file)
from .conventions import add_preset_arguments, fail, one_line_errors
from .model_flags import SELF_FORCING_SHIFT, TEXT_MODEL, checked_model, model_parent
from .video import DEFAULT_CRF, check_mp4_path
from .video_source import VideoSource

__all__ = ["SELF_FORCING_SHIFT", "GenerateResult", "add_parser", "format_result", "generate",
           "mp4_file", "positive_number", "run"]


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """What `generate` wrote: ``frames`` of ``width`` x ``height`` at ``path`` (``size``
    bytes) at ``fps``, generated in ``seconds`` (rollout, decode and encode; a video
    input's read and encode too; ``setup_seconds`` loaded the models)."""

    frames: int
    width: int
    height: int
    seconds: float
    path: str
    size: int = 0
    setup_seconds: float = 0.0
    fps: int = 16

    @property
    def frames_per_second(self) -> float:
        """Video frames generated per second of ``seconds``."""
        return self.frames / self.seconds if self.seconds > 0 else float("inf")


def generate(prompt: str, *, chunks: int | None = None, out, model: str = TEXT_MODEL,
             config=None, weights=None, checkpoint=None, preset=None,
             negative_prompt: str | None = None, guidance_scale: float | None = None,
             sampler: str | None = None, shift: float | None = None, fps: int | None = None,
             seed: int = 0, device=None, use_graphs: bool | None = None,
             crf: int = DEFAULT_CRF, stream=None, progress: bool = True, on_frames=None,
             decoder: str | None = None, overlap: bool | None = None,
             steps: int | None = None, sampler_options=None, gemm_dtype=None, kv_dtype=None,
             video_in=None, strength: float | None = None) -> GenerateResult:
    """Generate ``chunks`` chunks for ``prompt`` and write them to the MP4 ``out``.

    Args as for the command (module doc); ``model``: a model family with a text
    encoder (`framekv.engine.models`; default diffusers' Wan), ``config``/``weights``/
    ``checkpoint``/``preset``/``decoder``: its options (None: the family's defaults;
    the decoder "wan", "tiny" or "tiny:PATH"); ``use_graphs`` None: graphs on CUDA;
    ``negative_prompt`` (default "") is the unconditional branch's prompt and needs
    ``guidance_scale``; ``sampler`` and ``shift`` default to Self-Forcing's with a
    checkpoint, else Euler at the preset's timesteps (shift 1); ``sampler_options``:
    the sampler's options; ``steps``: N of the preset's steps (module doc; None: all);
    ``overlap``: each chunk decoded on a stream of its own beside the next chunk's
    transformer (`DecodeLane`; None: on CUDA, False: one after the other);
    ``kv_dtype``, ``gemm_dtype``: the K/V pool and the blocks' GEMMs (None, or "fp8");
    ``stream``: where the header and progress go (default stderr);
    ``on_frames(index, frames)``: called with each chunk's uint8 frames [F', H, W, 3]
    as they are written; ``fps`` None: 16, or the input's rate with ``video_in``.
    ``video_in``: a video file the chunks start from, at ``strength`` in (0, 1]
    (module doc); ``chunks`` is then at most that many (None: every whole chunk of it).

    Raises ValueError (naming the argument) for a bad argument, before anything loads.
    """
    path = _check_args(prompt, chunks, out, negative_prompt, guidance_scale, fps, seed,
                       video_in, strength, sampler)
    from framekv.engine.models import ModelOptions, check_model
    from framekv.engine.rollout import resolve_device

    options = ModelOptions(preset=preset, config=config, weights=weights,
                           checkpoint=checkpoint, sampler=sampler,
                           sampler_options=sampler_options, shift=shift, steps=steps,
                           decoder=decoder, kv_dtype=kv_dtype, gemm_dtype=gemm_dtype)
    family = check_model(model, options)
    source = None
    if video_in is not None:        # the file and the strength, before anything loads
        source = VideoSource.check(video_in, strength, chunks, family, options)
        options, chunks = source.options, source.chunks
    fps = fps or (16 if source is None else source.fps)
    dev = resolve_device(device)
    stream = stream or sys.stderr
    t0 = time.perf_counter()
    # The family checks the weights, the checkpoint and the sampling before it loads.
    loaded = family.load(options, device=dev, text_encoder=True)
    with contextlib.ExitStack() as stack:
        r, decoder, latents = _start(stack, loaded, prompt, negative_prompt, guidance_scale,
                                     dev, use_graphs, source)
        setup = time.perf_counter() - t0
        print(_header(loaded, r, chunks, source), file=stream)
        t1 = time.perf_counter()
        frames, width, height = _roll(stack, r, decoder, chunks, seed, path, fps, crf,
                                      stream if progress else None, on_frames, overlap,
                                      latents)
    seconds = time.perf_counter() - t1
    return GenerateResult(frames=frames, width=width, height=height, seconds=seconds,
                          path=path, size=os.path.getsize(path), setup_seconds=setup, fps=fps)


def _check_args(prompt, chunks, out, negative_prompt, guidance_scale, fps, seed, video_in,
                strength, sampler) -> str:
    """ValueError naming the first bad argument (the model's options are its family's
    to check, a video input `VideoSource`'s); the absolute path of ``out``."""
    from framekv.engine.samplers import VIDEO_SAMPLER

    check_text("prompt", prompt)
    if video_in is None and strength is not None:
        raise ValueError(f"strength needs video_in (the video the chunks start from), got "
                         f"strength={strength!r} and video_in=None")
    if video_in is None and sampler == VIDEO_SAMPLER:
        raise ValueError(f"sampler {VIDEO_SAMPLER!r} is chosen by video_in and strength (the "
                         f"chunks start from that video), not by hand; got "
                         f"sampler={sampler!r} and video_in=None")
    for arg, value, low in (("chunks", chunks, 1), ("fps", fps, 1), ("seed", seed, 0)):
        if value is None and (arg == "fps" or video_in is not None):
            continue                    # the input's rate; every whole chunk of the input
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{arg} must be an integer >= {low}, got {value!r}")
    path = check_mp4_path(out)
    if guidance_scale is not None and not (isinstance(guidance_scale, (int, float))
                                           and guidance_scale > 0):
        raise ValueError(f"guidance_scale must be a number > 0, got {guidance_scale!r}")
    if negative_prompt is not None and guidance_scale is None:
        raise ValueError("negative_prompt needs guidance_scale (classifier-free guidance), "
                         f"got negative_prompt={negative_prompt!r} and guidance_scale=None")
    return path


def _start(stack, loaded, prompt, negative_prompt, guidance_scale, device, use_graphs,
           source):
    """The model's rollout under the prompt (encoded by its text encoder), its
    streaming decoder and, for a video ``source``, its chunks' input latents (an
    iterator; else None); all closed by ``stack``."""
    graphs = use_graphs if use_graphs is not None else device.type == "cuda"
    r = loaded.rollout(use_graphs=graphs, guidance_scale=guidance_scale)
    stack.callback(r.close)
    r.set_prompt(prompt, negative_prompt)
    decoder = loaded.decoder(use_graphs=graphs)
    stack.callback(decoder.close)
    if source is None:
        return r, decoder, None
    encoder = source.encoder(loaded, use_graphs=graphs)
    stack.callback(encoder.close)
    return r, decoder, stack.enter_context(contextlib.closing(source.latents(encoder)))


def _roll(stack, r, decoder, chunks, seed, path, fps, crf, stream, on_frames, overlap,
          latents=None):
    """Roll out, decode and write ``chunks`` chunks, each chunk's decode beside the next
    one's transformer on CUDA (`DecodeLane`); (frames, width, height). ``latents``: each
    chunk's input latents [C, F, H, W] in turn (the sampler's source), or None. The
    writer joins ``stack``: the video is finished (or discarded) when the stack closes."""
    from framekv.engine.decode_lane import DecodeLane
    from framekv.engine.step import chunk_noise, sampler_inputs

    from .demo import Progress

    bar = Progress(chunks, stream, label="generate") if stream is not None else None
    lane, out = DecodeLane(decoder, overlap=overlap), _Output(stack, path, fps, crf, on_frames)
    start = time.perf_counter()
    for i in range(chunks):
        # A server session's noise for the same seed (`framekv.engine.step`).
        noise = chunk_noise(seed, i, r.chunk_shape)[None]               # [1, C, F, H, W]
        source = None if latents is None else [next(latents)]           # [C, F, H, W]
        inputs = sampler_inputs(r.sampling, [(seed, i)], r.chunk_shape,  # each [1, ...]
                                sources=source)
        lane.submit(r.step(noise, inputs))                               # [1, C, F, H, W]
        # overlapped, chunk i - 1 is written once chunk i's transformer is queued
        while len(lane) > lane.overlap:
            out.write(lane.take()[0])                                    # [F', 8H, 8W, 3]
        if bar is not None:
            rate = out.frames / max(time.perf_counter() - start, 1e-9)
            bar.update(i + 1, f"chunk {i + 1}/{chunks}, {out.frames} frames, {rate:.1f} frames/s")
    for video in lane.drain():
        out.write(video[0])
    if bar is not None:
        bar.finish()
    return out.frames, out.writer.width, out.writer.height


class _Output:
    """The MP4 (opened at the first chunk's size) and ``on_frames``, chunk by chunk."""

    def __init__(self, stack, path, fps, crf, on_frames):
        self.stack, self.path, self.fps, self.crf, self.on_frames = stack, path, fps, crf, on_frames
        self.writer, self.frames, self.chunks = None, 0, 0

    def write(self, video) -> None:                     # uint8 [F', H, W, 3]
        from .video import MP4Writer

        if self.writer is None:
            self.writer = self.stack.enter_context(MP4Writer(
                self.path, fps=self.fps, width=video.shape[2], height=video.shape[1],
                crf=self.crf))
        self.writer.write(video)
        self.frames += video.shape[0]
        if self.on_frames is not None:
            self.on_frames(self.chunks, video)
        self.chunks += 1


def _header(loaded, r, chunks, source) -> str:
    _, F, H, W = r.chunk_shape
    return (f"framekv generate: {loaded.title}, device {r.device}, "
            f"{str(r.dtype).removeprefix('torch.')}"
            f"{'' if r.gemm_dtype == r.dtype else ', fp8 GEMMs'}; latent {H}x{W}, "
            f"{F}-frame chunks, {chunks} chunk(s); "
            f"{r.sampler} at t = {', '.join(f'{t:.1f}' for t in r.sampling.timesteps)}; "
            f"{loaded.decoder_title}" + ("" if source is None else f"; {source.describe(loaded)}"))


def format_result(result: GenerateResult, fps: int | None = None) -> str:
    """The summary line: frames, size, seconds, video frames per second, path (``fps``
    None: the video's own, ``result.fps``)."""
    fps = fps or result.fps
    return (f"framekv generate: {result.frames} frames of {result.width}x{result.height} "
            f"({result.frames / fps:.2f} s of video at {fps} fps, {result.size / 1024:.1f} KiB) "
            f"in {result.seconds:.2f} s, {result.frames_per_second:.2f} video frames/s "
            f"-> {result.path}")


def mp4_file(text: str) -> str:
    """A writable file path ending in ``.mp4`` (`framekv.tools.args.writable_file`)."""
    if not text.lower().endswith(".mp4"):
        raise argparse.ArgumentTypeError(f"must be a file ending in .mp4, got {text!r}")
    return writable_file(text)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = one_line_errors(subparsers.add_parser("generate",
                                              help="a text prompt in, an H.264 MP4 out",
                                              description=__doc__.split("\n\n")[0],
                                              parents=[model_parent(TEXT_MODEL)]))
    add_preset_arguments(p, default=None, note="the sizes; default the config's")
    p.add_argument("--prompt", type=prompt_text, required=True,
                   help="the text prompt (at least one word)")
    p.add_argument("--negative-prompt", default=None,
                   help="the unconditional branch's prompt (needs --guidance-scale)")
    p.add_argument("--guidance-scale", type=positive_number, default=None,
                   help="classifier-free guidance scale (default: none, as Self-Forcing runs)")
    p.add_argument("--chunks", type=positive_int, default=None,
                   help="chunks to generate (needed without --video-in; with it at most N, "
                        "default every whole chunk of the input)")
    p.add_argument("--out", type=mp4_file, required=True, metavar="FILE.mp4",
                   help="the MP4 to write")
    p.add_argument("--video-in", metavar="FILE", default=None,
                   help="a video the chunks start from (read with PyAV, each frame resized "
                        "to cover the model's size and center-cropped; needs --strength)")
    p.add_argument("--strength", type=strength, default=None, metavar="S",
                   help="with --video-in, in (0, 1]: how far back towards noise the input "
                        "goes (the steps at or below S x 1000 run; 1: the input is not used)")
    p.add_argument("--fps", type=positive_int, default=None,
                   help="frames per second (default 16; with --video-in the input's rate)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="noise seed (default 0)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    p.add_argument("--no-graphs", action="store_true", help="run every chunk eagerly")
    p.add_argument("--no-overlap", action="store_true",
                   help="decode each chunk after its transformer, not beside the next one's")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    """The command; its exit status (2: bad arguments or weights, 1: the run failed)."""
    try:
        _check_flags(args)
        _, options, _ = checked_model(args)     # the flags named as flags, before any load
        result = generate(args.prompt, chunks=args.chunks, out=args.out, model=args.model,
                          **{k: v for k, v in vars(options).items() if v is not None},
                          negative_prompt=args.negative_prompt,
                          guidance_scale=args.guidance_scale, fps=args.fps, seed=args.seed,
                          device=args.device, use_graphs=False if args.no_graphs else None,
                          progress=not args.no_progress,
                          overlap=False if args.no_overlap else None,
                          video_in=args.video_in, strength=args.strength)
    except (ValueError, FileNotFoundError, ImportError) as exc:
        return fail("generate", exc, 2)
    except (OSError, RuntimeError) as exc:
        return fail("generate", exc, 1)
    print(format_result(result))
    return 0


def _check_flags(args) -> None:
    """ValueError naming the flags that go together: --chunks or --video-in, and
    --strength with --video-in (--sampler offers no sampler a video input picks)."""
    if args.video_in is None and args.chunks is None:
        raise ValueError("--chunks N is needed (or --video-in FILE, whose whole chunks it "
                         "defaults to), got neither")
    if (args.video_in is None) != (args.strength is None):
        given = "--video-in without --strength" if args.strength is None else \
            "--strength without --video-in"
        raise ValueError(f"--video-in FILE and --strength S (in (0, 1]) go together, got "
                         f"{given}")
