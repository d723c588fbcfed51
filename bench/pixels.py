"""Prompt to pixels: the Wan VAE's streaming decode, and the whole path from a text
prompt to decoded frames on the host, on one GPU.

All weights random, in bf16 as ``torch_dtype`` would load them: the Wan 2.1 VAE, the
1.3B transformer, umt5-xxl's encoder (built-in byte tokenizer). Latent H x W (default
60 x 104: 480 x 832 video), chunks of F latent frames (4F video frames; the video's
first chunk decodes 1 + 4(F - 1)).

    decode      `StreamingVAEDecoder` eager against graphed: ms per chunk after the
                first (CUDA events, the two taken in turn, rotated), and the first chunk
    e2e         text -> `TextEncoder` -> `WanRollout` (a ``window``-frame window) ->
                `StreamingVAEDecoder` -> uint8 frames on the host, graphs captured
                beforehand (as a server does at start):
                  sequential   each chunk denoised, then decoded, on one stream
                  overlapped   chunk i decoded on a second stream while chunk i + 1
                               denoises (the latents are a copy, so nothing is shared)
                time to the first frame (the prompt's text in, the first chunk's
                frames on the host), video frames per second once the window is full
                and over the whole run, and the split: the DiT's chunk and the decode
                each alone

    python -m framekv.bench.pixels --json FILE      (also `framekv bench --sections pixels`)
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from .timing import (interleaved_device_times, require_cuda, stderr_progress, summary,
                     write_result)

MODES = ("sequential", "overlapped")


def _latents(chunks: int, C: int, F: int, size, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, C, F, *size, generator=gen) for _ in range(chunks)]


def measure_decode(vae, *, latent_size=(60, 104), frames_per_chunk: int = 3, iters: int = 10,
                   progress=print) -> dict:
    """ms per steady chunk (eager, graphed) and of a video's first chunk; max |eager -
    graphed| over the timed chunks."""
    from framekv.engine.wan import StreamingVAEDecoder

    C = vae.config.z_dim
    lats = [x.cuda() for x in _latents(iters + 4, C, frames_per_chunk, latent_size)]
    decs = {"eager": StreamingVAEDecoder(vae, use_graphs=False),
            "graphed": StreamingVAEDecoder(vae, use_graphs=True)}
    first = {}
    for name, dec in decs.items():
        progress(f"decode {name}: first chunk")
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(2):  # the second is warm: kernels chosen, graphs captured
            dec.reset()
            s.record()
            dec.decode(lats[0])
            e.record()
            torch.cuda.synchronize()
        first[name] = s.elapsed_time(e)
    progress("decode: steady chunks, eager and graphed in turn")
    outs = {n: [] for n in decs}

    def call(name):
        # Each decoder walks the same latents in order, so both caches hold the same
        # history and their frames are comparable chunk for chunk.
        def run():
            outs[name].append(decs[name].decode(lats[1 + len(outs[name]) % (len(lats) - 1)]))
        return run

    times = interleaved_device_times({n: call(n) for n in decs}, iters, warmup=1, rotate=True)
    diff = max(float((a.float() - b.float()).abs().max())
               for a, b in zip(outs["eager"], outs["graphed"]))
    F = frames_per_chunk
    res = {"latent_size": list(latent_size), "frames_per_chunk": F, "video_frames": 4 * F,
           "first_chunk_ms": first, "max_abs_diff_eager_graphed": diff,
           "arena_bytes": decs["graphed"].arena_bytes, "chunk_us": {}}
    for name, t in times.items():
        res["chunk_us"][name] = summary(t)
    for dec in decs.values():
        dec.close()
    return res


def _to_host(frames: torch.Tensor) -> torch.Tensor:
    """[1, 3, F', H, W] in [-1, 1] -> uint8 [F', H, W, 3] in pinned host memory (queued
    on the current stream; valid once it has run)."""
    u8 = ((frames[0].float() + 1) * 127.5).round_().clamp_(0, 255).to(torch.uint8)
    u8 = u8.permute(1, 2, 3, 0)                           # [F', H, W, 3]
    host = torch.empty(u8.shape, dtype=torch.uint8, pin_memory=True)
    return host.copy_(u8, non_blocking=True)


def _sequential(rollout, dec, noises, t0: float) -> tuple[list[float], list[float], list[float]]:
    """Host times at which each chunk's frames were on the host, and each chunk's DiT
    and decode ms (CUDA events)."""
    done, dit, vae = [], [], []
    for noise in noises:
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        ev[0].record()
        lat = rollout.step(noise)
        ev[1].record()
        host = _to_host(dec.decode(lat))
        ev[2].record()
        ev[2].synchronize()
        done.append(time.perf_counter() - t0)
        dit.append(ev[0].elapsed_time(ev[1]))
        vae.append(ev[1].elapsed_time(ev[2]))
        del host
    return done, dit, vae


def _overlapped(rollout, dec, noises, t0: float) -> list[float]:
    """Chunk i decoded on a side stream while chunk i + 1 denoises; host times as for
    `_sequential`."""
    side, done, pending = torch.cuda.Stream(), [], None
    for noise in noises:
        lat = rollout.step(noise)                    # a copy: the next step leaves it be
        ready = torch.cuda.Event()
        ready.record()
        if pending is not None:
            pending.synchronize()
            done.append(time.perf_counter() - t0)
        side.wait_event(ready)
        with torch.cuda.stream(side):
            host = _to_host(dec.decode(lat))
            pending = torch.cuda.Event()
            pending.record()
        lat.record_stream(side)
    pending.synchronize()
    done.append(time.perf_counter() - t0)
    return done


def measure_e2e(model, vae, encoder, *, latent_size=(60, 104), frames_per_chunk: int = 3,
                window_frames: int = 21, chunks: int = 6, modes=MODES, progress=print) -> dict:
    """Time to the first frame and video frames per second, prompt to host frames."""
    from framekv.engine import WanRollout
    from framekv.engine.wan import StreamingVAEDecoder

    F = frames_per_chunk
    fill = -(-(1 + window_frames) // F) + 1          # chunks until the window is full
    noises = _latents(fill + chunks, model.config.in_channels, F, latent_size, seed=1)
    rollout = WanRollout(model, latent_size=tuple(latent_size), frames_per_chunk=F,
                         window_frames=window_frames, prompt_tokens=encoder.max_tokens,
                         text_encoder=encoder)
    dec = StreamingVAEDecoder(vae, sequences=1)
    t = time.perf_counter()
    rollout.set_prompt("a warm-up prompt")
    rollout.capture()
    dec.capture(1, F, tuple(latent_size))
    torch.cuda.synchronize()
    res = {"window_frames": window_frames, "chunks": fill + chunks, "steady_from_chunk": fill,
           "capture_s": time.perf_counter() - t, "modes": {}}
    for k, mode in enumerate(modes):
        progress(f"e2e {mode}: {fill + chunks} chunks from a text prompt")
        rollout.reset()
        dec.reset()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        # A new text each run: the encoder caches what it has encoded.
        rollout.set_prompt(f"a red fox running through fresh snow at dawn, take {k}")
        if mode == "sequential":
            done, dit, vae_ms = _sequential(rollout, dec, noises, t0)
            res["dit_ms"], res["decode_ms"] = summary(dit[fill:]), summary(vae_ms[fill:])
        else:
            done = _overlapped(rollout, dec, noises, t0)
        frames = [1 + 4 * (F - 1)] + [4 * F] * (len(noises) - 1)
        res["modes"][mode] = {
            "first_frame_s": done[0],
            "steady_fps": sum(frames[fill:]) / (done[-1] - done[fill - 1]),
            "overall_fps": sum(frames) / done[-1], "video_frames": sum(frames)}
    rollout.close()
    dec.close()
    return res


def measure_pixels(*, latent_size=(60, 104), frames_per_chunk: int = 3, window_frames: int = 21,
                   chunks: int = 6, decode_iters: int = 10, progress=print) -> dict:
    """Both parts (module doc) with one set of random bf16 weights."""
    from framekv.engine.wan import TextEncoder, build_model, build_vae

    progress("building the 1.3B transformer, the Wan 2.1 VAE and umt5-xxl (random, bf16)")
    model = build_model("1.3b", device="cuda")
    vae = build_vae("1.3b", device="cuda")
    encoder = TextEncoder.from_config("1.3b", device="cuda")
    out = {"decode": measure_decode(vae, latent_size=latent_size, frames_per_chunk=frames_per_chunk,
                                    iters=decode_iters, progress=progress)}
    out["e2e"] = measure_e2e(model, vae, encoder, latent_size=latent_size,
                             frames_per_chunk=frames_per_chunk, window_frames=window_frames,
                             chunks=chunks, progress=progress)
    return out


def format_pixels(res: dict) -> str:
    d, e = res["decode"], res["e2e"]
    H, W = (8 * v for v in d["latent_size"])
    lines = [f"prompt to pixels: {H}x{W} video, {d['frames_per_chunk']}-frame latent chunks "
             f"({d['video_frames']} video frames)",
             f"  VAE decode ms/chunk  {'median':>8}{'p10':>8}{'p90':>8}   first chunk"]
    for name, c in d["chunk_us"].items():
        lines.append(f"  {name:<19}{c['median'] / 1e3:>8.1f}{c['p10'] / 1e3:>8.1f}"
                     f"{c['p90'] / 1e3:>8.1f}   {d['first_chunk_ms'][name]:.1f}")
    lines.append(f"  max |eager - graphed| {d['max_abs_diff_eager_graphed']:.2e}, cache arena "
                 f"{d['arena_bytes'] / 2**20:.0f} MiB")
    lines.append(f"  end to end, {e['window_frames']}-frame window, {e['chunks']} chunks "
                 f"(steady from chunk {e['steady_from_chunk']}), capture {e['capture_s']:.1f} s; "
                 f"DiT {e['dit_ms']['median']:.1f} ms + decode {e['decode_ms']['median']:.1f} "
                 f"ms per chunk")
    lines.append(f"  {'mode':<13}{'first frame s':>14}{'steady fps':>12}{'overall fps':>13}")
    for mode, m in e["modes"].items():
        lines.append(f"  {mode:<13}{m['first_frame_s']:>14.3f}{m['steady_fps']:>12.2f}"
                     f"{m['overall_fps']:>13.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m framekv.bench.pixels",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--window", type=int, default=21, help="window frames (default 21)")
    p.add_argument("--chunks", type=int, default=6, help="chunks timed once the window is full")
    p.add_argument("--decode-iters", type=int, default=10, help="decode chunks timed per variant")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    require_cuda("framekv.bench.pixels")
    res = measure_pixels(window_frames=args.window, chunks=args.chunks,
                         decode_iters=args.decode_iters, progress=stderr_progress("pixels"))
    print(format_pixels(res))
    write_result(args.json_path, pixels=res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
