"""Prompt to pixels: each streaming decoder alone, and the whole path from a text prompt
to decoded frames on the host, on one GPU.

All weights random, in bf16 as ``torch_dtype`` would load them: the 1.3B transformer,
umt5-xxl's encoder (built-in byte tokenizer) and the decoders: ``wan`` (the Wan 2.1
VAE, `StreamingVAEDecoder`'s fused channels-last program), ``wan-modules`` (the same
VAE through diffusers' modules frame by frame, ``fused=False``: the baseline) and
``tiny`` (`TinyStreamingDecoder` of the TAEHV ``taew2_1`` layout). Latent H x W
(default 60 x 104: 480 x 832 video), chunks of F latent frames (4F video frames; a
video's first chunk decodes 4F - 3).

    decode      per decoder, eager against graphed: ms per chunk after the first (CUDA
                events, the two in turn, rotated), the first chunk, and the largest
                |eager - graphed| (graphs replay the same kernels: 0)
    e2e         per decoder, text -> `TextEncoder` -> `WanRollout` (a ``window``-frame
                window, ``--kv-dtype``, ``--fp8-gemm``) -> decoder -> uint8 frames on the
                host, graphs captured beforehand (as a server does at start), through
                `DecodeLane`:
                  sequential   each chunk decoded after its transformer
                  overlapped   each chunk decoded on the lane's stream beside the next
                               chunk's transformer
                time to the first frame (the prompt's text in, the first chunk's frames
                on the host), video frames per second once the window is full (the
                last chunk left out: it comes out of the drain, with nothing to make
                beside it) and over the whole run, whether both modes gave the same
                frames, the transformer and the decode each alone per chunk
                (sequential, CUDA events), and how
                much of the decode the overlap hid: 1 - (overlapped - pipelined) /
                decode per steady chunk, where pipelined is the transformer alone in
                the overlapped loop's rhythm (a chunk waited for once the next is
                queued): the host's own work between chunks hides there too, so the
                sequential transformer's time would credit the decode with it; and
                the steady rate the transformer alone allows (4F / pipelined), which
                no decoder can pass

    python -m framekv.bench.pixels --json FILE      (also `framekv bench --sections pixels`)
"""
from __future__ import annotations

import sys
import time

import torch

from .report import print_report, section_parser
from .timing import interleaved_device_times, require_cuda, stderr_progress, summary

MODES = ("sequential", "overlapped")
DECODERS = ("wan", "wan-modules", "tiny")


def _latents(chunks: int, C: int, F: int, size, seed: int = 0, device="cpu") -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, C, F, *size, generator=gen).to(device) for _ in range(chunks)]


def build_decoder(kind: str, config: str, device, graphs: bool):
    """A one-row decoder of ``kind`` for the shipped ``config``'s latents (random)."""
    from framekv.engine.wan import (CONFIGS, StreamingVAEDecoder, TinyStreamingDecoder,
                                    build_vae)

    if kind in ("wan", "wan-modules"):
        return StreamingVAEDecoder(build_vae(config, device=device), sequences=1,
                                   use_graphs=graphs, fused=kind == "wan")
    return TinyStreamingDecoder.random(latent_channels=CONFIGS[config]["out_channels"],
                                       device=device, sequences=1, use_graphs=graphs)


