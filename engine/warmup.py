"""Warm-up over a real cache: every graph of a `framekv.specs.WarmupPlan`, captured up front.

The plan names (geometry, tokens, block size) triples; this module builds what is
captured for them over an attention-only stack (DESIGN.md, "Graphs"):

    cache     one `CausalKVCache` sized for the largest geometry of the plan
    layers    one `CachedAttention` per cache layer (one shared backend instance, so
              the layers share cuDNN graphs: the layer is not part of a cuDNN key)
    forward   per (geometry, tokens, block size): every layer's forward over a static
              packed QKV input [1, tokens, H + 2 H_kv, D]
    commit    per (geometry, tokens): ``commit(tokens)``

    result = warm_up(load_preset("tiny"))
    print(format_report(result.report))
    result.cache.open(geometry)            # position 0
    result.graphs.replay(result.stack.forward_key(geometry, tokens, block_size))

State effects (see `framekv.graphs.GraphCache`): warm-up runs the callables, so the
pool and the counters hold warm-up garbage afterwards; `AttentionStack.reset` (run
by `warm_up`) zeroes the pool and puts every geometry back at position 0, and leaves
the cache closed. A rollout opens its geometry and replays.
"""
from __future__ import annotations

import os
from typing import Iterable, NamedTuple

import torch

from framekv import graphs as G
from framekv.ops import _launch
from framekv.specs import Geometry, KVSpec, Preset, WarmupPlan

from .attention import CachedAttention
from .cache import CausalKVCache

#: Block size of the commit items `warmup_items` adds (no forward runs in a commit).
COMMIT_BLOCK = 0
_GPU_KV_DTYPES = ("bfloat16", "float16")


def default_device() -> torch.device:
    """cuda when a GPU is visible, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kv_dtype_for(kv: KVSpec, device) -> torch.dtype:
    """The pool dtype on ``device``: float32 on CPU (the reference path computes in
    fp32 whatever the spec says), the spec's bf16/fp16 on CUDA (bf16 for a float32
    spec, which the CUDA cache does not take)."""
    if torch.device(device).type == "cpu":
        return torch.float32
    return getattr(torch, kv.dtype if kv.dtype in _GPU_KV_DTYPES else "bfloat16")


def plan_geometries(plan: WarmupPlan) -> list[Geometry]:
    """The plan's distinct geometries, in plan order."""
    return list(dict.fromkeys(entry.geometry for entry in plan.entries))


def warmup_items(plan: WarmupPlan) -> list[tuple[Geometry, int, int]]:
    """The plan's (geometry, tokens, block size) items, each run of one (geometry,
    tokens) followed by its commit item ``(geometry, tokens, COMMIT_BLOCK)``.

    The commit comes after the forwards so that the report lists it next to them;
    a (geometry, tokens) met again later gets no second commit item.
    """
    items, committed = [], set()
    source = list(plan.items())
    for i, (geometry, tokens, block) in enumerate(source):
        items.append((geometry, tokens, block))
        last_of_run = i + 1 == len(source) or source[i + 1][:2] != (geometry, tokens)
        if last_of_run and (geometry, tokens) not in committed:
            committed.add((geometry, tokens))
            items.append((geometry, tokens, COMMIT_BLOCK))
    return items


