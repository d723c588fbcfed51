"""Video in, video out on one GPU: the streaming encoders that turn a video's frames into
the latents a video-to-video rollout starts from, and the whole path, frames in to
restyled frames out, beside text to video.

All weights random, in bf16 as ``torch_dtype`` would load them. Sizes are ``--preset``'s
(default ``wan-1.3b``: 480 x 832 frames, chunks of F = 3 latent frames: a video's first
chunk 1 + 4 (F - 1) frames, then 4 F = 12 a chunk), one sequence; the VAE the preset's
config's (``--config`` overrides it for the encoders part). Parts (``--parts``):

    encoders    per encoder, graphed: ms per steady chunk (CUDA events, the encoders in
                turn, rotated order; medians, p10, p90), ms of a video's first chunk
                (replayed, after its capture), the largest |graphed - eager| over the
                first ``--check-chunks`` chunks (graphs replay the same kernels: 0), and
                for the Wan VAE's programs max and mean |latents - fp32 latents| against
                diffusers' modules in fp32 (TF32 off) over those chunks. Encoders:
                  wan           `StreamingVAEEncoder`, its fused channels-last program
                  wan-modules   the same VAE through diffusers' modules as
                                ``AutoencoderKLWan._encode`` runs them (``fused=False``)
                  tiny          `TinyStreamingEncoder` of the TAEHV ``taew2_1`` layout
                  wan-foldN     ``wan`` with the time taps of its causal convs of fewer
                                than N input channels folded (`FusedEncoder`'s
                                ``fold_below``; ``wan`` is its default), not by default
    e2e         per decoder (``--decoders`` wan, tiny; each with the encoder that
                follows it), video to video at ``--strength`` (default 0.75 of the
                preset's steps) beside text to video at the preset's steps and at
                video's step count (text-matched), a ``--window``-frame window:
                the first frame's time, steady and overall video frames per second,
                and each chunk's latency behind a ``--input-fps`` camera (p50, p99),
                the runs in turn, rotated, medians over ``--repeats`` rounds; the
                encode, transformer and decode alone (CUDA events).
                `framekv.bench.v2v_e2e` says exactly what each number is.

    python -m framekv.bench.v2v --json FILE                     (a CUDA GPU)
    python -m framekv.bench.v2v --device cpu --preset tiny --chunks 2 --window 1 --repeats 1
                                                                (a smoke run)
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import torch

from .timing import (interleaved_device_times, require_cuda, stderr_progress, summary_ms,
                     write_result)
from .v2v_e2e import (DECODERS, PRESET_CONFIGS, build_encoder, format_e2e, input_clips,
                      measure_e2e)

ENCODERS = ("wan", "wan-modules", "tiny")


def _fp32_latents(config: str, device, clips: list) -> list[torch.Tensor]:
    """The clips through diffusers' modules in fp32, TF32 off: the error's reference."""
    from framekv.engine.wan import build_vae

    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        enc = build_encoder("wan-modules", build_vae(config, device=device, dtype=torch.float32),
                       device, False)
        out = [enc.encode(c).float() for c in clips]
        enc.close()
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    return out


def _first_chunk_ms(enc, clip: torch.Tensor) -> float:
    """ms of a video's first chunk on ``enc``'s row, between CUDA events (the row then
    goes on from it)."""
    enc.reset()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    enc.encode(clip)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _check(kind: str, vae, device, clips: list, exact: list) -> tuple[object, dict]:
    """The graphed encoder of ``kind``, run over ``clips`` from a video's start, and its
    checks: against an eager twin, and (Wan) against the fp32 latents ``exact``."""
    graphed, eager = build_encoder(kind, vae, device, True), build_encoder(kind, vae, device, False)
    outs = [graphed.encode(c).float() for c in clips]
    twin = [eager.encode(c).float() for c in clips]
    eager.close()
    res = {"max_abs_diff_eager_graphed": max(float((a - b).abs().max())
                                             for a, b in zip(outs, twin))}
    if kind != "tiny":           # the tiny encoder is another network: no fp32 reference
        errs = [(a - e).abs() for a, e in zip(outs, exact)]
        res["max_abs_err"] = max(float(e.max()) for e in errs)
        res["mean_abs_err"] = sum(float(e.mean()) for e in errs) / len(errs)
    return graphed, res


def measure_encoders(*, config: str = "1.3b", device="cuda", frame_size=(480, 832),
                     latent_frames: int = 3, iters: int = 10, check_chunks: int = 3,
                     encoders=ENCODERS, progress=print) -> dict:
    """The encoders part (module doc) for ``encoders``: per encoder its checks and, on
    CUDA, its times."""
    from framekv.engine.wan import build_vae

    dev = torch.device(device)
    vae = build_vae(config, device=dev)
    clips = input_clips(frame_size, latent_frames, max(check_chunks, 2), dev)
    res = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "config": config, "frame_size": list(frame_size), "latent_frames": latent_frames,
           "frames_per_chunk": clips[-1].shape[2], "dtype": str(vae.dtype).removeprefix("torch."),
           "encoders": {}}
    exact = []
    if any(k != "tiny" for k in encoders):
        progress("fp32 reference (diffusers' modules, TF32 off)")
        exact = _fp32_latents(config, dev, clips[:check_chunks])
    encs = {}
    for kind in encoders:
        progress(f"{kind}: first chunks (capture), against eager and fp32")
        encs[kind], res["encoders"][kind] = _check(kind, vae, dev, clips[:check_chunks], exact)
        if dev.type == "cuda":
            torch.cuda.empty_cache()       # the eager twin's blocks, for the next captures
            res["encoders"][kind]["first_chunk_ms"] = _first_chunk_ms(encs[kind], clips[0])
    if dev.type == "cuda":
        progress("steady chunks, the encoders in turn")
        calls = {k: (lambda e=e: e.encode(clips[-1])) for k, e in encs.items()}
        times = interleaved_device_times(calls, iters, warmup=2, rotate=True)
        for k, e in encs.items():
            res["encoders"][k]["chunk_ms"] = summary_ms(times[k])
    for e in encs.values():
        e.close()
    return res


def format_encoders(res: dict) -> str:
    """The encoders part as a table, one row an encoder (errors only for the Wan VAE's)."""
    H, W = res["frame_size"]
    rows = [("encoder", "ms/chunk", "p10", "p90", "first ms", "max err", "mean err",
             "|graphed-eager|")]
    for name, r in res["encoders"].items():
        c = r.get("chunk_ms", {})
        err = [f"{r[k]:.{d}f}" if k in r else "-" for k, d in (("max_abs_err", 4),
                                                                ("mean_abs_err", 5))]
        ms = [f"{c[k]:.2f}" if k in c else "-" for k in ("median", "p10", "p90")]
        first = f"{r['first_chunk_ms']:.2f}" if "first_chunk_ms" in r else "-"
        rows.append((name, *ms, first, *err,
                     f"{r['max_abs_diff_eager_graphed']:.3g}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join([f"streaming encoders on {res['gpu']}: {H}x{W} frames, "
                      f"{res['frames_per_chunk']}-frame chunks ({res['latent_frames']} latent "
                      f"frames), {res['dtype']}"] +
                     ["  " + "  ".join(v.ljust(w) if i == 0 else v.rjust(w)
                                       for i, (v, w) in enumerate(zip(row, widths)))
                      for row in rows])


def _encoders_part(args, sizes: dict, progress) -> dict:
    F, (H, W) = sizes["frames_per_chunk"], sizes["latent_size"]
    return measure_encoders(config=args.config or PRESET_CONFIGS[args.preset],
                            device=args.device, frame_size=(8 * H, 8 * W), latent_frames=F,
                            iters=args.iters, check_chunks=args.check_chunks,
                            encoders=args.encoders, progress=progress)


def _e2e_part(args, sizes: dict, progress) -> dict:
    return measure_e2e(preset=args.preset, device=args.device, window_frames=args.window,
                       strength=args.strength, chunks=args.chunks, repeats=args.repeats,
                       input_fps=args.input_fps, decoders=args.decoders, progress=progress)


#: The parts `main` runs: name -> (measure(args, preset sizes, progress), format).
PARTS = {"encoders": (_encoders_part, format_encoders), "e2e": (_e2e_part, format_e2e)}


def _names(p, flag: str, value: str, allowed, also=None) -> tuple[str, ...]:
    """``value``'s comma-separated names, each in ``allowed`` or matching ``also``."""
    names = tuple(value.split(","))
    if not value or any(n not in allowed and not (also and re.fullmatch(also, n))
                        for n in names):
        p.error(f"{flag} must be a comma-separated list of {', '.join(allowed)}, got {value!r}")
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m framekv.bench.v2v",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated, of {', '.join(PARTS)} (default all)")
    p.add_argument("--preset", choices=tuple(PRESET_CONFIGS), default="wan-1.3b",
                   help="the sizes and the config (default wan-1.3b)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (the numbers), or cpu (a smoke run, eager)")
    p.add_argument("--encoders", default=",".join(ENCODERS),
                   help=f"encoders part: comma-separated, of {', '.join(ENCODERS)} (default "
                        "all), and wan-foldN: the fused Wan encoder folding the time taps of "
                        "its causal convs of fewer than N input channels (wan: 128)")
    p.add_argument("--config", default=None,
                   help="encoders part: a shipped VAE config (default the preset's)")
    p.add_argument("--iters", type=int, default=10, help="steady chunks timed per encoder")
    p.add_argument("--check-chunks", type=int, default=3,
                   help="chunks checked against eager and fp32 (default 3)")
    p.add_argument("--decoders", default=",".join(DECODERS),
                   help=f"e2e part: comma-separated, of {', '.join(DECODERS)} (default all)")
    p.add_argument("--window", type=int, default=21, help="e2e part: window frames (default 21)")
    p.add_argument("--strength", type=float, default=0.75,
                   help="e2e part: the video-to-video strength, in (0, 1] (default 0.75)")
    p.add_argument("--chunks", type=int, default=6,
                   help="e2e part: chunks timed once the window is full (default 6)")
    p.add_argument("--repeats", type=int, default=3, help="e2e part: rounds (default 3)")
    p.add_argument("--input-fps", type=float, default=16.0,
                   help="e2e part: the camera's frames per second (default 16)")
    p.add_argument("--json", dest="json_path", default=None)
    return p


