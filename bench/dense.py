"""The dense rolling-cache baseline: the reference model over contiguous K/V buffers.

This is how Self-Forcing, CausVid and LongLive style inference keeps its K/V today,
run on the same model and inputs as `Rollout` so that a benchmark compares the two
end to end. Per layer one contiguous K and one V buffer of P + W + T_max tokens
(P = pin_tokens, W = window_tokens, T_max = max_staged_tokens), filled left-aligned::

    [0, P)               the pinned prompt
    [P, P + h)           the last h = min(C - P, W) committed tokens, oldest first
    [P + h, P + h + T)   the current forward's tokens, positions [C, C + T)

so every position p >= C - h sits at slot ``P + h + (p - C)``. A causal block j of
size b starts at s = C + j*b and sees exactly (DESIGN.md, "The cache")::

    V(j) = [0, P)  U  [max(P, s - W), s)  U  [s, s + b)

Its window and own tokens are the slot range [slot(max(P, s - W)), slot(s + b)).
When that range starts at P (the denoising forwards, whose one block is the chunk,
and every block while the window fills) V(j) is the buffer slice [0, slot(s + b))
and attention reads it in place; otherwise (a clean-pass block j > 0 once the window
is full: its window starts j*b tokens in) the prompt K/V is concatenated with the
range. One SDPA call per block, backend selectable ("cudnn", "flash", "efficient",
"math"); GQA through ``enable_gqa`` or, where the backend refuses it, by repeating
the K/V heads.

``commit(n)`` while h + n <= W only advances the counters; beyond that it rolls the
window left by cloning: ``buf[P:P+W] = buf[P+shift:P+shift+W].clone()`` with
shift = h + n - W, for K and V of every layer. The counters are host ints: unlike
framekv's cache, nothing here is device resident.

CUDA graphs: once the window is full (h = W) the slot ranges of a chunk of T tokens
depend on P, W, T and the block sizes only, and the roll always shifts by T, so one
graph per chunk length replays for every later chunk. While the window fills the
ranges move with h; those first ceil(W / chunk_tokens) chunks run eagerly.
`DenseRollingKV` is a `framekv.engine.kv.KVStore`: its ``capture_scope`` sets a full
window (`DenseRollingKV.set_full_window`) for the captures, and it is ``replayable``
only at a full window. `DenseRollout` is a `Rollout` over it.
"""
from __future__ import annotations

import contextlib

import torch

from framekv.engine.kv import AttendFn, KVStore, plain
from framekv.engine.model import model_dtype
from framekv.engine.rollout import Rollout, resolve_device, resolve_specs
from framekv.specs import Geometry

from .sdpa import SDPA_BACKENDS, DenseSDPA, sdpa_backend_name

__all__ = ["DenseRollingKV", "DenseRollout", "SDPA_BACKENDS", "sdpa_backend_name"]

def _is_int_in(value, lo: int, hi: int | None = None) -> bool:
    """Whether ``value`` is an int (not a bool) in [lo, hi] (hi None: no upper bound)."""
    return (isinstance(value, int) and not isinstance(value, bool) and value >= lo
            and (hi is None or value <= hi))


