"""CachedAttention: one layer's attention, plain or over the causal K/V cache.

Without a cache it is full attention over the S tokens of the call. With a cache it
stages the first ``seq_len`` rows' K/V (strided views: no copy, also for a packed
QKV tensor), then attends each causal block over exactly its visible key set V(j)
in one backend launch; rows >= seq_len are padding: neither staged nor attended,
and come back zero. A batch of B query rows is the B sequences in use of the cache
(``sequences=`` host ints puts those in use first): each row stages into and attends
over its own sequence only, all of them in the same launches.

Backends (``backend=`` by name or instance): ``reference`` (torch fp32 math, any
device; the oracle) and ``cudnn`` (cudnn-frontend paged SDPA, CUDA). A backend
declares ``supports_kv_cache``; the module refuses a cache on one that does not.
A forward of several layers plans once (``backend.plan(...)`` then ``prepare()``)
and passes the plan to every layer (``plan=``); a call without one plans and
prepares for itself, a one-layer forward.
"""
from __future__ import annotations

import functools
import math

import torch

from ..cache import CausalKVCache
from ..cache.sequences import flat_rows
from .backend import AttentionBackend, AttentionPlan
from .registry import get_backend


class CachedAttention(torch.nn.Module):
    """Attention of one layer, optionally over a `CausalKVCache`.

    Args:
        num_heads: H, query heads.
        num_kv_heads: H_kv, key/value heads; H must be a multiple (GQA).
        head_dim: D.
        backend: "reference", "cudnn" or an `AttentionBackend` instance.
        layer_idx: the cache layer this module reads and writes.
        scale: softmax scale; default 1/sqrt(D).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 backend="reference", layer_idx: int = 0, scale: float | None = None):
        super().__init__()
        for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be an integer >= 0, got {layer_idx!r}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.layer_idx = layer_idx
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
        self.backend: AttentionBackend = get_backend(backend)

    @property
    def supports_kv_cache(self) -> bool:
        """Whether this module's backend can attend over a `CausalKVCache`."""
        return self.backend.supports_kv_cache

    def forward(self, q, k=None, v=None, *, kv_cache=None, seq_len=None,
                causal_block_size=None, plan: AttentionPlan | None = None, sequences=None,
                prologue=None, output: bool = True, **unsupported):
        """Attention output [B, S, H, D] (None with ``output=False``).

        Args:
            q: [B, S, H, D], or packed [B, S, H + 2*H_kv, D] with k = v = None; B > 1
                only with a kv_cache.
            k, v: [B, S, H_kv, D] (any strides, head dim contiguous).
            kv_cache: a `CausalKVCache` with an open geometry, or None. Cached
                attention is inference only: it records no autograd history (inputs
                that require grad are read, never tracked), and its output has none.
            seq_len: real query tokens of this forward; required with a cache.
            causal_block_size: block size cutting the real tokens (a declared size);
                default one block of seq_len.
            plan: this forward's `AttentionPlan`, already prepared (``plan()`` of
                this module's backend for the same cache, seq_len, block size, heads
                and B, ``prepare(sequences)``); default: planned and prepared here.
            sequences: host ints, the sequence of each batch row (distinct, < the
                cache's num_sequences), put in use first; default the cache's
                sequences in use. With a plan: the rows it was prepared with (or None).
            prologue: None, or the fused QK norm and rope of a packed q whose q and
                k are as projected: ``prologue(qkv, k_pool=, v_pool=, dst=, dst2=,
                src_rows=, tokens=)`` (`framekv.ops.qk_norm_rope_stage_` with the
                layer's weights and rope bound). With a cache it is the staging (Q
                normed and rotated in place, K/V straight into the cache's slots);
                without one it runs in place first.
            output: False (with a cache only): stage the K/V (and run the prologue)
                and skip the attention; returns None. For a layer whose output nobody
                reads: the last layer of a clean pass.
        Raises:
            ValueError: masks or other unsupported arguments, bad shapes or dtypes,
                a cache on a backend without cache support, seq_len missing.
        """
        if unsupported:
            raise ValueError(f"unsupported arguments {sorted(unsupported)}: masks are not taken; "
                             "causality comes from causal_block_size and the cache")
        packed = q
        q, k, v = self._split(q, k, v)
        if prologue is not None and packed is q:
            raise ValueError("prologue needs a packed q [B, S, H + 2*H_kv, D] (k = v = None)")
        if kv_cache is None:
            if seq_len is not None or causal_block_size is not None or sequences is not None:
                raise ValueError("seq_len, causal_block_size and sequences need a kv_cache")
            if not output:
                raise ValueError("output=False needs a kv_cache: without one nothing is staged")
            if q.shape[0] != 1:
                raise ValueError(f"q must have batch 1 without a kv_cache, got {q.shape[0]}")
            if prologue is not None:
                with torch.no_grad():
                    prologue(packed)
            return self.backend.dense(q, k, v, self.scale)
        if not self.backend.supports_kv_cache:
            raise ValueError(f"backend {self.backend.name!r} does not support a kv_cache")
        T, b = self._check_cached(q, kv_cache, seq_len, causal_block_size)
        plan = self._plan(plan, kv_cache, T, b, q.shape[0], sequences)
        B, S, H, D = q.shape
        # Inference only: the cache never records autograd history, nor does the output.
        stage = None if prologue is None else functools.partial(
            prologue, packed, tokens=T, **plan.stage_outputs(self.layer_idx))
        with torch.no_grad():
            kv_cache.write_staged(self.layer_idx, k[:, :T], v[:, :T], b, selection=plan.selected,
                                  stage=stage)
            if not output:
                return None
            out = torch.empty_like(q)  # [B, S, H, D]
            out[:, T:].zero_()  # padding rows come back zero
            whole = B == 1 or S == T  # out[:, :T] is then one [B * T] row list
            rows = flat_rows(out[:, :T]) if whole else q.new_empty(B * T, H, D)
            plan.run(flat_rows(q[:, :T].detach()), self.layer_idx, rows)
            if not whole:
                out[:, :T] = rows.view(B, T, H, D)
        return out

    def plan_for(self, kv_cache, seq_len: int, causal_block_size: int,
                 batch: int = 1) -> AttentionPlan:
        """This module's backend's plan of a forward over ``batch`` sequences of
        ``kv_cache`` (not prepared)."""
        # batch only when > 1: backends written before batches take no such argument
        more = {"batch": batch} if batch != 1 else {}
        return self.backend.plan(kv_cache, tokens=seq_len, block_size=causal_block_size,
                                 num_heads=self.num_heads, scale=self.scale, **more)

    def _plan(self, plan, cache, T: int, b: int, B: int, sequences) -> AttentionPlan:
        if plan is None:
            plan = self.plan_for(cache, T, b, B)
            plan.prepare(sequences)
            return plan
        if not (isinstance(plan, AttentionPlan)
                and plan.matches(cache, T, b, self.num_heads, self.scale, B)):
            raise ValueError(f"plan must be the AttentionPlan of this forward (cache, seq_len={T}, "
                             f"causal_block_size={b}, {self.num_heads} heads, scale {self.scale}, "
                             f"batch {B}), got {plan!r}")
        unselected = plan.selected is None and (cache.num_sequences > 1 or sequences is not None)
        if unselected or (sequences is not None and plan.selected.rows != tuple(sequences)):
            raise ValueError("plan must be prepared, with the sequences passed here, before the "
                             "forward: call plan.prepare(sequences)")
        return plan

    # ------------------------------------------------------------------ checks
    def _split(self, q, k, v):
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] < 1:
            raise ValueError(f"q must be a [B, S, H, D] tensor, got "
                             f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        if (k is None) != (v is None):
            raise ValueError("k and v must both be given, or both be None for a packed q")
        if k is None:
            if tuple(q.shape[2:]) != (H + 2 * Hkv, D):
                raise ValueError(f"packed q must have shape [B, S, {H + 2 * Hkv}, {D}], "
                                 f"got {list(q.shape)}")
            q, k, v = q[:, :, :H], q[:, :, H:H + Hkv], q[:, :, H + Hkv:]
        for name, t, heads in (("q", q, H), ("k", k, Hkv), ("v", v, Hkv)):
            if t.dim() != 4 or tuple(t.shape) != (q.shape[0], q.shape[1], heads, D):
                raise ValueError(f"{name} must have shape [{q.shape[0]}, {q.shape[1]}, {heads}, {D}], "
                                 f"got {list(t.shape)}")
            if t.dtype != q.dtype or t.device != q.device:
                raise ValueError(f"{name} must match q's dtype and device ({q.dtype}, {q.device}), "
                                 f"got {t.dtype}, {t.device}")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must have a contiguous head dim, got strides {t.stride()}")
        allowed = self.backend.dtypes(q.device)
        if q.dtype not in allowed:
            raise ValueError(f"q must have dtype in {allowed} on {q.device.type} (backend "
                             f"{self.backend.name!r}), got {q.dtype}")
        return q, k, v

    def _check_cached(self, q, cache, seq_len, b):
        if not isinstance(cache, CausalKVCache):
            raise ValueError(f"kv_cache must be a framekv.engine.CausalKVCache, got "
                             f"{type(cache).__name__}")
        S = q.shape[1]
        if seq_len is None:
            raise ValueError("seq_len (the real query tokens of this forward) is required with a kv_cache")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 1 <= seq_len <= S:
            raise ValueError(f"seq_len must be an integer in [1, {S}], got {seq_len!r}")
        b = seq_len if b is None else b
        if isinstance(b, bool) or not isinstance(b, int) or b < 1 or seq_len % b:
            raise ValueError(f"causal_block_size must be a positive divisor of seq_len={seq_len}, got {b!r}")
        if (cache.num_kv_heads, cache.head_dim) != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"kv_cache holds {cache.num_kv_heads} K/V heads of {cache.head_dim}, "
                             f"the module {self.num_kv_heads} of {self.head_dim}")
        if cache.dtype != q.dtype and not cache.quantized:  # an fp8 pool takes any float q
            raise ValueError(f"kv_cache dtype {cache.dtype} differs from q's {q.dtype}")
        self.backend.check_cache(cache)
        return seq_len, b