class AttentionStack:
    """A cache and one `CachedAttention` per layer: what a plan's graphs run over.

    Args:
        kv: the cache's shape (layers, K/V heads, head size, page size).
        geometries: every geometry the cache must be able to open; the pool is sized
            for the largest need.
        device: "cpu" or a CUDA device.
        num_heads: query heads per layer (default ``kv.num_kv_heads``: MHA).
        backend: attention backend name or instance (default: "cudnn" on CUDA,
            "reference" on CPU); one instance serves every layer.
        seed: seed of the static QKV inputs.
    """

    def __init__(self, kv: KVSpec, geometries: Iterable[Geometry], *, device=None,
                 num_heads: int | None = None, backend=None, seed: int = 0):
        self.kv, self.geometries = kv, list(dict.fromkeys(geometries))
        if not self.geometries:
            raise ValueError("an AttentionStack needs at least one geometry")
        self.device = torch.device(device) if device is not None else default_device()
        self.dtype = kv_dtype_for(kv, self.device)
        self.num_heads = kv.num_kv_heads if num_heads is None else num_heads
        pool = max(CausalKVCache.pool_tokens_for(g, kv.tokens_per_page) for g in self.geometries)
        self.cache = CausalKVCache(num_layers=kv.num_layers, num_kv_heads=kv.num_kv_heads,
                                   head_dim=kv.head_dim, dtype=self.dtype,
                                   tokens_per_page=kv.tokens_per_page, pool_tokens=pool,
                                   device=self.device)
        self.backend = _make_backend(backend, self.device)
        self.layers = [CachedAttention(self.num_heads, kv.num_kv_heads, kv.head_dim,
                                       backend=self.backend, layer_idx=i)
                       for i in range(kv.num_layers)]
        self.owner = G.owner_token(self.cache)
        self._generator = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------------ keys
    def qkv_input(self, tokens: int) -> dict[str, torch.Tensor]:
        """A packed QKV input of ``tokens`` tokens: ``{"qkv": [1, T, H + 2 H_kv, D]}``."""
        shape = (1, tokens, self.num_heads + 2 * self.kv.num_kv_heads, self.kv.head_dim)
        x = torch.randn(shape, generator=self._generator)
        return {"qkv": x.to(self.device, self.dtype)}

    def forward_key(self, geometry: Geometry, tokens: int, block_size: int) -> G.GraphKey:
        """Key of the forward graph of one plan item."""
        return G.forward_key(self.owner, geometry, tokens, block_size,
                             inputs=_layout_only(self.qkv_shape(tokens), self.dtype, self.device))

    def commit_key(self, geometry: Geometry, tokens: int) -> G.GraphKey:
        """Key of the ``commit(tokens)`` graph of a geometry."""
        return G.commit_key(self.owner, geometry, tokens)

    def qkv_shape(self, tokens: int) -> tuple[int, ...]:
        """Shape of the static QKV input of a ``tokens``-token forward."""
        return (1, tokens, self.num_heads + 2 * self.kv.num_kv_heads, self.kv.head_dim)

    # ------------------------------------------------------------------ requests
    def builder(self, geometry: Geometry, tokens: int, block_size: int) -> G.CaptureRequest:
        """The `framekv.graphs.run_warmup` builder: a forward request, or the commit
        request for ``block_size == COMMIT_BLOCK``. Opens ``geometry`` first (the
        callables read the open geometry's tensors, whose addresses a graph bakes)."""
        self.ensure_open(geometry)
        if block_size == COMMIT_BLOCK:
            return self.commit_request(geometry, tokens)
        return self.forward_request(geometry, tokens, block_size)

    def forward_request(self, geometry: Geometry, tokens: int,
                        block_size: int) -> G.CaptureRequest:
        """Every layer's forward over the static ``qkv``; returns the last layer's output.

        A replay writes the K/V on the device; ``after_replay`` tells the host mirror.
        """
        cache, layers = self.cache, self.layers

        def forward(qkv: torch.Tensor) -> torch.Tensor:
            out = None
            for layer in layers:
                out = layer(qkv, kv_cache=cache, seq_len=tokens, causal_block_size=block_size)
            return out

        inputs = self.qkv_input(tokens)
        key = G.forward_key(self.owner, geometry, tokens, block_size, inputs=inputs)
        return G.CaptureRequest(key, forward, inputs, lambda: cache.note_staged(tokens))

    def commit_request(self, geometry: Geometry, tokens: int) -> G.CaptureRequest:
        """``commit(tokens)`` as a graph.

        On CUDA the graph is ``commit_device`` (no host argument, capture-safe) and
        ``after_replay`` advances the host mirror. On CPU the callable runs eagerly
        on every replay and no hook is called, so it is the whole ``commit``
        (``commit_device`` on CPU applies the mirror, which must move first).
        Warm-up calls run ``commit_device`` alone on both: ``commit_mirror`` refuses
        to commit more than is staged, and repeated warm-up calls would; the device
        state this moves ahead of the mirror is undone by `reset`.
        """
        cache = self.cache

        def device_only() -> None:
            cache.commit_device(tokens)

        def whole() -> None:
            cache.commit(tokens)

        fn = device_only if self.device.type == "cuda" else whole
        return G.CaptureRequest(self.commit_key(geometry, tokens), fn, {},
                                after_replay=lambda: cache.commit_mirror(tokens),
                                warmup_fn=device_only)

    # ------------------------------------------------------------------ state
    def ensure_open(self, geometry: Geometry) -> None:
        """Open ``geometry`` unless it is the open one (opening resets it to position 0)."""
        if self.cache.geometry != geometry:
            self.cache.close()
            self.cache.open(geometry)

    def reset(self) -> None:
        """Undo warm-up effects: zero the pool, put every geometry at position 0
        (host mirror and device state), leave the cache closed.

        Zeroing is not needed for correctness (no forward reads a slot its rollout
        did not write) but makes rollouts after a warm-up bit-for-bit reproducible.
        """
        self.cache.close()
        self.cache.k_pool.zero_()
        self.cache.v_pool.zero_()
        for geometry in self.geometries:
            self.cache.open(geometry)  # open() rewrites the state from the host model
            self.cache.close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class WarmupResult(NamedTuple):
    """What `warm_up` returns: the captured graphs, the cache they run over, the
    report, and the stack (layers, keys) for building inputs and keys later."""

    graphs: G.GraphCache
    cache: CausalKVCache
    report: G.WarmupReport
    stack: AttentionStack