def measure_decode(kind: str, *, config: str = "1.3b", device="cuda", latent_size=(60, 104),
                   frames_per_chunk: int = 3, iters: int = 10, progress=print) -> dict:
    """ms per steady chunk (eager, graphed) and of a video's first chunk; max |eager -
    graphed| over the timed chunks."""
    from framekv.engine.wan import CONFIGS

    dev, F = torch.device(device), frames_per_chunk
    lats = _latents(iters + 4, CONFIGS[config]["out_channels"], F, latent_size, device=dev)
    decs = {name: build_decoder(kind, config, dev, name == "graphed")
            for name in ("eager", "graphed")}
    first, outs = {}, {n: [] for n in decs}
    for name, dec in decs.items():
        progress(f"decode {kind} {name}: first chunk")
        for _ in range(2):  # the second is warm: kernels chosen, graphs captured
            dec.reset()
            t = time.perf_counter()
            dec.decode(lats[0])
            _sync(dev)
            first[name] = (time.perf_counter() - t) * 1e3

    def call(name):
        # each decoder walks the same latents in order: their frames compare chunk by chunk
        def run():
            outs[name].append(decs[name].decode(lats[1 + len(outs[name]) % (len(lats) - 1)]))
        return run

    progress(f"decode {kind}: steady chunks, eager and graphed in turn")
    calls = {n: call(n) for n in decs}
    times = (interleaved_device_times(calls, iters, warmup=1, rotate=True) if dev.type == "cuda"
             else _host_us(calls, iters))
    diff = max(float((a.float() - b.float()).abs().max())
               for a, b in zip(outs["eager"], outs["graphed"]))
    res = {"first_chunk_ms": first, "max_abs_diff_eager_graphed": diff,
           "chunk_us": {n: summary(t) for n, t in times.items()}}
    for dec in decs.values():
        dec.close()
    return res


def _host_us(calls: dict, iters: int) -> dict[str, list[float]]:
    """A CPU's microseconds per call, the calls taken in turn."""
    out = {n: [] for n in calls}
    for _ in range(iters):
        for name, call in calls.items():
            t = time.perf_counter()
            call()
            out[name].append((time.perf_counter() - t) * 1e6)
    return out


def _release(dev: torch.device) -> None:
    """Hand the closed decoders' cached blocks back to the device: a graph captured next
    allocates from a private pool, which cannot take blocks torch keeps cached."""
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _roll(rollout, lane, noises, t0: float) -> tuple[list[float], list]:
    """Each chunk rolled out and handed to ``lane`` (`DecodeLane`); the host times its
    frames were there, and the frames."""
    return roll_lane(lambda i: rollout.step(noises[i]), lane, len(noises), t0)


def roll_lane(step, lane, count: int, t0: float, arrivals=None) -> tuple[list[float], list]:
    """Chunks 0 .. ``count`` - 1, ``step(i)`` making chunk i's latents, each handed to
    ``lane`` (`DecodeLane`) and taken once the next is queued (overlapped) or at once;
    the host times (since ``t0``) each chunk's frames were there, and the frames.
    ``arrivals``: chunk i starts no earlier than ``t0 + arrivals[i]`` (its inputs'
    arrival), and while the next chunk's inputs are still to come the lane is drained
    (nothing to make beside it, so its frames are not held back)."""
    done, frames = [], []

    def take_down_to(left: int) -> None:
        while len(lane) > left:
            frames.append(lane.take())
            done.append(time.perf_counter() - t0)

    for i in range(count):
        if arrivals is not None:
            time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        lane.submit(step(i))
        waiting = arrivals is not None and (
            i + 1 == count or time.perf_counter() < t0 + arrivals[i + 1])
        take_down_to(0 if waiting else lane.overlap)
    take_down_to(0)
    return done, frames


def stage_ms(stages, inputs, dev) -> list[list[float]]:
    """ms of each of ``stages`` per item of ``inputs``, each stage alone: an item goes
    through the stages in turn (a stage takes the previous one's result, the first the
    item). The device's time between events on CUDA (the host's own work beside it is
    not the GPU's: counting it would hide more of the decode than the GPU can), else
    the host's. One list per stage."""
    out = [[] for _ in stages]
    for x in inputs:
        if dev.type == "cuda":
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(len(stages) + 1)]
            marks[0].record()
            for k, stage in enumerate(stages):
                x = stage(x)
                marks[k + 1].record()
            marks[-1].synchronize()
            for k in range(len(stages)):
                out[k].append(marks[k].elapsed_time(marks[k + 1]))
            continue
        for k, stage in enumerate(stages):
            t = time.perf_counter()
            x = stage(x)
            out[k].append((time.perf_counter() - t) * 1e3)
    return out


