"""An attention-only stack over a real cache: what the chunk benchmark and the graph
tests run (a rollout's warm-up captures the rollout itself, `framekv.engine.warm_up`).

    cache     one `CausalKVCache` sized for the largest of its geometries
    layers    one `CachedAttention` per cache layer (one shared backend instance, so
              the layers share cuDNN graphs: the layer is not part of a cuDNN key)
    forward   every layer's forward over a static packed QKV input [1, T, H + 2 H_kv, D]
    commit    ``commit(T)``
    chunk     N denoising forwards (one causal block), a clean forward (frame blocks)
              and the commit: the per-chunk sequence of a rollout, one graph

Graphs read the open geometry's tensors, whose addresses they bake; `ensure_open`
opens a geometry before its requests are built. Device state of every geometry
survives close/open, so a graph captured over a geometry replays after a reopen.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

import msgspec
import torch

from framekv import graphs as G
from framekv.specs import Geometry, ModelSpec

from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.attention import get_backend

_GPU_KV_DTYPES = ("bfloat16", "float16")


class KVShape(NamedTuple):
    """The cache a stack holds: the arguments of `CausalKVCache` other than pool size
    and device (``dtype`` a name, e.g. "bfloat16")."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_page: int

    @classmethod
    def of(cls, model: ModelSpec) -> "KVShape":
        """The cache ``model`` needs."""
        return cls(model.num_layers, model.num_kv_heads, model.head_dim, model.dtype,
                   model.tokens_per_page)


