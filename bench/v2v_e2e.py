"""The end-to-end part of `framekv.bench.v2v`: a video's frames in, restyled frames out,
beside text to video in the same run, over the same transformer and decoders.

All weights random (`framekv.bench.pixels`' build: the transformer and umt5-xxl's
encoder of the preset's config, each decoder, and the encoder that follows it: the Wan
VAE's `StreamingVAEEncoder` for ``wan``, `TinyStreamingEncoder` for ``tiny``). Sizes
are the preset's (``wan-1.3b``: 480 x 832 video, 3-frame latent chunks, its steps
1000, 750, 500, 250) with a ``window``-frame window. Per decoder, three modes:

    text    text to video: each chunk from noise, the Euler sampler over every step
    text-matched
            text to video over as many steps as ``video`` runs (evenly spaced down from
            1000, as `framekv.engine.wan.preset_sizes` spaces a preset's): the baseline
            that leaves the encoder as the only difference, ``video_vs_text_matched``
            (video's steady fps over this one's) per decoder
    video   video to video: each chunk's input frames (a video's first chunk 1 + 4 (F -
            1), then 4 F; random frames in [-1, 1]) encoded, then the ``v2v`` sampler
            at ``strength`` over the Euler sampler (0.75 of the 4-step list: the three
            steps from 750; `framekv.engine.samplers.VideoToVideoSampler`), as
            ``framekv generate --video-in`` runs a chunk

Each chunk's frames are decoded through `DecodeLane` (on CUDA beside the next chunk's
transformer), every graph captured beforehand. The six runs (mode x decoder) are taken
in turn, ``repeats`` rounds, each round's order rotated one place on; each run twice:

    free    as fast as it goes, from the prompt's text: the first frame's time (text in,
            the first chunk's frames on the host), video frames per second once the
            window is full (`framekv.bench.pixels.run_rates`: the steady chunks, the
            drained last one left out) and over the whole run
    camera  the input as a camera at ``input_fps`` gives it: frame j arrives at j /
            input_fps s, and a chunk starts once its last input frame arrived (text to
            video paced alike, so the two differ by the encoder and the steps). A
            chunk's latency is the time its frames are on the host less its last input
            frame's arrival; p50, p99 and max over every chunk of every round

Medians over the rounds; then, per run, the encode, the transformer and the decode each
alone per steady chunk (one after the other, CUDA events: `framekv.bench.pixels.stage_ms`).
"""
from __future__ import annotations

import functools
import statistics
import time

import torch

from .pixels import (_latents, _release, _sync, build_decoder, chunk_video_frames,
                     roll_lane, run_rates, stage_ms, window_fill)
from .timing import round_order, summary

MODES = ("text", "text-matched", "video")
#: the decoders the part runs (each with the encoder that follows it)
DECODERS = ("wan", "tiny")
#: the presets the bench runs at (a shipped config's), and that config
PRESET_CONFIGS = {"tiny": "tiny", "wan-1.3b": "1.3b", "wan-14b": "14b"}


def build_encoder(kind: str, vae, device, graphs: bool):
    """A one-row encoder of ``kind`` ("wan", "wan-modules", "tiny", or "wan-foldN": the
    fused Wan encoder with its causal convs of fewer than N input channels time-folded,
    `FusedEncoder`'s ``fold_below``) for ``vae``'s latent space (tiny: random, seed 0)."""
    from framekv.engine.wan import StreamingVAEEncoder, TinyStreamingEncoder
    from framekv.engine.wan.vae_encoder_fused import FusedEncoder

    if kind.startswith("wan-fold"):           # the encoder's program weights, built so
        fold = functools.partial(FusedEncoder, fold_below=int(kind[len("wan-fold"):]))
        cls = type("FoldedEncoder", (StreamingVAEEncoder,), {"FUSED": fold})
        return cls(vae, sequences=1, use_graphs=graphs)
    if kind.startswith("wan"):
        return StreamingVAEEncoder(vae, sequences=1, use_graphs=graphs, fused=kind == "wan")
    return TinyStreamingEncoder.random(latent_channels=vae.config.z_dim, device=device,
                                       sequences=1, use_graphs=graphs)


def input_clips(frame_size, latent_frames: int, steady: int, device) -> list[torch.Tensor]:
    """A video's first chunk, then ``steady`` later chunks: frames [1, 3, F_i, H, W] in
    [-1, 1], random."""
    from framekv.engine.wan import StreamingVAEEncoder as E

    g = torch.Generator().manual_seed(0)
    sizes = [E.video_frames(latent_frames, True)] + [E.video_frames(latent_frames, False)] * steady
    return [(torch.rand(1, 3, f, *frame_size, generator=g) * 2 - 1).to(device) for f in sizes]


def camera_arrivals(latent_frames: int, chunks: int, fps: float) -> list[float]:
    """Seconds after the first frame at which each chunk's last input frame arrives from
    a camera of ``fps`` frames a second (frame j at j / fps)."""
    from framekv.engine.wan import StreamingVAEEncoder as E

    last, out = -1, []
    for i in range(chunks):
        last += E.video_frames(latent_frames, i == 0)
        out.append(last / fps)
    return out