def measure_e2e(model, dec, encoder, *, latent_size=(60, 104), frames_per_chunk: int = 3,
                window_frames: int = 21, chunks: int = 6, kv_dtype=None, gemm_dtype=None,
                progress=print) -> dict:
    """Time to the first frame and video frames per second, prompt to host frames, in
    both modes (module doc), over one rollout and decoder; ``kv_dtype``, ``gemm_dtype``:
    the rollout's (`WanRollout`)."""
    from framekv.engine import WanRollout
    from framekv.engine.decode_lane import DecodeLane

    if chunks < 2:
        raise ValueError(f"chunks must be at least 2 (steady chunks timed), got {chunks}")
    F, dev = frames_per_chunk, dec.device
    fill = window_fill(window_frames, F)
    noises = _latents(fill + chunks, model.config.in_channels, F, latent_size, seed=1)
    rollout = WanRollout(model, latent_size=tuple(latent_size), frames_per_chunk=F,
                         window_frames=window_frames, prompt_tokens=encoder.max_tokens,
                         text_encoder=encoder, kv_dtype=kv_dtype, gemm_dtype=gemm_dtype)
    t = time.perf_counter()
    rollout.set_prompt("a warm-up prompt")
    if dev.type == "cuda":
        rollout.capture()
        dec.capture(1, F, tuple(latent_size))
    _sync(dev)
    res = {"window_frames": window_frames, "chunks": fill + chunks, "steady_from_chunk": fill,
           "capture_s": time.perf_counter() - t, "modes": {},
           "kv_dtype": str(rollout.kv_dtype).removeprefix("torch."),
           "gemm_dtype": str(rollout.gemm_dtype).removeprefix("torch.")}
    counts = chunk_video_frames(F, len(noises))
    frames = {}
    for k, mode in enumerate(MODES):
        progress(f"e2e {mode}: {fill + chunks} chunks from a text prompt")
        rollout.reset()
        dec.reset()
        _sync(dev)
        t0 = time.perf_counter()
        rollout.set_prompt(f"a red fox running through fresh snow at dawn, take {k}")
        lane = DecodeLane(dec, overlap=mode == "overlapped")
        done, frames[mode] = _roll(rollout, lane, noises, t0)
        res["modes"][mode] = {"overlap": lane.overlap, **run_rates(done, counts, fill)}
    # the prompts differ by run (the encoder caches what it encoded): compare the decodes
    # of one prompt's latents instead, both modes over the same rollout
    res["frames_equal"] = _modes_agree(rollout, dec, noises)
    rollout.reset()
    dec.reset()
    rollout.set_prompt("a red fox running through fresh snow at dawn, take 0")
    dit, vae = stage_ms([rollout.step, dec.decode], noises, dev)     # each alone
    res["dit_ms"], res["decode_ms"] = summary(dit[fill:]), summary(vae[fill:])
    rollout.reset()
    rollout.set_prompt("a red fox running through fresh snow at dawn, take 0")
    done = _pipelined(rollout, noises, dev, time.perf_counter())
    res["dit_pipelined_ms"] = _steady_s(done, fill) / (chunks - 1) * 1e3
    # no decoder, however fast or hidden, makes steady chunks faster than the transformer
    res["dit_bound_fps"] = 4 * F / res["dit_pipelined_ms"] * 1e3
    lapped = res["modes"]["overlapped"]["steady_chunk_ms"]
    res["decode_hidden"] = 1 - (lapped - res["dit_pipelined_ms"]) / res["decode_ms"]["median"]
    rollout.close()
    return res