def default_device() -> torch.device:
    """cuda when a GPU is visible, else cpu."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def kv_dtype_for(kv: KVShape, device) -> torch.dtype:
    """The pool dtype on ``device``: float32 on CPU (the reference path computes in
    fp32 whatever the spec says), the spec's bf16/fp16 on CUDA (bf16 for a float32
    spec, which the CUDA cache does not take)."""
    if torch.device(device).type == "cpu":
        return torch.float32
    return getattr(torch, kv.dtype if kv.dtype in _GPU_KV_DTYPES else "bfloat16")


class AttentionStack:
    """A cache and one `CachedAttention` per layer: what a plan's graphs run over.

    Args:
        kv: the cache's shape (layers, K/V heads, head size, dtype, page size).
        geometries: every geometry the cache must be able to open; the pool is sized
            for the largest need.
        device: "cpu" or a CUDA device.
        num_heads: query heads per layer (default ``kv.num_kv_heads``: MHA).
        backend: attention backend name or instance (default: "cudnn" on CUDA,
            "reference" on CPU); one instance serves every layer.
        seed: seed of the static QKV inputs.
        plan_dir: with the default cuDNN backend, keep its built plans in this
            folder across processes (see `CudnnBackend`).
    """

    def __init__(self, kv: KVShape, geometries: Iterable[Geometry], *, device=None,
                 num_heads: int | None = None, backend=None, seed: int = 0,
                 plan_dir=None):
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
        self.backend = _make_backend(backend, self.device, plan_dir)
        self.layers = [CachedAttention(self.num_heads, kv.num_kv_heads, kv.head_dim,
                                       backend=self.backend, layer_idx=i)
                       for i in range(kv.num_layers)]
        self.owner = G.owner_token(self.cache)
        self._generator = torch.Generator().manual_seed(seed)
        # Head h of a chained forward's next input adds output head h mod H.
        self._widen = torch.arange(self.num_heads + 2 * kv.num_kv_heads,
                                   device=self.device) % self.num_heads

    @classmethod
    def for_preset(cls, preset, *, device="cuda", **kw) -> "AttentionStack":
        """The stack of a preset's attention (its model's layers and heads, its
        rollout's geometry), that geometry open. ``preset``: a `Preset` or a name."""
        from framekv.specs import load_preset

        preset = load_preset(preset) if isinstance(preset, str) else preset
        g = preset.rollout.geometry()
        stack = cls(KVShape.of(preset.model), [g], device=device, num_heads=preset.model.num_heads, **kw)
        stack.ensure_open(g)
        return stack

    # ------------------------------------------------------------------ keys
    def qkv_input(self, tokens: int) -> dict[str, torch.Tensor]:
        """A packed QKV input of ``tokens`` tokens: ``{"qkv": [1, T, H + 2 H_kv, D]}``."""
        shape = (1, tokens, self.num_heads + 2 * self.kv.num_kv_heads, self.kv.head_dim)
        x = torch.randn(shape, generator=self._generator)
        return {"qkv": x.to(self.device, self.dtype)}

    def layout_of(self, geometry: Geometry, tokens: int,
                  block_sizes: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[bool, ...]]:
        """(split-KV S, GQA query packing) of the plan of each forward of ``tokens`` in
        ``block_sizes`` (``geometry`` opened first, if it is not the open one); both empty
        for a backend that never splits."""
        if not hasattr(self.backend, "split_for"):
            return (), ()
        self.ensure_open(geometry)
        plans = [self.layers[0].plan_for(self.cache, tokens, b) for b in block_sizes]
        return tuple(p.splits for p in plans), tuple(p.packed for p in plans)

    def forward_key(self, geometry: Geometry, tokens: int, block_size: int) -> G.GraphKey:
        """Key of the graph of one forward of ``tokens`` tokens cut into ``block_size``
        blocks (program ``"forward"``; its split-KV S and GQA packing when the backend
        has them)."""
        splits, packed = self.layout_of(geometry, tokens, (block_size,))
        return G.GraphKey.build(
            owner=self.owner, geometry=geometry, tokens=tokens, block_sizes=(block_size,),
            program="forward",
            inputs=_layout_only(self.qkv_shape(tokens), self.dtype, self.device),
            splits=splits, packed=packed)

    def commit_key(self, geometry: Geometry, tokens: int) -> G.GraphKey:
        """Key of the ``commit(tokens)`` graph of a geometry (program ``"commit:n"``;
        n is baked, C is not)."""
        return G.GraphKey.build(owner=self.owner, geometry=geometry, tokens=tokens,
                                program=f"commit:{tokens}")

    def qkv_shape(self, tokens: int) -> tuple[int, ...]:
        """Shape of the static QKV input of a ``tokens``-token forward."""
        return (1, tokens, self.num_heads + 2 * self.kv.num_kv_heads, self.kv.head_dim)

    # ------------------------------------------------------------------ requests
    def forward(self, qkv: torch.Tensor, tokens: int, block_size: int, *,
                chain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's forward over the open geometry: (last output [1, T, H, D],
        the next input).

        With ``chain`` each layer reads the mean of the previous layer's input and its
        output (head h of the input with output head h mod H), so every layer's K/V and
        the output depend on every earlier layer: a layer or step mixed up shows in the
        result; the mean keeps magnitudes bounded over any depth. Without it every
        layer reads ``qkv`` and the next input is ``qkv``.
        """
        x, out = qkv, None                                   # [1, T, H + 2 H_kv, D]
        plan = self.layers[0].plan_for(self.cache, tokens, block_size)
        plan.prepare()                                       # once per forward
        for layer in self.layers:
            out = layer(x, kv_cache=self.cache, seq_len=tokens, causal_block_size=block_size,
                        plan=plan)
            if chain:
                x = (x + out[:, :, self._widen]) * 0.5
        return out, x

    def forward_request(self, geometry: Geometry, tokens: int,
                        block_size: int) -> G.CaptureRequest:
        """Every layer's forward over the static ``qkv``; returns the last layer's output.

        A replay writes the K/V on the device; ``after_replay`` tells the host mirror.
        """
        cache = self.cache

        def forward(qkv: torch.Tensor) -> torch.Tensor:
            return self.forward(qkv, tokens, block_size)[0]

        inputs = self.qkv_input(tokens)
        key = self.forward_key(geometry, tokens, block_size)
        return G.CaptureRequest(key, forward, inputs, lambda: cache.note_staged(tokens))

    def chunk(self, qkv: torch.Tensor, tokens: int, *, denoise_steps: int, clean_block: int,
              chain: bool = False, device_commit: bool = False):
        """One whole chunk: ``denoise_steps`` forwards with the chunk as one causal block,
        the clean forward in ``clean_block`` blocks, ``commit(tokens)``.

        Returns (last denoising output, clean output), each [1, T, H, D] (the first
        is None for ``denoise_steps == 0``). ``device_commit`` runs `commit_device`
        alone (what a graph holds; the host mirror then moves in ``after_replay``).
        """
        x, denoised = qkv, None
        for _ in range(denoise_steps):
            denoised, x = self.forward(x, tokens, tokens, chain=chain)
        clean, _ = self.forward(x, tokens, clean_block, chain=chain)
        if device_commit:
            self.cache.commit_device(tokens)
        else:
            self.cache.commit(tokens)
        return denoised, clean

    def chunk_key(self, geometry: Geometry, tokens: int, *, denoise_steps: int,
                  clean_block: int, chain: bool = False) -> G.GraphKey:
        """Key of `chunk_request`'s graph; ``chain`` changes the work, so the program
        (``chunk-chained:...`` instead of ``chunk:...``)."""
        blocks = (tokens,) * denoise_steps + (clean_block,)
        splits, packed = self.layout_of(geometry, tokens, blocks)
        key = G.chunk_key(self.owner, geometry, tokens, denoise_steps=denoise_steps,
                          clean_block=clean_block,
                          inputs=_layout_only(self.qkv_shape(tokens), self.dtype, self.device),
                          splits=splits, packed=packed)
        if not chain:
            return key
        return msgspec.structs.replace(
            key, program="chunk-chained" + key.program.removeprefix("chunk"))

    def chunk_request(self, geometry: Geometry, tokens: int, *, denoise_steps: int,
                      clean_block: int, chain: bool = False) -> G.CaptureRequest:
        """A whole chunk (see `chunk`) as one graph over a static ``qkv``.

        On CUDA the captured commit is ``commit_device`` and ``after_replay`` moves the
        host mirror (the forwards staged ``tokens``, then the commit); on CPU every
        call is the eager chunk with the whole commit and no hook runs.
        """
        self.ensure_open(geometry)
        cache, on_gpu = self.cache, self.device.type == "cuda"

        def chunk(qkv: torch.Tensor):
            return self.chunk(qkv, tokens, denoise_steps=denoise_steps, clean_block=clean_block,
                              chain=chain, device_commit=on_gpu)

        def mirror() -> None:
            cache.note_staged(tokens)
            cache.commit_host(tokens)

        key = self.chunk_key(geometry, tokens, denoise_steps=denoise_steps,
                             clean_block=clean_block, chain=chain)
        return G.CaptureRequest(key, chunk, self.qkv_input(tokens), mirror)

    def commit_request(self, geometry: Geometry, tokens: int) -> G.CaptureRequest:
        """``commit(tokens)`` as a graph.

        On CUDA the graph is ``commit_device`` (no host argument, capture-safe) and
        ``after_replay`` advances the host mirror. On CPU the callable runs eagerly
        on every replay and no hook is called, so it is the whole ``commit``
        (``commit_device`` on CPU applies the mirror, which must move first).
        Warm-up calls run ``commit_device`` alone on both: ``commit_host`` refuses
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
                                after_replay=lambda: cache.commit_host(tokens),
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


def _make_backend(backend, device: torch.device, plan_dir=None):
    if backend is not None:
        return get_backend(backend)
    return get_backend("cudnn" if device.type == "cuda" else "reference", plan_dir=plan_dir)


def _layout_only(shape, dtype, device) -> dict[str, torch.Tensor]:
    """A stand-in input with the static input's layout (keys take layouts, not values)."""
    return {"qkv": torch.empty(shape, dtype=dtype, device=device)}