class DenseRollingKV(KVStore):
    """Per layer one contiguous K and V buffer [P + W + T_max, H_kv, D], rolled by clone.

    Args:
        geometry: the rollout's `Geometry`: P = pin_tokens, W = window_tokens,
            T_max = max_staged_tokens.
        num_layers, num_kv_heads, head_dim: the buffers' shapes.
        dtype, device: of the buffers; attention runs in this dtype (fp32 on CPU).
        backend: SDPA backend, one of `SDPA_BACKENDS` (default cudnn on CUDA, math on
            CPU; on CPU math runs whatever is asked).

    Attributes:
        k_buffers, v_buffers: per layer [P + W + T_max, H_kv, D]; allocated once,
            they never move or grow.
        committed: C, positions committed so far, the prompt included (host int).
        history: h = min(C - P, W), the committed window tokens held at [P, P + h).
        staged: tokens the current forward wrote at [P + h, P + h + staged).
        backend: the SDPA backend asked for; ``kernel``: the one that runs.

    A forward is ``stage`` then ``attention`` for every layer (the store's ``forward``
    does both for a model); ``commit(n)`` makes the first n staged tokens history. The
    prompt goes in through ``prompt_forward`` and ``commit_prompt``.
    """

    def __init__(self, geometry: Geometry, *, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype = torch.float32, device="cpu",
                 backend: str | None = None):
        if not isinstance(geometry, Geometry):
            raise ValueError(f"geometry must be a Geometry, got {type(geometry).__name__}")
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if not _is_int_in(value, 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        self.device = resolve_device(device)
        self.backend = sdpa_backend_name(backend, self.device)
        self._sdpa = DenseSDPA(self.backend, self.device)
        self.geometry, self.num_layers = geometry, num_layers
        self.num_kv_heads, self.head_dim, self.dtype = num_kv_heads, head_dim, dtype
        shape = (self.capacity, num_kv_heads, head_dim)
        self.k_buffers = [torch.zeros(shape, dtype=dtype, device=self.device)
                          for _ in range(num_layers)]                      # [N, H_kv, D] each
        self.v_buffers = [torch.zeros(shape, dtype=dtype, device=self.device)
                          for _ in range(num_layers)]
        self.committed = self.history = self.staged = 0

    # ------------------------------------------------------------------ shape, state
    @property
    def pin_tokens(self) -> int:
        return self.geometry.pin_tokens

    @property
    def window_tokens(self) -> int:
        return self.geometry.window_tokens

    @property
    def capacity(self) -> int:
        """Tokens per buffer: P + W + T_max."""
        g = self.geometry
        return g.pin_tokens + g.window_tokens + g.max_staged_tokens

    @property
    def buffer_bytes(self) -> int:
        """Bytes of every K and V buffer together (constant for the object's life)."""
        return sum(b.nbytes for b in self.k_buffers + self.v_buffers)

    @property
    def kernel(self) -> str:
        """The SDPA backend that runs: ``backend`` on CUDA, "math" on CPU."""
        return self._sdpa.kernel

    @property
    def gqa(self) -> str | None:
        """How GQA runs: "native" (enable_gqa), "repeat" (K/V heads repeated), or None
        before the first attention with fewer K/V heads than query heads."""
        return self._sdpa.gqa

    @property
    def window_full(self) -> bool:
        """Whether the window holds W tokens, the fill level at which slices are fixed."""
        return self.committed >= self.pin_tokens and self.history == self.window_tokens

    def window_positions(self) -> range:
        """Logical positions held at [P, P + h), in slot order."""
        return range(self.committed - self.history, self.committed)

    def reset(self) -> None:
        """Back to position 0 with zeroed buffers (same tensors, same addresses)."""
        for buf in self.k_buffers + self.v_buffers:
            buf.zero_()
        self.committed = self.history = self.staged = 0

    def set_full_window(self) -> None:
        """Set the host counters of a full window (C = P + W, h = W), buffers untouched.

        For capturing chunk graphs before a rollout starts: a graph captured at a full
        window replays for every chunk that starts at one. `reset` afterwards.
        """
        self.committed = self.pin_tokens + self.window_tokens
        self.history, self.staged = self.window_tokens, 0

    def close(self) -> None:
        """Drop the buffers; the store is unusable after."""
        self.k_buffers, self.v_buffers = [], []

    @property
    def replayable(self) -> bool:
        """Chunk graphs are captured at a full window and replay only at one."""
        return self.window_full

    @contextlib.contextmanager
    def capture_scope(self):
        """Captures run at a full window (the rollout resets the store afterwards)."""
        self.set_full_window()
        yield

    # ------------------------------------------------------------------ prompt
    def prompt_forward(self, prompt_tokens: int) -> AttendFn:
        """The `AttendFn` of the prompt forward: each layer's K/V of the P prompt tokens
        goes to [0, P) and the prompt attends itself as one causal block (V = [0, P)).
        Needs an empty buffer (C = 0); `commit_prompt` afterwards."""
        if prompt_tokens != self.pin_tokens:
            raise ValueError(f"the prompt must hold pin_tokens={self.pin_tokens} tokens, "
                             f"got {prompt_tokens}")
        if self.committed:
            raise ValueError(f"the prompt goes into an empty buffer, C = {self.committed}; "
                             "reset() first")

        def attend(attn, qkv):                                             # [1, P, H+2Hkv, D]
            P, H, Hkv = self.pin_tokens, attn.num_heads, attn.num_kv_heads
            if qkv.shape[1] != P:
                raise ValueError(f"the prompt forward has {qkv.shape[1]} tokens, P = {P}")
            k, v = self._buffers(attn.layer_idx)
            k[:P].copy_(qkv[0, :, H:H + Hkv])                              # [P, H_kv, D]
            v[:P].copy_(qkv[0, :, H + Hkv:])
            q = qkv[0, :, :H].contiguous()                                 # [P, H, D]
            return self._sdpa(q, k[:P], v[:P], attn.scale).contiguous()[None]
        return plain(attend)

    def commit_prompt(self) -> None:
        """Commit the prompt written by the `prompt_forward` forward: C = P."""
        if self.committed:
            raise ValueError(f"the prompt is committed at C = 0 only, C = {self.committed}")
        self.committed, self.staged = self.pin_tokens, 0

    # ------------------------------------------------------------------ forwards
    def _buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not _is_int_in(layer, 0, self.num_layers - 1):
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer!r}")
        if not self.k_buffers:
            raise ValueError("DenseRollingKV was closed")
        return self.k_buffers[layer], self.v_buffers[layer]

    def slot(self, position: int) -> int:
        """Buffer slot of a position in the window or the current forward (p >= C - h).
        While the pinned region fills (C < P, a model whose pinned prefix is its first
        generated frames) positions sit at their own index."""
        return min(self.committed, self.pin_tokens) + self.history + (position - self.committed)

    def stage(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write a forward's k, v ([T, H_kv, D], any strides) at positions [C, C + T)."""
        kb, vb = self._buffers(layer)
        want = (self.num_kv_heads, self.head_dim)
        if k.dim() != 3 or k.shape != v.shape or tuple(k.shape[1:]) != want:
            raise ValueError(f"k and v must both be [T, {want[0]}, {want[1]}], got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        T = k.shape[0]
        if not 1 <= T <= self.geometry.max_staged_tokens:
            raise ValueError(f"a forward writes 1 to {self.geometry.max_staged_tokens} tokens, "
                             f"got {T}")
        lo = self.slot(self.committed)
        kb[lo:lo + T].copy_(k)                                             # [T, H_kv, D]
        vb[lo:lo + T].copy_(v)
        self.staged = T

    def block_slots(self, j: int, block_size: int) -> tuple[tuple[int, int], ...]:
        """Slot ranges block j reads, in key order: ((0, hi),) when V(j) is one slice
        of the buffer, else ((0, P), (lo, hi)) (the prompt, then the window tail and the
        block's own tokens); ((lo, hi),) without a prompt."""
        P, W, b = self.pin_tokens, self.window_tokens, block_size
        s = self.committed + j * b
        lo, hi = self.slot(max(P, s - W)), self.slot(s + b)
        if P == 0:
            return ((lo, hi),)
        return ((0, hi),) if lo == P else ((0, P), (lo, hi))

    def block_kv(self, layer: int, j: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ([|V(j)|, H_kv, D]) block j attends: a view of the buffer, or the
        prompt concatenated with the window tail (a copy)."""
        kb, vb = self._buffers(layer)
        ranges = self.block_slots(j, block_size)
        if len(ranges) == 1:
            (lo, hi), = ranges
            return kb[lo:hi], vb[lo:hi]
        return (torch.cat([kb[lo:hi] for lo, hi in ranges]),
                torch.cat([vb[lo:hi] for lo, hi in ranges]))

    def attention(self, layer: int, q: torch.Tensor, seq_len: int, block_size: int,
                  scale: float | None = None) -> torch.Tensor:
        """Each causal block's queries over exactly V(j), one SDPA call per block.

        Args:
            q: [S, H, D]; row r is position C + r; rows >= seq_len come back zero.
            seq_len: real tokens, staged by this forward, a multiple of block_size.
            block_size: b; block j holds rows [j*b, (j+1)*b).
            scale: softmax scale (default 1/sqrt(D)).
        Returns [S, H, D] in q's dtype.
        """
        b = block_size
        if q.dim() != 3:
            raise ValueError(f"q must be [S, H, D], got {tuple(q.shape)}")
        if not _is_int_in(b, 1):
            raise ValueError(f"block_size must be a positive integer, got {b!r}")
        if not 1 <= seq_len <= min(self.staged, q.shape[0]) or seq_len % b:
            raise ValueError(f"seq_len must be a multiple of block_size={b} in [1, "
                             f"{min(self.staged, q.shape[0])}] (staged tokens), got {seq_len}")
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = torch.zeros_like(q)                                          # [S, H, D]
        for j in range(seq_len // b):
            k, v = self.block_kv(layer, j, b)                              # [L, H_kv, D]
            out[j * b:(j + 1) * b] = self._sdpa(q[j * b:(j + 1) * b], k, v, scale)
        return out

    def forward(self, seq_len: int, block_size: int) -> AttendFn:
        """The model's `AttendFn` for one forward: stage the first ``seq_len`` rows' K/V
        of each layer, then `attention` with causal blocks of ``block_size``."""
        def attend(attn, qkv):                                             # [1, S, H+2Hkv, D]
            H, Hkv = attn.num_heads, attn.num_kv_heads
            rows = qkv[0, :seq_len]
            self.stage(attn.layer_idx, rows[:, H:H + Hkv], rows[:, H + Hkv:])
            q = qkv[0, :, :H].contiguous()  # [S, H, D]: the plain layout every backend takes
            return self.attention(attn.layer_idx, q, seq_len, block_size, attn.scale)[None]
        return plain(attend)

    # ------------------------------------------------------------------ commit
    def commit(self, n: int) -> None:
        """Make the first n staged tokens history: C += n; the window rolls by clone once
        it would hold more than W tokens. Staged tokens past n are not kept."""
        if not _is_int_in(n, 0, self.staged):
            raise ValueError(f"n must be in [0, {self.staged}] (staged tokens), got {n!r}")
        P, W, C = self.pin_tokens, self.window_tokens, self.committed
        held = self.history + max(0, C + n - max(C, P))  # window tokens at [P, P + held)
        shift = held - W
        if shift > 0 and W:
            for buf in self.k_buffers + self.v_buffers:
                buf[P:P + W] = buf[P + shift:P + shift + W].clone()       # [W, H_kv, D]
        self.committed += n
        self.history = min(held, W)
        self.staged = 0

    def after_replay(self, n: int) -> None:
        """Host half of a replayed chunk whose graph staged and committed n tokens at a
        full window (the roll ran on the device): C += n."""
        if not self.window_full:
            raise ValueError("a replayed dense chunk needs a full window")
        if not _is_int_in(n, 0, self.geometry.max_staged_tokens):
            raise ValueError(f"n must be in [0, {self.geometry.max_staged_tokens}], got {n!r}")
        self.committed += n
        self.staged = 0


class DenseRollout(Rollout):
    """The dense rolling-cache baseline of `Rollout`: same model, inputs and sampler,
    attention over a `DenseRollingKV` (contiguous buffers, roll-by-clone commit, one
    SDPA call per causal block) instead of framekv's paged `CausalKVCache`.

    Args:
        preset: a `Preset`, a preset name or path, or a (ModelSpec, RolloutSpec) pair.
        device: "cpu", "cuda[:N]" or None (cuda if available).
        backend: SDPA backend, one of `SDPA_BACKENDS` (default cudnn on CUDA, math on
            CPU, where math runs whatever is asked).
        use_graphs: replay chunks that start at a full window through the `GraphCache`
            (CUDA graphs on CUDA, eager calls on CPU); earlier chunks run eagerly
            (``paths`` counts both).
        debug: the graph cache's address checks at every replay.
        model: an existing `CausalVideoDiT` of the same spec and prompt length to share
            (e.g. a `Rollout`'s, for a comparison on the same weights).

    Attributes:
        kv: the `DenseRollingKV`; ``cache`` is None (there is no paged cache).
    """

    def __init__(self, preset="tiny", device=None, *, backend: str | None = None,
                 use_graphs: bool = True, debug: bool = False, model=None):
        dev = resolve_device(device)
        sdpa = sdpa_backend_name(backend, dev)
        _, m, r = resolve_specs(preset)
        kv = DenseRollingKV(r.geometry(), num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                            head_dim=m.head_dim, dtype=model_dtype(m, dev), device=dev,
                            backend=sdpa)
        # The baseline's glue is torch ops and its clean pass runs every layer, as
        # Self-Forcing-style code runs them.
        super().__init__(preset, dev, backend="reference", use_graphs=use_graphs, debug=debug,
                         model=model, kv=kv, glue="torch", trim_clean_pass=False)
        self.backend = f"sdpa-{kv.kernel}"