def window_fill(window_frames: int, frames_per_chunk: int) -> int:
    """The chunks a rollout runs until its ``window_frames`` window (and the sink frame)
    is full: the first chunk of steady state."""
    return -(-(1 + window_frames) // frames_per_chunk) + 1


def chunk_video_frames(frames_per_chunk: int, chunks: int) -> list[int]:
    """The video frames each of ``chunks`` chunks decodes to (a video's first chunk 4F - 3)."""
    return [4 * frames_per_chunk - 3] + [4 * frames_per_chunk] * (chunks - 1)


def run_rates(done: list[float], counts: list[int], fill: int) -> dict:
    """A run's rates from each chunk's time out ``done`` and its ``counts`` of video
    frames: the first frame's time, video frames per second over the steady chunks
    (`_steady_s`) and over the whole run, the steady chunks' ms each."""
    steady = _steady_s(done, fill)
    return {"first_frame_s": done[0], "steady_fps": sum(counts[fill:-1]) / steady,
            "overall_fps": sum(counts) / done[-1], "video_frames": sum(counts),
            "steady_chunk_ms": steady / (len(done) - 1 - fill) * 1e3}


def _steady_s(done: list[float], fill: int) -> float:
    """Seconds the steady chunks fill .. n - 2 took to come out (``done``: each chunk's
    time out). The last chunk is left out: it comes out of the loop's drain, with no
    next chunk to make beside it, so it would make a rate that no stream keeps."""
    return done[-2] - done[fill - 1]


def _pipelined(rollout, noises, dev, t0: float) -> list[float]:
    """The transformer alone in the overlapped loop's rhythm: chunk n waited for once
    chunk n + 1 is queued; the host times each chunk was done."""
    pending, done = [], []
    for noise in noises:
        rollout.step(noise)
        if dev.type == "cuda":
            pending.append(torch.cuda.Event())
            pending[-1].record()
        else:
            pending.append(None)
        while len(pending) > (dev.type == "cuda"):
            ev = pending.pop(0)
            if ev is not None:
                ev.synchronize()
            done.append(time.perf_counter() - t0)
    for ev in pending:
        ev.synchronize()
        done.append(time.perf_counter() - t0)
    return done


def _modes_agree(rollout, dec, noises) -> bool:
    from framekv.engine.decode_lane import DecodeLane

    got = []
    for overlap in (False, True):
        rollout.reset()
        dec.reset()
        # an fp8 pool scales attention's output by its running amax, which outlives a
        # reset: both modes start from the same statistics (a no-op for bf16)
        rollout.cache.reset_kv_stats()
        rollout.set_prompt("the same prompt both ways")
        got.append(_roll(rollout, DecodeLane(dec, overlap=overlap), noises[:3], 0.0)[1])
    return all(torch.equal(a, b) for a, b in zip(*got))


def measure_pixels(*, decoders=DECODERS, config: str = "1.3b", device="cuda",
                   latent_size=(60, 104), frames_per_chunk: int = 3, window_frames: int = 21,
                   chunks: int = 6, decode_iters: int = 10, kv_dtype=None, gemm_dtype=None,
                   progress=print) -> dict:
    """Both parts (module doc) for each of ``decoders``, one set of random weights."""
    from framekv.engine.wan import TextEncoder, build_model

    dev = torch.device(device)
    progress(f"building the {config} transformer and text encoder (random)")
    model = build_model(config, device=dev)
    encoder = TextEncoder.from_config(config, device=dev)
    out = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "config": config, "latent_size": list(latent_size),
           "frames_per_chunk": frames_per_chunk, "video_frames": 4 * frames_per_chunk,
           "decoders": {}}
    kw = dict(latent_size=latent_size, frames_per_chunk=frames_per_chunk)
    for kind in decoders:
        res = {"decode": measure_decode(kind, config=config, device=dev, iters=decode_iters,
                                        progress=progress, **kw)}
        _release(dev)
        dec = build_decoder(kind, config, dev, dev.type == "cuda")
        res["e2e"] = measure_e2e(model, dec, encoder, window_frames=window_frames,
                                 chunks=chunks, kv_dtype=kv_dtype, gemm_dtype=gemm_dtype,
                                 progress=progress, **kw)
        dec.close()
        _release(dev)
        out["decoders"][kind] = res
        out["kv_dtype"] = res["e2e"]["kv_dtype"]        # the rollout's pool, as it resolved it
        out["gemm_dtype"] = res["e2e"]["gemm_dtype"]
    return out