def percentiles(samples: list[float]) -> dict[str, float]:
    """p50, p99 and max of ``samples`` (interpolated between the nearest ranks)."""
    if len(samples) == 1:
        return {"p50": samples[0], "p99": samples[0], "max": samples[0]}
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    return {"p50": cuts[49], "p99": cuts[98], "max": max(samples)}


class _Run:
    """One mode over one decoder: its rollout, encoder, decoder and chunk stages."""

    def __init__(self, mode, rollout, enc, dec, clips, noises):
        self.mode, self.rollout, self.enc, self.dec = mode, rollout, enc, dec
        self.clips, self.noises = clips, noises
        self.stages = [self._encode, self._v2v] if mode == "video" else [self._t2v]

    def _encode(self, i: int):
        clip = self.clips[0] if i == 0 else self.clips[1 + (i - 1) % (len(self.clips) - 1)]
        return i, self.enc.encode(clip)                              # [1, C, F, H, W]

    def _v2v(self, encoded):
        from framekv.engine.step import sampler_inputs

        i, lat = encoded
        r = self.rollout
        inputs = sampler_inputs(r.sampling, [(0, i)], r.chunk_shape, sources=[lat[0]])
        return r.step(self.noises[i], inputs)                        # [1, C, F, H, W]

    def _t2v(self, i: int):
        return self.rollout.step(self.noises[i])

    def step(self, i: int):
        """Chunk i's latents through every stage but the decode."""
        x = i
        for stage in self.stages:
            x = stage(x)
        return x

    def start(self, prompt: str | None) -> None:
        """Every part back at a video's start (``prompt`` set, if given)."""
        self.rollout.reset()
        self.enc.reset()
        self.dec.reset()
        if prompt is not None:
            self.rollout.set_prompt(prompt)
        _sync(self.dec.device)


def _roll(run: _Run, prompt: str, arrivals=None) -> list[float]:
    """One run (free: from the prompt's text; camera: paced by ``arrivals``, its prompt
    set first); each chunk's time out."""
    from framekv.engine.decode_lane import DecodeLane

    run.start(None if arrivals is None else prompt)
    t0 = time.perf_counter()
    if arrivals is None:
        run.rollout.set_prompt(prompt)
    return roll_lane(run.step, DecodeLane(run.dec), len(run.noises), t0, arrivals)[0]


def _rounds(runs: dict, repeats: int, arrivals, counts, fill, progress) -> dict:
    """Each run free and with the camera, the runs in turn (rotated), ``repeats``
    rounds; per run its rates per round and its latencies."""
    got = {name: {"free": [], "latency_s": []} for name in runs}
    for r in range(repeats):
        for name in round_order(list(runs), r, True):
            progress(f"e2e round {r + 1}/{repeats}: {name}")
            prompt = f"a red fox running through fresh snow at dawn, round {r} {name}"
            got[name]["free"].append(run_rates(_roll(runs[name], prompt), counts, fill))
            done = _roll(runs[name], prompt, arrivals)
            got[name]["latency_s"] += [d - a for d, a in zip(done, arrivals)]
    return got


def _summarise(got: dict, run: _Run, fill: int, input_fps: float) -> dict:
    """A run's medians over the rounds, its latencies and its stages alone."""
    free = got["free"]
    res = {k: statistics.median(f[k] for f in free)
           for k in ("first_frame_s", "steady_fps", "overall_fps", "steady_chunk_ms")}
    res["steady_fps_rounds"] = [f["steady_fps"] for f in free]
    res["video_frames"] = free[0]["video_frames"]
    res["latency_s"] = percentiles(got["latency_s"])
    res["keeps_up"] = res["steady_fps"] >= input_fps
    run.start("a red fox running through fresh snow at dawn, stages")
    times = stage_ms(run.stages + [run.dec.decode], range(len(run.noises)), run.dec.device)
    names = (["encode_ms"] if run.mode == "video" else []) + ["dit_ms", "decode_ms"]
    res.update({n: summary(t[fill:]) for n, t in zip(names, times)})
    res["steps"] = len(run.rollout.sampling.timesteps)
    return res


def even_timesteps(n: int) -> tuple[float, ...]:
    """``n`` timesteps evenly spaced down from 1000 (a preset's spacing)."""
    return tuple(1000.0 * (n - i) / n for i in range(n))


def _rollout(model, text, mode: str, sizes: dict, window_frames: int, strength: float,
             graphs: bool, timesteps=None):
    from framekv.engine import WanRollout
    from framekv.engine.samplers import DEFAULT_SAMPLER, VIDEO_SAMPLER

    video = {"sampler": VIDEO_SAMPLER,
             "sampler_options": {"base": DEFAULT_SAMPLER, "strength": strength}}
    return WanRollout(model, latent_size=tuple(sizes["latent_size"]),
                      frames_per_chunk=sizes["frames_per_chunk"], window_frames=window_frames,
                      timesteps=timesteps or sizes["timesteps"], prompt_tokens=text.max_tokens,
                      text_encoder=text, use_graphs=graphs, **(video if mode == "video" else {}))


