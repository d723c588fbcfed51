"""`Rollout`: the reference model's rollout, a `ChunkRunner` over a preset.

A preset (`framekv.specs.Preset`) names the model (`CausalVideoDiT`, deterministic
random weights) and the rollout: its prompt is the pinned prefix (P = prompt_tokens),
the window ``window_frames`` finished frames, a chunk ``frames_per_chunk`` frames,
sampled (by default Euler; ``sampler``) over the ``denoising_steps`` steps of
t = linspace(1, 0), or ``steps`` of them, with the whole chunk one causal block, then
cleaned in one-frame blocks; a short last chunk
(``last_chunk_frames``) gets a graph of its own. Where the K/V go is a `KVStore`: the
paged cache (default), the fp32 reference (``kv="reference"``), a store across ranks
(``process_group``), or one the caller built for this geometry. The paged pool holds the
model's dtype or, with ``kv_dtype="fp8"``, float8 e4m3 with per-head scales
(`resolve_kv_dtype`); q, k and v stay in the model's dtype. With ``gemm_dtype="fp8"``
the blocks' GEMMs run in fp8 (`framekv.engine.fp8_linear`). Memory is constant in
the number of chunks: the pool never grows, graphs are captured once per chunk length
and batch size, the runner keeps nothing per chunk.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import msgspec
import torch

from framekv import ops
from framekv.graphs import WarmupReport
from framekv.specs import ModelSpec, Preset, RolloutSpec, load_preset

from .attention import get_backend
from .attention.ulysses import resolve_world_size
from .attention.ulysses_kv import UlyssesKV
from .cache import CausalKVCache
from .cache_dir import build_counts, use_cache_dir
from .fp8_linear import FP8, resolve_gemm_dtype
from .kv import KVStore, PagedKV, ReferenceKV
from .memory import check_fits, rollout_bytes
from .model import CausalVideoDiT, DiTChunks, default_backend, model_dtype
from framekv.specs.checks import check_choice
from .runner import ChunkRunner
from .samplers import DEFAULT_SAMPLER, build_sampler, pick_steps

#: The names ``kv_dtype`` takes (also ``--kv-dtype``): "bf16" the model's own dtype (an
#: unquantized pool), "fp8" float8 e4m3 (`torch.float8_e4m3fn`).
KV_DTYPES = ("bf16", "fp8")


def resolve_kv_dtype(kv_dtype, model_dtype: torch.dtype) -> torch.dtype:
    """The K/V pool's dtype for ``kv_dtype``.

    None or "bf16": ``model_dtype`` (the pool holds K/V as the model computes them: bf16
    on CUDA, fp32 on a CPU); "fp8" or `torch.float8_e4m3fn`: an e4m3 pool, quantized with
    the cache's per-layer, per-head scales (`CausalKVCache.kv_scales`); a torch dtype
    equal to ``model_dtype``: that. Anything else is a ValueError naming ``kv_dtype``, the
    values allowed and the value given: a pool of another unquantized dtype than the
    model's is not supported (k and v are written as the model computes them).
    """
    if kv_dtype is None or (isinstance(kv_dtype, str) and kv_dtype == "bf16"):
        return model_dtype
    if (isinstance(kv_dtype, str) and kv_dtype == "fp8") or kv_dtype is torch.float8_e4m3fn:
        return torch.float8_e4m3fn
    if isinstance(kv_dtype, torch.dtype) and kv_dtype == model_dtype:
        return kv_dtype
    model = str(model_dtype).removeprefix("torch.")
    raise ValueError(f"kv_dtype must be None, 'bf16' (the model's dtype, {model}), 'fp8', "
                     f"torch.float8_e4m3fn or torch.{model}, got {kv_dtype!r}")


def resolve_device(device=None) -> torch.device:
    """A torch device from a name (default: cuda if available, else cpu); ValueError for
    an unknown name or CUDA on a machine without it (`framekv.ops.resolve_device`)."""
    return ops.resolve_device(device)


def resolve_specs(preset) -> tuple[str, ModelSpec, RolloutSpec]:
    """(name, model, rollout) from a `Preset`, a preset name or path, or a
    (ModelSpec, RolloutSpec) pair."""
    if isinstance(preset, (str, bytes)) or hasattr(preset, "__fspath__"):
        preset = load_preset(preset)
    if isinstance(preset, Preset):
        return preset.name, preset.model, preset.rollout
    if (isinstance(preset, tuple) and len(preset) == 2 and isinstance(preset[0], ModelSpec)
            and isinstance(preset[1], RolloutSpec)):
        Preset(name=preset[0].name, model=preset[0], rollout=preset[1])  # cross-checks
        return preset[0].name, preset[0], preset[1]
    raise ValueError("preset must be a Preset, a preset name or path, or a "
                     f"(ModelSpec, RolloutSpec) pair, got {type(preset).__name__}")


def with_chunks(rollout: RolloutSpec, chunks: int) -> RolloutSpec:
    """The rollout with another chunk count; a short last chunk stays when chunks > 1."""
    last = rollout.last_chunk_frames if chunks > 1 else 0
    return msgspec.structs.replace(rollout, chunks=chunks, last_chunk_frames=last)


class Rollout(ChunkRunner):
    """One autoregressive rollout of the reference model over a K/V store.

    Args:
        preset: a `Preset`, a preset name or path, or a (ModelSpec, RolloutSpec) pair.
        device: "cpu", "cuda[:N]" or None (cuda if available).
        backend: attention backend name or instance (default: cudnn on CUDA, reference
            on CPU); one instance serves every layer.
        use_graphs, debug: as for `ChunkRunner`.
        model: an existing `CausalVideoDiT` of the same spec and prompt length to
            share (its weights are read, never changed; its attention backend is
            used, ``backend`` is ignored); default: a new one.
        process_group: run under Ulysses sequence parallelism over this
            torch.distributed group (every rank builds the same `Rollout`): the cache
            holds this rank's H_kv / W K/V heads, each forward runs this rank's share
            of the tokens (`UlyssesKV`); every rank gets the whole chunk's latents.
        kv: "paged" (the paged `CausalKVCache`, default), "reference" (the fp32
            exact-window reference: no graphs) or a `KVStore` built for this geometry.
        cache_dir: keep compiled kernels and built cuDNN plans in this folder and load
            them from it (`framekv.engine.cache_dir`); with a shared model, its cuDNN
            backend gets the plan folder if it has none.
        sequences, batch_sizes: as for `ChunkRunner` (B sequences on one paged pool).
        glue: "fused" (framekv's ops, default) or "torch" (torch ops): the same math.
        trim_clean_pass: as for `ChunkRunner`.
        kv_dtype: the paged pool's dtype (`resolve_kv_dtype`): None or "bf16" the model's
            dtype (default), "fp8" or torch.float8_e4m3fn. With a ``kv`` the caller built,
            None takes its cache's dtype and anything else must name it; the reference
            store keeps fp32 (no fp8).
        sampler, sampler_options: a registered sampler's name (default euler) and its
            options (`framekv.engine.samplers`).
        steps: run N of the preset's ``denoising_steps`` steps (`pick_steps`: evenly
            spaced, the first always); None: all of them.
        gemm_dtype: the blocks' GEMMs (`framekv.engine.fp8_linear.resolve_gemm_dtype`):
            None or "bf16" the model's dtype (default), "fp8" or torch.float8_e4m3fn
            (fp8 GEMMs with row-wise scales, the weights quantized here, once).

    Attributes:
        kv_dtype: the dtype the K/V are kept in (the pool's; the model's for a store
            without a pool).
        gemm_dtype: the dtype the blocks' GEMMs run in.

    Usage::

        r = Rollout("tiny")
        r.prefill()
        chunks = [r.step() for _ in range(r.spec.chunks)]   # each [1, C, F, H, W] fp32
    """

    def __init__(self, preset="tiny", device=None, *, backend=None, use_graphs: bool = True,
                 debug: bool = False, model: CausalVideoDiT | None = None,
                 process_group=None, kv="paged", cache_dir=None,
                 sequences: int | None = None, batch_sizes=None, glue: str = "fused",
                 trim_clean_pass: bool = True, kv_dtype=None, sampler: str = DEFAULT_SAMPLER,
                 sampler_options=None, steps: int | None = None, gemm_dtype=None):
        check_choice("glue", glue, ("fused", "torch"))
        if sequences is not None and (kv != "paged" or process_group is not None):
            raise ValueError("sequences runs several sequences on one paged pool: it needs "
                             f"kv='paged' and no process_group, got kv={kv!r}, "
                             f"process_group={process_group!r}")
        self.name, self.model_spec, self.spec = resolve_specs(preset)
        timesteps = pick_steps(torch.linspace(1.0, 0.0, self.spec.denoising_steps + 1)[:-1]
                               .tolist(), steps)
        # the sampler and its options checked before the model is built
        build_sampler(sampler, timesteps, DiTChunks.timestep_scale, sampler_options)
        dev = resolve_device(device)
        dtype = model_dtype(self.model_spec, dev)
        held = getattr(getattr(kv, "cache", None), "dtype", None)
        self.kv_dtype: torch.dtype = (held if kv_dtype is None and held is not None
                                      else resolve_kv_dtype(kv_dtype, dtype))
        self.gemm_dtype: torch.dtype = resolve_gemm_dtype(gemm_dtype, dtype)
        geometry = self.spec.geometry()
        check_fits(f"preset {self.name!r}", rollout_bytes(
            self.model_spec, self.spec, dtype, weights=model is None,
            paged_cache=kv == "paged", sequences=sequences or 1, kv_dtype=self.kv_dtype,
            reference_attention=_default_name(backend, dev, self.model_spec.head_dim)
            == "reference", fp8_weights=self.gemm_dtype == FP8), dev)
        self.model = self._model(model, backend, dev, use_cache_dir(cache_dir, dev))
        #: name of the attention backend (a shared model brings its own)
        self.backend: str = self.model.blocks[0].attn.backend.name
        # the fp8 weights before the store: a layer that cannot be one fails first
        chunks = DiTChunks(self.model, glue, fp8=self.gemm_dtype == FP8)
        store = self._store(kv, process_group, geometry, dev, self.kv_dtype, sequences or 1)
        s = self.spec
        last = (s.chunks - 1, s.last_chunk_frames) if s.last_chunk_frames else None
        super().__init__(chunks, store, frames_per_chunk=s.frames_per_chunk,
                         timesteps=list(timesteps), clean_block="frame", use_graphs=use_graphs,
                         debug=debug, sequences=sequences, batch_sizes=batch_sizes,
                         trim_clean_pass=trim_clean_pass, seed=self.model_spec.seed,
                         last_chunk=last, sampler=sampler, sampler_options=sampler_options)
        self.glue = glue

    def _model(self, model, backend, device, plan_dir) -> CausalVideoDiT:
        if model is None:
            name = backend if backend is not None else default_backend(device, self.model_spec.head_dim)
            backend = get_backend(name, plan_dir=plan_dir, device=device)
            if not backend.supports_kv_cache:
                raise ValueError(f"backend {backend.name!r} cannot attend over the K/V cache: "
                                 "use 'cudnn' (CUDA) or 'reference'")
            return CausalVideoDiT(self.model_spec, prompt_tokens=self.spec.prompt_tokens,
                                  device=device, backend=backend)
        if (model.spec, model.prompt_tokens) != (self.model_spec, self.spec.prompt_tokens):
            raise ValueError("model was built for another spec or prompt length")
        shared = model.blocks[0].attn.backend
        if plan_dir is not None and getattr(shared, "plan_files", False) is None:
            from .attention.cudnn_graph import PlanFiles

            shared.plan_files = PlanFiles(plan_dir)
        return model

    def _store(self, kv, process_group, geometry, device, dtype, B: int) -> KVStore:
        """The K/V store; ``dtype`` the pool's (`kv_dtype`)."""
        if isinstance(kv, KVStore):
            if kv.geometry != geometry:
                raise ValueError(f"kv keeps geometry {kv.geometry}, this rollout needs "
                                 f"{geometry}")
            check_store_dtype(kv, dtype)
            return kv
        if kv == "reference":
            if dtype == torch.float8_e4m3fn:
                raise ValueError("kv_dtype='fp8' needs the paged cache (kv='paged'): the "
                                 "reference store keeps fp32 K/V, got kv='reference'")
            return ReferenceKV(geometry, self.model_spec.num_layers)
        if kv != "paged":
            raise ValueError(f"kv must be 'paged', 'reference' or a KVStore, got {kv!r}")
        world = 1 if process_group is None else resolve_world_size(process_group, None)
        m, tpp = self.model_spec, self.model_spec.tokens_per_page
        cache = CausalKVCache(
            num_layers=m.num_layers, num_kv_heads=m.num_kv_heads // world, head_dim=m.head_dim,
            dtype=dtype, tokens_per_page=tpp, device=device, num_sequences=B,
            pool_tokens=CausalKVCache.pool_tokens_for(geometry, tpp, num_sequences=B))
        if process_group is None:
            return PagedKV(cache, geometry)
        return UlyssesKV(self.model, cache, geometry, process_group)

    @property
    def parallel(self) -> UlyssesKV | None:
        """The Ulysses store under ``process_group``, else None (one process)."""
        return self.kv if isinstance(self.kv, UlyssesKV) else None

    @property
    def prefilled(self) -> bool:
        """Whether every sequence has its prompt (`prefill`)."""
        return all(p is not None for p in self._prompts)

    def prefill(self) -> None:
        """The model's prompt as the pinned prefix of every sequence (`set_prompt`);
        a prompt stays across `reset`."""
        self._check_open()
        if any(p is not None for p in self._prompts):
            raise ValueError("the prompt is already prefilled (it stays across reset())")
        self.set_prompt(self.model.prompt)

    def run(self, chunks: int | None = None) -> list[torch.Tensor]:
        """Prefill if needed, then ``chunks`` more chunks (default: the spec's count)."""
        if not self.prefilled:
            self.prefill()
        return [self.step() for _ in range(self.spec.chunks if chunks is None else chunks)]


