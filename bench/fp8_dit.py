"""The reference DiT's whole forward over one held-out chunk, its GEMMs in the model's
dtype and in fp8, against the same forward in fp32: the fp8 GEMMs' error where nothing
else differs, and the forward's fp8 speed-up.

One model (the reference DiT of a preset: bf16 on CUDA; fp32 on a CPU, where only the
code path is exercised) with its blocks' fp8 GEMMs (`CausalVideoDiT.fp8_linears`), and
its fp32 twin (the same weights as drawn, fp32 math: torch glue, the reference
attention backend, TF32 off). The input is held out: latents drawn from a seed no
rollout of the section uses, at a mid time and a later chunk's rope frames. The forward
has no K/V store (dense attention over the chunk's own tokens), so the GEMMs, and the
model's own rounding, are all that differ between the runs:

    check   the velocity with the model's GEMMs ("bf16") and with fp8 GEMMs
            ("fp8-gemm") against the fp32 twin's: max and mean |d|, and the largest
            |velocity| they are measured against
    speed   each forward captured in a CUDA graph, the graphs replayed in turn, the
            order rotated every round, the L2 flushed before each (CUDA events; host
            timers on a CPU): median µs and the fp8 GEMMs' speed-up (bf16 time / fp8
            time)
"""
from __future__ import annotations

import statistics

import torch

from .fp8_common import rotated_times, speedups
from .timing import Flusher, captured_graph, summary

#: The held-out input: latents of this seed (no rollout of the section draws from it),
#: the time, and the rope frame of the chunk's first frame.
HELD_OUT_SEED = 104729
HELD_OUT_TIME = 0.5
HELD_OUT_FRAME = 21


def _held_out(spec, frames: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(latents [1, C, F, H, W] fp32, t [1], frame0 [1]) of the held-out chunk."""
    gen = torch.Generator().manual_seed(HELD_OUT_SEED)
    x = torch.randn(1, spec.in_channels, frames, spec.latent_height, spec.latent_width,
                    generator=gen)
    return (x.to(device), torch.full((1,), HELD_OUT_TIME, device=device),
            torch.full((1,), HELD_OUT_FRAME, dtype=torch.int64, device=device))


def _fp32_velocity(mspec, prompt_tokens: int, inputs, device) -> torch.Tensor:
    """The fp32 twin's velocity of ``inputs`` (module doc)."""
    from framekv.engine.kv import ForwardContext
    from framekv.engine.model import CausalVideoDiT

    x, t, frame0 = inputs
    twin = CausalVideoDiT(mspec, prompt_tokens=prompt_tokens, device=device,
                          dtype=torch.float32, backend="reference")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            return twin(x, t, ForwardContext(None, seq_len=None, frame0=frame0), glue="torch")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        del twin


def measure_dit(preset="wan-1.3b", *, rounds: int = 20, device="cuda", flush: bool = True,
                progress=print) -> dict:
    """The held-out forward's error against fp32 and its speed, model-dtype GEMMs
    against fp8 GEMMs (module doc); ``rounds`` timed rounds."""
    from framekv.engine.kv import ForwardContext
    from framekv.engine.model import CausalVideoDiT
    from framekv.engine.rollout import resolve_specs

    name, mspec, rspec = resolve_specs(preset)
    device = torch.device(device)
    cuda = device.type == "cuda"
    progress(f"fp8 dit: building the {name} model and its fp8 GEMMs")
    model = CausalVideoDiT(mspec, prompt_tokens=rspec.prompt_tokens, device=device)
    fp8 = model.fp8_linears()
    inputs = _held_out(mspec, rspec.frames_per_chunk, device)
    x, t, frame0 = inputs
    ctx = ForwardContext(None, seq_len=None, frame0=frame0)
    calls = {"bf16": lambda: model(x, t, ctx, glue="fused"),
             "fp8-gemm": lambda: model(x, t, ctx, glue="fused", fp8=fp8)}
    with torch.no_grad():
        got = {n: call().float() for n, call in calls.items()}
        progress("fp8 dit: the fp32 twin's forward")
        want = _fp32_velocity(mspec, rspec.prompt_tokens, inputs, device).float()
        check = {n: {"max_abs": float((v - want).abs().max()),
                     "mean_abs": float((v - want).abs().mean())} for n, v in got.items()}
        del got
        progress(f"fp8 dit: {rounds} rounds of both forwards, " + ("graphed" if cuda else "eager"))
        timed = {n: captured_graph(c).replay for n, c in calls.items()} if cuda else calls
        times = rotated_times(timed, rounds, cuda=cuda, warmup=2,
                              flush=Flusher(flush) if cuda else None)
    return {"preset": name, "layers": mspec.num_layers, "hidden": mspec.hidden_size,
            "ffn": mspec.ffn_size, "tokens": rspec.frames_per_chunk * rspec.tokens_per_frame,
            "model_dtype": str(model.dtype).removeprefix("torch."), "rounds": rounds,
            "device": str(device), "timer": "cuda events" if cuda else "host",
            "held_out": {"seed": HELD_OUT_SEED, "t": HELD_OUT_TIME, "frame0": HELD_OUT_FRAME},
            "max_abs_want": float(want.abs().max()), "check": check,
            "us": {n: summary(us) for n, us in times.items()},
            "fp8_gemm_over_bf16": (statistics.median(times["fp8-gemm"])
                                   / statistics.median(times["bf16"])),
            **speedups(times["bf16"], times["fp8-gemm"], "fp8_gemm")}


def format_dit(res: dict) -> str:
    """The part's table: per run of GEMMs its time and its error against fp32."""
    head = (f"fp8 dit forward: {res['preset']} ({res['layers']} layers, hidden "
            f"{res['hidden']}, ffn {res['ffn']}, {res['model_dtype']}), one held-out chunk of "
            f"{res['tokens']} tokens, no K/V store; {res['rounds']} rounds rotated "
            f"({res['timer']}), {res['device']}")
    cols = ("median µs", "p10", "p90", "max|d| vs fp32", "mean|d|")
    rows = [f"  {name:<10}" + "".join(f"{v:>16.4g}" for v in (
        u["median"], u["p10"], u["p90"], res["check"][name]["max_abs"],
        res["check"][name]["mean_abs"])) for name, u in res["us"].items()]
    tail = (f"  fp8 GEMMs' speed-up (bf16 time / fp8 time) {res['fp8_gemm_speedup']:.3f} "
            f"(per round {res['fp8_gemm_speedup_paired']:.3f}); largest |velocity| "
            f"{res['max_abs_want']:.3g}")
    return "\n".join([head, f"  {'GEMMs':<10}" + "".join(f"{c:>16}" for c in cols), *rows, tail])
