"""`framekv demo`: the main job: a whole rollout of the reference model, timed and checked.

It prefills the prompt, generates the preset's chunks (one graph replay per chunk on
CUDA), prints per-chunk latency, latent frames per second, graph hits and memory, then
re-runs the first chunks eagerly (graphs vs no graphs) and with the reference
attention backend, and compares the clean latents. On CPU the graph cache runs
eagerly and the backend already is the reference; the demo says so and still runs
both checks, so the code path is the one a GPU takes.

Under torchrun (WORLD_SIZE > 1 in the environment) every rank runs the same demo with
Ulysses sequence parallelism: torch.distributed is initialised (nccl on CUDA, each rank
on cuda:LOCAL_RANK; gloo on CPU), each rank's cache holds its share of the K/V heads,
and only rank 0 prints and writes the report.
"""
from __future__ import annotations

import io
import os
import statistics
import sys
import time

import msgspec
import torch

from framekv.engine.attention.registry import CUDNN_INSTALL, cudnn_frontend_available
from framekv.engine.cache_dir import build_counts
from framekv.engine.model import CausalVideoDiT
from framekv.engine.rollout import Rollout, resolve_device, resolve_specs, with_chunks

#: A check passes when max|a - b| <= tolerance * max(1, max|b|): fp32 sides differ in
#: summation order only; bf16/fp16 latents drift by rounding through the sampler.
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}
#: The same over an fp8 pool or fp8 GEMMs (both sides fp8: the backends may quantize Q
#: too, and e4m3's 2^-4 rounding feeds through the sampler).
FP8_CHECK_TOLERANCE = 1e-1


def uses_fp8(r) -> bool:
    """Whether a rollout keeps fp8 K/V or runs fp8 GEMMs (its checks' tolerance)."""
    return torch.float8_e4m3fn in (r.kv_dtype, getattr(r, "gemm_dtype", None))


