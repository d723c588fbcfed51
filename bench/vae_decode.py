"""The Wan VAE's streaming decode, the fused channels-last program against diffusers'
modules frame by frame (`StreamingVAEDecoder(fused=...)`), on one GPU.

One random Wan 2.1 VAE (``--config``, bf16 on CUDA), latent chunks of F frames at H x W
(default 3 at 60 x 104: 480 x 832 video):

    ms          ms per steady chunk of each program, graphed, the two in turn (CUDA
                events, rotated order; medians, p10, p90)
    error       the first ``--check-chunks`` chunks of each against the modules run in
                fp32 (TF32 off): max and mean |frames - fp32 frames|; the fused program
                rounds once where the modules round five times
    memory      bytes above the resident set one eager steady chunk of each allocates
                at its peak (the activations a captured chunk's pool holds)

    python -m framekv.bench.vae_decode --json FILE
"""
from __future__ import annotations

import argparse
import sys

import torch

from .timing import (interleaved_device_times, require_cuda, stderr_progress, summary_ms,
                     write_result)

PROGRAMS = ("fused", "modules")


def _decoder(vae, program: str, graphs: bool):
    from framekv.engine.wan import StreamingVAEDecoder

    return StreamingVAEDecoder(vae, sequences=1, fused=program == "fused", use_graphs=graphs)


def _peak_bytes(vae, program: str, lats: list) -> int:
    """Bytes one eager steady chunk allocates above what is resident."""
    dec = _decoder(vae, program, False)
    dec.decode(lats[0])
    dev = lats[0].device
    if dev.type != "cuda":
        return 0
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    dec.decode(lats[1])
    torch.cuda.synchronize(dev)
    dec.close()
    return torch.cuda.max_memory_allocated(dev) - base


def measure(*, config: str = "1.3b", device="cuda", latent_size=(60, 104), frames: int = 3,
            iters: int = 10, check_chunks: int = 3, progress=print) -> dict:
    """The three measurements (module doc) for both programs."""
    from framekv.engine.wan import build_vae

    dev = torch.device(device)
    vae = build_vae(config, device=dev)
    g = torch.Generator().manual_seed(0)
    lats = [torch.randn(1, vae.config.z_dim, frames, *latent_size, generator=g).to(dev)
            for _ in range(max(check_chunks, 2) + 1)]
    res = {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "config": config, "latent_size": list(latent_size), "frames_per_chunk": frames,
           "dtype": str(vae.dtype).removeprefix("torch."), "programs": {}}
    progress("fp32 reference (diffusers' modules, TF32 off)")
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    exact_dec = _decoder(build_vae(config, device=dev, dtype=torch.float32), "modules", False)
    exact = [exact_dec.decode(z).float() for z in lats[:check_chunks]]
    exact_dec.close()
    del exact_dec
    torch.backends.cudnn.allow_tf32 = tf32
    decs = {}
    for name in PROGRAMS:
        progress(f"{name}: first chunks (capture), error, peak memory")
        decs[name] = _decoder(vae, name, dev.type == "cuda")
        errs = [(decs[name].decode(z).float() - e).abs() for z, e in zip(lats, exact)]
        res["programs"][name] = {"max_abs_err": max(float(e.max()) for e in errs),
                                 "mean_abs_err": sum(float(e.mean()) for e in errs) / len(errs),
                                 "peak_bytes": _peak_bytes(vae, name, lats)}
    progress("steady chunks, both programs in turn")
    calls = {n: (lambda d=d: d.decode(lats[-1])) for n, d in decs.items()}
    if dev.type == "cuda":
        times = interleaved_device_times(calls, iters, warmup=2, rotate=True)
        for n, t in times.items():
            res["programs"][n]["chunk_ms"] = summary_ms(t)
    for d in decs.values():
        d.close()
    return res


def format_result(res: dict) -> str:
    H, W = (8 * v for v in res["latent_size"])
    lines = [f"Wan VAE decode on {res['gpu']}: {H}x{W}, {res['frames_per_chunk']}-frame latent "
             f"chunks, {res['dtype']}",
             f"  {'program':<10}{'ms/chunk':>10}{'p10':>8}{'p90':>8}{'max err':>10}"
             f"{'mean err':>10}{'peak GiB':>10}"]
    for name, r in res["programs"].items():
        c = r.get("chunk_ms", {"median": 0.0, "p10": 0.0, "p90": 0.0})
        lines.append(f"  {name:<10}{c['median']:>10.1f}{c['p10']:>8.1f}{c['p90']:>8.1f}"
                     f"{r['max_abs_err']:>10.4f}{r['mean_abs_err']:>10.5f}"
                     f"{r['peak_bytes'] / 2**30:>10.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m framekv.bench.vae_decode",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="1.3b", help="a shipped VAE config (default 1.3b)")
    p.add_argument("--iters", type=int, default=10, help="steady chunks timed per program")
    p.add_argument("--check-chunks", type=int, default=3, help="chunks checked against fp32")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    require_cuda("framekv.bench.vae_decode")
    res = measure(config=args.config, iters=args.iters, check_chunks=args.check_chunks,
                  progress=stderr_progress("vae_decode"))
    print(format_result(res))
    write_result(args.json_path, vae_decode=res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