def main(argv: list[str] | None = None) -> int:
    from framekv.engine.samplers import check_strength
    from framekv.engine.wan import preset_sizes

    p = _parser()
    args = p.parse_args(argv)
    parts = _names(p, "--parts", args.parts, tuple(PARTS))
    args.encoders = _names(p, "--encoders", args.encoders, ENCODERS, r"wan-fold\d+")
    args.decoders = _names(p, "--decoders", args.decoders, DECODERS)
    for flag, v, low in (("--iters", args.iters, 1), ("--check-chunks", args.check_chunks, 1),
                         ("--chunks", args.chunks, 2), ("--repeats", args.repeats, 1),
                         ("--window", args.window, 1)):
        if v < low:
            p.error(f"{flag} must be at least {low}, got {v}")
    if not args.input_fps > 0:
        p.error(f"--input-fps must be a number > 0, got {args.input_fps}")
    try:
        check_strength(args.strength, name="--strength")
    except ValueError as exc:
        p.error(str(exc))
    if args.device == "cuda":
        # The e2e part holds three rollouts' caches and graphs, the text encoder and
        # both coders at once: with fixed segments the pool fragments past 80 GiB.
        # Read when CUDA starts in this process, which is after this line.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        require_cuda("framekv.bench.v2v")
    sizes, out = preset_sizes(args.preset), {}
    for name in parts:
        measure, fmt = PARTS[name]
        out[name] = measure(args, sizes, stderr_progress("video-to-video"))
        print(fmt(out[name]))
    write_result(args.json_path, v2v=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