class Progress:
    """A plain-text progress bar on a stream: redrawn in place on a terminal, one line
    per update otherwise."""

    WIDTH = 30

    def __init__(self, total: int, stream, label: str = "demo"):
        self.total, self.stream, self.label = total, stream, label
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.start = time.perf_counter()

    def update(self, done: int, note: str = "") -> None:
        filled = self.WIDTH * done // max(self.total, 1)
        line = (f"{self.label} [{'#' * filled}{'.' * (self.WIDTH - filled)}] {done}/{self.total} "
                f"{time.perf_counter() - self.start:6.1f}s {note}").rstrip()
        self.stream.write(("\r" + line.ljust(100)) if self.tty else line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_rollout(r: Rollout, chunks: int, keep: int, progress: Progress | None):
    """Prefill and ``chunks`` chunks; (prefill s, per-chunk s, first ``keep`` outputs)."""
    t0 = time.perf_counter()
    r.prefill()
    _sync(r.device)
    prefill_s = time.perf_counter() - t0
    latencies, kept = [], []
    for i in range(chunks):
        t0 = time.perf_counter()
        out = r.step()
        _sync(r.device)
        latencies.append(time.perf_counter() - t0)
        if i < keep:
            kept.append(out)
        if progress:
            progress.update(i + 1, f"chunk {i}: {latencies[-1] * 1e3:.1f} ms")
    return prefill_s, latencies, kept


def _compare(name: str, want: list, got: list, tol: float, note: str) -> dict:
    err = max(float((g - w).abs().max()) for w, g in zip(want, got))
    scale = max(1.0, max(float(w.abs().max()) for w in want))
    ok = err == err and err <= tol * scale
    return {"check": name, "max_abs_error": err, "bound": tol * scale, "ok": ok, "note": note}


def _checks(main: Rollout, spec, kept: list, backend_name: str, group=None) -> list[dict]:
    """Re-run the first chunks eagerly and with the reference backend; compare."""
    n = len(kept)
    tol = FP8_CHECK_TOLERANCE if uses_fp8(main) else CHECK_TOLERANCE[main.dtype]
    cpu = main.device.type != "cuda"
    parallel = {} if group is None else {"process_group": group}
    parallel["kv_dtype"], parallel["gemm_dtype"] = main.kv_dtype, main.gemm_dtype
    eager = Rollout(spec, main.device, backend=main.backend, use_graphs=False, model=main.model,
                    **parallel)
    out = [_compare("graphs vs eager", kept, eager.run(n), tol,
                    "on cpu the graph cache runs eagerly: both sides are eager" if cpu
                    else "CUDA graph replays vs eager calls")]
    eager.close()
    model = CausalVideoDiT(spec[0], prompt_tokens=spec[1].prompt_tokens, device=main.device,
                           backend="reference")
    ref = Rollout(spec, main.device, backend="reference", use_graphs=False, model=model,
                  **parallel)
    note = ("on cpu the backend already is the reference: same computation" if
            backend_name == "reference" else f"{backend_name} vs the fp32-math reference backend")
    out.append(_compare(f"{backend_name} vs reference backend", kept, ref.run(n), tol, note))
    ref.close()
    return out


def distributed_from_env(device=None):
    """torchrun's environment -> (process group or None, rank, device, initialised here).

    WORLD_SIZE > 1 initialises torch.distributed from RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT (unless it already is): nccl on CUDA, with each rank on
    cuda:LOCAL_RANK when no device index is given; gloo on CPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None, 0, device, False
    import torch.distributed as dist

    rank = int(os.environ.get("RANK", "0"))
    dev = resolve_device(device)
    if dev.type == "cuda":
        if dev.index is None:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(dev)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank,
                                world_size=world)
    return dist.group.WORLD, dist.get_rank(), dev, created


def run_demo(preset="tiny", *, chunks: int | None = None, device=None, backend=None,
             check_chunks: int = 2, stream=None, progress: bool = True,
             cache_dir=None, kv_dtype=None, gemm_dtype=None) -> dict:
    """Run the demo; returns its report (what ``--json`` writes). Text goes to ``stream``
    (default stdout), the progress bar to stderr; under torchrun only rank 0 writes
    either, and the report also holds ``world_size`` and ``rank``. ``cache_dir``:
    load (and keep) compiled kernels and cuDNN plans there (`framekv warmup --cache-dir`
    fills it), so the captures build nothing. ``kv_dtype``: the K/V pool (`Rollout`'s;
    the checks' rollouts use the same); over fp8 the report holds the pool's
    statistics (``kv_stats``: saturation counts, amax, scales). ``gemm_dtype``: the
    blocks' GEMMs (`Rollout`'s: None, or "fp8"; the checks' rollouts use the same)."""
    if isinstance(check_chunks, bool) or not isinstance(check_chunks, int) or check_chunks < 0:
        raise ValueError(f"check_chunks must be an integer >= 0, got {check_chunks!r}")
    name, mspec, rspec = resolve_specs(preset)
    if chunks is not None:
        rspec = with_chunks(rspec, chunks)
    group, rank, device, created = distributed_from_env(device)
    try:
        return _run(name, mspec, rspec, device, backend, check_chunks,
                    (stream or sys.stdout) if rank == 0 else io.StringIO(),
                    progress and rank == 0, group, cache_dir, kv_dtype, gemm_dtype)
    finally:
        del group
        if created:
            release_process_group()


def release_process_group() -> None:
    """Destroy the default process group, with nothing of this run still holding it.

    A gloo group's worker threads live until the last reference to the group goes; one
    still alive at interpreter shutdown aborts the process when it releases its last
    collective's tensors. Rollouts hold the group, and a reference cycle can keep one
    alive past its run: collect first, then destroy. (`framekv.engine.attention.ulysses` guards
    against torch itself pinning the group.)
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.destroy_process_group()


def _run(name, mspec, rspec, device, backend, check_chunks: int, stream, progress: bool,
         group, cache_dir=None, kv_dtype=None, gemm_dtype=None) -> dict:
    """The demo on one rank (``group``: its process group, or None for one process)."""
    t0 = time.perf_counter()
    parallel = {} if group is None else {"process_group": group}
    r = Rollout((mspec, rspec), device, backend=backend, cache_dir=cache_dir,
                kv_dtype=kv_dtype, gemm_dtype=gemm_dtype, **parallel)
    bname = r.backend
    _print_header(stream, name, r, bname)
    r.capture()
    _sync(r.device)
    setup_s = time.perf_counter() - t0
    builds = build_counts(r.model.blocks[0].attn.backend)
    bar = Progress(rspec.chunks, sys.stderr) if progress else None
    prefill_s, lat, kept = _timed_rollout(r, rspec.chunks, check_chunks, bar)
    if bar:
        bar.finish()
    report = _report(name, r, bname, setup_s, prefill_s, lat)
    report["builds"] = builds
    if r.cache is not None and r.kv_dtype == torch.float8_e4m3fn:
        report["kv_stats"] = r.cache.kv_stats()
    if r.parallel is not None:
        report["world_size"], report["rank"] = r.parallel.world_size, r.parallel.rank
    _print_run(stream, report, r)
    report["checks"] = _checks(r, (mspec, rspec), kept, bname, group) if kept else []
    _print_checks(stream, report["checks"], len(kept))
    r.close()
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report


def _print_header(stream, name: str, r: Rollout, bname: str) -> None:
    m, s = r.model_spec, r.spec
    g = r.geometry
    pool = ("" if r.kv_dtype == r.dtype
            else f", K/V pool {str(r.kv_dtype).removeprefix('torch.')}")
    if r.gemm_dtype != r.dtype:
        pool += f", GEMMs {str(r.gemm_dtype).removeprefix('torch.')}"
    print(f"framekv demo: preset {name}, device {r.device}, backend {bname}, "
          f"{str(r.dtype).removeprefix('torch.')}{pool}", file=stream)
    if r.device.type == "cuda" and bname == "reference" and not cudnn_frontend_available():
        print(f"note: nvidia-cudnn-frontend is not installed, so attention runs the fp32 "
              f"reference backend (slow): {CUDNN_INSTALL}", file=stream)
    print(f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads}/{m.num_kv_heads} "
          f"heads of {m.head_dim}; {s.tokens_per_frame} tokens per frame, "
          f"{s.frames_per_chunk}-frame chunks ({s.chunk_tokens} tokens), window "
          f"{s.window_frames} frames, prompt {s.prompt_tokens} tokens, "
          f"{s.denoising_steps} denoising steps", file=stream)
    print(f"cache: geometry P={g.pin_tokens} W={g.window_tokens} M={g.max_staged_tokens} "
          f"blocks {list(g.causal_block_sizes)}; pool {r.cache.pool_tokens} tokens", file=stream)
    if r.parallel is not None:
        p = r.parallel
        print(f"parallel: Ulysses sequence parallelism over {p.world_size} ranks; each rank "
              f"attends {p.num_heads}/{p.num_kv_heads} heads and caches its {p.num_kv_heads} "
              f"K/V heads", file=stream)


def _report(name: str, r: Rollout, bname: str, setup_s: float, prefill_s: float,
            lat: list[float]) -> dict:
    frames = r.frames_done
    total = sum(lat)
    stats = r.graphs.stats()
    memory = {"cache_mapped_bytes": r.cache.pool_bytes}
    if r.device.type == "cuda":
        memory["torch_max_allocated_bytes"] = torch.cuda.max_memory_allocated(r.device)
        memory["torch_reserved_bytes"] = torch.cuda.memory_reserved(r.device)
    return {"preset": name, "device": str(r.device), "backend": bname,
            "dtype": str(r.dtype).removeprefix("torch."),
            "kv_dtype": str(r.kv_dtype).removeprefix("torch."),
            "gemm_dtype": str(r.gemm_dtype).removeprefix("torch."), "chunks": len(lat),
            "frames": frames,
            "setup_seconds": setup_s, "prefill_seconds": prefill_s, "chunk_seconds": lat,
            "median_chunk_seconds": statistics.median(lat) if lat else 0.0,
            "latent_frames_per_second": frames / total if total else 0.0,
            "graphs": msgspec.to_builtins(stats), "memory": memory}


def _print_run(stream, rep: dict, r: Rollout) -> None:
    g = rep["graphs"]
    eager = " (eager on cpu: no CUDA graphs)" if g["eager"] else ""
    print(f"setup {rep['setup_seconds']:.2f} s (model, cache, {g['graphs']} chunk graph(s) "
          f"captured in {g['capture_seconds']:.3f} s{eager}); prefill {rep['prefill_seconds'] * 1e3:.1f} ms",
          file=stream)
    b = rep.get("builds", {})
    if not g["eager"] and b:
        line = (f"builds before the first chunk: numba kernels {b['numba_compiled']} compiled, "
                f"{b['numba_loaded']} loaded from disk")
        if "cudnn_plans_built" in b:
            line += (f"; cuDNN plans {b['cudnn_plans_built']} built, "
                     f"{b['cudnn_plans_loaded']} loaded from disk")
        print(line, file=stream)
    print(f"{'chunk':>5}  {'frames':>6}  {'latency ms':>10}", file=stream)
    for i, s in enumerate(rep["chunk_seconds"]):
        print(f"{i:>5}  {r.chunk_frames(i):>6}  {s * 1e3:>10.2f}", file=stream)
    print(f"{rep['frames']} latent frames in {sum(rep['chunk_seconds']):.3f} s: "
          f"{rep['latent_frames_per_second']:.1f} latent frames/s "
          f"(median chunk {rep['median_chunk_seconds'] * 1e3:.2f} ms)", file=stream)
    print(f"graphs: {g['graphs']} graph(s), {g['hits']} hits, {g['captures']} captures, "
          f"allocated {g['allocated_bytes'] / 2**20:.1f} MiB, reserved "
          f"{g['reserved_bytes'] / 2**20:.1f} MiB", file=stream)
    mem = rep["memory"]
    line = f"memory: cache arena {mem['cache_mapped_bytes'] / 2**20:.2f} MiB mapped"
    if "torch_max_allocated_bytes" in mem:
        line += (f"; torch peak allocated {mem['torch_max_allocated_bytes'] / 2**20:.1f} MiB, "
                 f"reserved {mem['torch_reserved_bytes'] / 2**20:.1f} MiB")
    print(line, file=stream)
    if "kv_stats" in rep:
        print(format_saturation(rep["kv_stats"]), file=stream)


def format_saturation(stats: dict) -> str:
    """One line of an fp8 pool's saturation counts (`CausalKVCache.kv_stats`): the total
    and, when any value was clamped, the per-layer K/V counts and a warning."""
    counts = stats["saturated"]
    total = sum(k + v for k, v in counts)
    if not total:
        return "fp8 K/V: no value saturated (none clamped to +-448)"
    per_layer = " ".join(f"{k}/{v}" for k, v in counts)
    return (f"WARNING: fp8 K/V: {total} values saturated (clamped to +-448); per layer K/V: "
            f"{per_layer}: the scales are too small for them")


def _print_checks(stream, checks: list[dict], n: int) -> None:
    print(f"checks on the first {n} chunk(s), clean latents:", file=stream)
    for c in checks:
        verdict = "ok" if c["ok"] else "FAILED"
        print(f"  {c['check']}: max abs error {c['max_abs_error']:.2e} (bound {c['bound']:.1e}) "
              f"{verdict} [{c['note']}]", file=stream)