def warm_up(plan: WarmupPlan | Preset, *, device=None, num_heads: int | None = None,
            cache_dir: str | os.PathLike | None = None, progress: bool = True, stream=None,
            backend=None, debug: bool = False) -> WarmupResult:
    """Capture every forward and commit graph of ``plan`` over a fresh attention stack.

    Args:
        plan: a `WarmupPlan`, or a `Preset` (its plan; query heads from its model).
        device: default cuda when visible, else cpu (where graphs run eagerly).
        num_heads: query heads (default: the preset model's, else ``num_kv_heads``).
        cache_dir: keep compiled numba kernels here across processes (default
            ``plan.cache_dir``); see `use_cache_dir`.
        progress, stream: the progress bar (stderr by default).
        backend: attention backend (default "cudnn" on CUDA, "reference" on CPU).
        debug: `GraphCache` debug checks.
    Raises ValueError for a bad plan; `framekv.graphs.GraphCaptureError` naming the
    item when a capture fails (the cache is shut down then).
    """
    plan, num_heads = _plan_and_heads(plan, num_heads)
    device = torch.device(device) if device is not None else default_device()
    chosen_dir = cache_dir if cache_dir is not None else plan.cache_dir
    if chosen_dir:
        use_cache_dir(chosen_dir, device)
    stack = AttentionStack(plan.kv, plan_geometries(plan), device=device, num_heads=num_heads,
                           backend=backend)
    graph_cache = G.GraphCache(stack.device, debug=debug)
    try:
        report = graph_cache.warmup(warmup_items(plan), stack.builder, progress=progress,
                                    stream=stream)
        stack.reset()
    except BaseException:
        stack.cache.shutdown()  # nothing else holds the pool yet
        raise
    return WarmupResult(graph_cache, stack.cache, report, stack)


def use_cache_dir(cache_dir: str | os.PathLike, device) -> bool:
    """Keep the numba kernels warm-up compiles under ``cache_dir/numba`` (numba's
    on-disk cache; effective for kernels not compiled yet in this process), for later
    processes. cuDNN plans are rebuilt in every process. On CPU nothing is compiled:
    returns False and touches nothing.
    """
    if torch.device(device).type != "cuda":
        return False
    _launch.enable_disk_cache(os.path.join(os.fspath(cache_dir), "numba"))
    return True


def _plan_and_heads(plan, num_heads):
    if isinstance(plan, Preset):
        return plan.warmup_plan(), plan.model.num_heads if num_heads is None else num_heads
    if not isinstance(plan, WarmupPlan):
        raise ValueError(f"plan must be a WarmupPlan or a Preset, got {type(plan).__name__}")
    return plan, num_heads


def _make_backend(backend, device: torch.device):
    if backend is not None:
        return backend
    if device.type != "cuda":
        return "reference"
    from .attention_cudnn import CudnnBackend

    return CudnnBackend()


def _layout_only(shape, dtype, device) -> dict[str, torch.Tensor]:
    """A stand-in input with the static input's layout (keys take layouts, not values)."""
    return {"qkv": torch.empty(shape, dtype=dtype, device=device)}