def format_pixels(res: dict) -> str:
    H, W = (8 * v for v in res["latent_size"])
    lines = [f"prompt to pixels on {res['gpu']}: {H}x{W} video, {res['frames_per_chunk']}-frame "
             f"latent chunks ({res['video_frames']} video frames), K/V {res['kv_dtype']}, "
             f"GEMMs {res.get('gemm_dtype', res['kv_dtype'])}"]
    for kind, r in res["decoders"].items():
        d, e = r["decode"], r["e2e"]
        lines.append(f"  {kind} decoder, ms/chunk {'median':>8}{'p10':>8}{'p90':>8}   first")
        for name, c in d["chunk_us"].items():
            lines.append(f"    {name:<20}{c['median'] / 1e3:>8.1f}{c['p10'] / 1e3:>8.1f}"
                         f"{c['p90'] / 1e3:>8.1f}   {d['first_chunk_ms'][name]:.1f}")
        lines.append(f"    max |eager - graphed| {d['max_abs_diff_eager_graphed']:.2e}")
        lines.append(f"    end to end, {e['window_frames']}-frame window, DiT "
                     f"{e['dit_ms']['median']:.1f} ms + decode {e['decode_ms']['median']:.1f} ms "
                     f"a chunk (pipelined {e['dit_pipelined_ms']:.1f} ms: at most "
                     f"{e['dit_bound_fps']:.2f} steady fps); overlap hid "
                     f"{100 * e['decode_hidden']:.0f}% of the decode; "
                     f"frames equal both ways: {e['frames_equal']}")
        lines.append(f"    {'mode':<13}{'first frame s':>14}{'steady fps':>12}{'overall fps':>13}")
        for mode, m in e["modes"].items():
            lines.append(f"    {mode:<13}{m['first_frame_s']:>14.3f}{m['steady_fps']:>12.2f}"
                         f"{m['overall_fps']:>13.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = section_parser("pixels", __doc__)
    p.add_argument("--decoders", default=",".join(DECODERS),
                   help="comma-separated, of wan, wan-modules and tiny (default all)")
    p.add_argument("--kv-dtype", choices=("fp8",), default=None,
                   help="the transformer's K/V pool (default its dtype)")
    p.add_argument("--fp8-gemm", action="store_true",
                   help="the transformer blocks' GEMMs in fp8 (default its dtype)")
    p.add_argument("--chunks", type=int, default=6, help="chunks timed once the window is full")
    p.add_argument("--decode-iters", type=int, default=10, help="decode chunks timed per variant")
    args = p.parse_args(argv)
    if args.chunks < 2:
        p.error(f"--chunks must be at least 2 (steady chunks timed), got {args.chunks}")
    decoders = tuple(args.decoders.split(","))
    if not decoders or any(d not in DECODERS for d in decoders):
        p.error(f"--decoders must be a comma-separated list of {', '.join(DECODERS)}, "
                f"got {args.decoders!r}")
    require_cuda("framekv.bench.pixels")
    res = measure_pixels(decoders=decoders, window_frames=args.window, chunks=args.chunks,
                         decode_iters=args.decode_iters, kv_dtype=args.kv_dtype,
                         gemm_dtype="fp8" if args.fp8_gemm else None,
                         progress=stderr_progress("pixels"))
    return print_report(format_pixels(res), args.json_path, pixels=res)


if __name__ == "__main__":
    sys.exit(main())