def measure_e2e(*, preset: str = "wan-1.3b", device="cuda", window_frames: int = 21,
                strength: float = 0.75, chunks: int = 6, repeats: int = 3,
                input_fps: float = 16.0, decoders=DECODERS, progress=print) -> dict:
    """The end-to-end part (module doc) at ``preset``'s sizes, ``chunks`` chunks timed
    once the window is full, for each of ``decoders``."""
    from framekv.engine.wan import TextEncoder, build_model, build_vae, preset_sizes

    if chunks < 2:
        raise ValueError(f"chunks must be at least 2 (steady chunks timed), got {chunks}")
    dev, config = torch.device(device), PRESET_CONFIGS[preset]
    sizes = preset_sizes(preset)
    F, (H, W) = sizes["frames_per_chunk"], sizes["latent_size"]
    fill = window_fill(window_frames, F)
    n, graphs = fill + chunks, dev.type == "cuda"
    progress(f"building the {config} transformer, text encoder and coders (random)")
    model = build_model(config, device=dev)
    text = TextEncoder.from_config(config, device=dev, max_tokens=sizes["prompt_tokens"])
    vae = build_vae(config, device=dev)
    rollouts = {m: _rollout(model, text, m, sizes, window_frames, strength, graphs)
                for m in ("text", "video")}
    rollouts["text-matched"] = _rollout(
        model, text, "text", sizes, window_frames, strength, graphs,
        timesteps=even_timesteps(len(rollouts["video"].sampling.timesteps)))
    clips, noises = input_clips((8 * H, 8 * W), F, 2, dev), _latents(n, model.config.in_channels,
                                                                     F, (H, W), seed=1)
    runs = {}
    for kind in decoders:
        dec, enc = build_decoder(kind, config, dev, graphs), build_encoder(kind, vae, dev, graphs)
        if graphs:
            dec.capture(1, F, (H, W))
            enc.capture(1, F, (8 * H, 8 * W))
        runs.update({f"{m} {kind}": _Run(m, rollouts[m], enc, dec, clips, noises) for m in MODES})
    for r in rollouts.values():
        r.set_prompt("a warm-up prompt")
        if graphs:
            r.capture()
    arrivals = camera_arrivals(F, n, input_fps)
    got = _rounds(runs, repeats, arrivals, chunk_video_frames(F, n), fill, progress)
    res = {"gpu": torch.cuda.get_device_name(dev) if graphs else "cpu", "preset": preset,
           "config": config, "latent_size": [H, W], "video_size": [8 * H, 8 * W],
           "frames_per_chunk": F, "window_frames": window_frames, "chunks": n,
           "steady_from_chunk": fill, "timesteps": list(sizes["timesteps"]),
           "strength": strength, "input_fps": input_fps, "repeats": repeats, "decoders": {}}
    for name, run in runs.items():
        mode, kind = name.split()
        progress(f"e2e stages alone: {name}")
        res["decoders"].setdefault(kind, {})[mode] = _summarise(got[name], run, fill, input_fps)
    for kind, modes in res["decoders"].items():
        res.setdefault("video_vs_text_matched", {})[kind] = (
            modes["video"]["steady_fps"] / modes["text-matched"]["steady_fps"])
    for part in {id(p): p for run in runs.values() for p in (run.rollout, run.enc, run.dec)}.values():
        part.close()
    _release(dev)
    return res


def format_e2e(res: dict) -> str:
    """The end-to-end part as a table, one row a mode over a decoder."""
    H, W = res["video_size"]
    lines = [f"video to video on {res['gpu']}: {H}x{W}, {res['frames_per_chunk']}-frame latent "
             f"chunks, {res['window_frames']}-frame window, strength {res['strength']:g} "
             f"(text to video beside it); a {res['input_fps']:g} fps camera for the latencies",
             f"  {'decoder':<8}{'mode':<13}{'steps':>6}{'first s':>9}{'steady fps':>12}"
             f"{'overall':>9}{'lat p50 s':>11}{'p99 s':>8}{'enc ms':>8}{'DiT ms':>8}{'dec ms':>8}"]
    for kind, modes in res["decoders"].items():
        for mode, m in modes.items():
            enc = f"{m['encode_ms']['median']:.1f}" if "encode_ms" in m else "-"
            lines.append(f"  {kind:<8}{mode:<13}{m['steps']:>6}{m['first_frame_s']:>9.3f}"
                         f"{m['steady_fps']:>12.2f}{m['overall_fps']:>9.2f}"
                         f"{m['latency_s']['p50']:>11.3f}{m['latency_s']['p99']:>8.3f}{enc:>8}"
                         f"{m['dit_ms']['median']:>8.1f}{m['decode_ms']['median']:>8.1f}")
    lines += [f"  video / text-matched steady fps, {kind}: {r:.3f}"
              for kind, r in res.get("video_vs_text_matched", {}).items()]
    return "\n".join(lines)