def check_store_dtype(kv: KVStore, dtype: torch.dtype) -> None:
    """ValueError unless a caller-built store's pool (if it has one) holds ``dtype``."""
    cache = getattr(kv, "cache", None)
    held = getattr(cache, "dtype", None)
    if held is not None and held != dtype:
        raise ValueError(f"kv's cache holds {str(held).removeprefix('torch.')}, but kv_dtype "
                         f"asks for {str(dtype).removeprefix('torch.')}: pass the kv_dtype "
                         "of the cache, or None with a cache of the model's dtype")


class WarmupResult(NamedTuple):
    """What `warm_up` returns.

    Attributes:
        rollout: the `Rollout` (or another `ChunkRunner`, `captured`) whose graphs were
            captured, at position 0, no prompt.
        report: the capture report (per graph: seconds, memory).
        builds: `framekv.engine.cache_dir.build_counts` after the captures (numba
            kernels compiled / loaded, cuDNN plans built / loaded in this process).
    """

    rollout: Rollout
    report: WarmupReport
    builds: dict[str, int]


def warm_up(preset="tiny", *, device=None, backend=None,
            cache_dir: str | os.PathLike | None = None, progress: bool = True, stream=None,
            debug: bool = False) -> WarmupResult:
    """Build a preset's `Rollout` and capture every graph it replays.

    Args:
        preset: a `Preset`, a preset name or path, or a (ModelSpec, RolloutSpec) pair.
        device: "cpu", "cuda[:N]" or None (cuda if available; on CPU nothing is
            captured: chunks run eagerly, the report lists them).
        backend: attention backend (default: cudnn on CUDA, reference on CPU).
        cache_dir: keep and load kernels and cuDNN plans here (default: the preset's
            ``warmup.cache_dir``, when a `Preset` or preset name is given).
        progress, stream: the progress bar (stderr by default).
        debug: the graph cache's address checks at every replay.
    Raises ValueError for a bad preset or device; `framekv.graphs.GraphCaptureError`
    naming the graph when a capture fails (the rollout is closed then).
    """
    if isinstance(preset, (str, bytes)) or hasattr(preset, "__fspath__"):
        preset = load_preset(preset)
    if cache_dir is None and isinstance(preset, Preset):
        cache_dir = preset.warmup.cache_dir
    return captured(Rollout(preset, device, backend=backend, debug=debug, cache_dir=cache_dir),
                    progress=progress, stream=stream)


def captured(runner: ChunkRunner, *, progress: bool = True, stream=None) -> WarmupResult:
    """``runner`` (any `ChunkRunner`) with every graph it replays captured
    (`ChunkRunner.capture`; ``progress``, ``stream`` as `warm_up`'s), as a
    `WarmupResult`; the runner is closed when a capture fails."""
    try:
        report = runner.capture(progress=progress, stream=stream)
    except BaseException:
        runner.close()
        raise
    return WarmupResult(runner, report, build_counts(runner.chunk_model.attention.backend))


def _default_name(backend, device: torch.device, head_dim: int) -> str:
    """The name of the backend a rollout will run (an instance: its own)."""
    if backend is None:
        return default_backend(device, head_dim)
    return getattr(backend, "name", backend)
