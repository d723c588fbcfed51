"""Injected faults and a cache twinned with the fp32 exact-window reference, shared by the
CPU, simulator and GPU fault suites.

`Twin` drives a `CausalKVCache` and an `ExactWindowReference` with the same K/V, and
`Twin.verify` runs forwards of every block size over every layer, each compared with
the reference's attention over exactly V(j), then a few whole chunks (forwards,
commit) so that a wrong table, ring or private copy left by a fault shows. `Fault`
wraps a function so that one call fails part way: before it runs, after it ran, or
after half its work (a copy cut in the middle).
"""
from __future__ import annotations

import pytest
import torch

from framekv import ops
from framekv.engine import CachedAttention, CausalKVCache
from framekv.engine.cache.reference import ExactWindowReference
from framekv.specs import Geometry

#: Mid-page pin, window and blocks: every partly visible page path runs (tpp 4).
GEOMETRY = Geometry(pin_tokens=5, window_tokens=11, max_staged_tokens=8,
                    causal_block_sizes=(4, 8))
TPP, LAYERS, H, HKV, D = 4, 2, 4, 2, 16
_COPY = ops.copy_kv_slots_  # the real op, for faults that do part of its work


class InjectedFault(RuntimeError):
    """The failure a `Fault` raises."""


class Fault:
    """``fn`` made to fail on its ``at``-th call (1-based), once.

    ``when``: "before" (nothing done), "after" (the call's work done), or a callable
    ``partial(*args, **kwargs)`` that does part of the work before the raise.
    """

    def __init__(self, fn, *, at: int = 1, when="before"):
        self.fn, self.at, self.when, self.calls, self.fired = fn, at, when, 0, False

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls != self.at:
            return self.fn(*args, **kwargs)
        self.fired = True
        if self.when == "after":
            self.fn(*args, **kwargs)
        elif callable(self.when):
            self.when(*args, **kwargs)
        raise InjectedFault(f"injected fault in call {self.calls} of {getattr(self.fn, '__name__', self.fn)}")


def patch_method(monkeypatch, cls, name: str, fault: Fault) -> Fault:
    """Route ``cls.name`` through ``fault`` (which receives ``self`` first)."""
    fault.fn = getattr(cls, name)
    monkeypatch.setattr(cls, name, lambda self, *a, **kw: fault(self, *a, **kw))
    return fault


class Twin:
    """A cache and the fp32 reference fed the same K/V; see the module doc.

    Args:
        device, dtype, backend: of the cache and its attention.
        tol: max abs error allowed against the reference.
    """

    def __init__(self, device="cpu", dtype=torch.float32, backend="reference", tol=1e-5,
                 seed=0, head_dim=D):
        self.device, self.dtype, self.tol = torch.device(device), dtype, tol
        self.head_dim = head_dim
        self.cache = CausalKVCache(num_layers=LAYERS, num_kv_heads=HKV, head_dim=head_dim,
                                   dtype=dtype, tokens_per_page=TPP, device=device,
                                   pool_tokens=CausalKVCache.pool_tokens_for(GEOMETRY, TPP))
        self.cache.open(GEOMETRY)
        self.ref = ExactWindowReference(GEOMETRY, LAYERS)
        self.attn = [CachedAttention(H, HKV, head_dim, backend=backend, layer_idx=i)
                     for i in range(LAYERS)]
        self.gen = torch.Generator().manual_seed(seed)
        self.errors: list[float] = []

    def qkv(self) -> torch.Tensor:
        """Fresh packed QKV [1, M, H + 2 H_kv, D] on the cache's device and dtype."""
        x = torch.randn(1, GEOMETRY.max_staged_tokens, H + 2 * HKV, self.head_dim,
                        generator=self.gen)
        return x.to(self.device, self.dtype)

    def forward_layer(self, layer: int, b: int, x: torch.Tensor | None = None) -> float:
        """One layer's forward over M tokens in blocks of b, checked; returns the error."""
        M = GEOMETRY.max_staged_tokens
        x = self.qkv() if x is None else x
        out = self.attn[layer](x, kv_cache=self.cache, seq_len=M, causal_block_size=b)
        self.ref.write(layer, self.ref.committed, x[0, :, H:H + HKV], x[0, :, H + HKV:])
        want = self.ref.attention(layer, x[0, :, :H], M, b)
        err = float((out[0].float().cpu() - want).abs().max())
        self.errors.append(err)
        assert err <= self.tol, f"layer {layer} block {b}: error {err:.3e} > {self.tol:.1e}"
        return err

    def forward(self, b: int) -> None:
        """Every layer's forward in blocks of b."""
        for layer in range(LAYERS):
            self.forward_layer(layer, b)

    def commit(self, n: int | None = None) -> None:
        """Commit n (default M) on both."""
        n = GEOMETRY.max_staged_tokens if n is None else n
        self.cache.commit(n)
        self.ref.commit(n)

    def chunk(self) -> None:
        """A denoising forward (one block), the clean pass (small blocks), commit."""
        self.forward(max(GEOMETRY.causal_block_sizes))
        self.forward(min(GEOMETRY.causal_block_sizes))
        self.commit()

    def settle(self, committed_before: int, n: int) -> str:
        """After a failed commit of n: "before" or "after", the reference brought along;
        AssertionError for any other committed count."""
        C = self.cache.committed_tokens
        if C == committed_before:
            return "before"
        assert C == committed_before + n, (C, committed_before, n)
        self.ref.commit(n)
        return "after"

    def verify(self, chunks: int = 3) -> None:
        """Forwards of every block size on every layer, then ``chunks`` whole chunks,
        each forward exact against the reference."""
        for b in GEOMETRY.causal_block_sizes:
            self.forward(b)
        for _ in range(chunks):
            self.chunk()


def half_copy(k_pool, v_pool, src, dst):
    """A committed-copy pass cut in the middle: the first half of the pairs only."""
    n = src.shape[0] // 2
    _COPY(k_pool, v_pool, src[:n], dst[:n])


#: The commit's device steps (kernels on CUDA and under the simulator): the op to make
#: fail and how much of it runs first.
KERNEL_STEPS = {"after advancing the counters": ("advance_commit_", "after"),
                "after rotating the ring": ("rotate_rows_", "after"),
                "after rebuilding the layout": ("causal_layout_", "after"),
                "committed copies cut in the middle": ("copy_kv_slots_", half_copy)}


def commit_fails_at(monkeypatch, twin: Twin, step: str, chunks: int = 3) -> None:
    """``chunks`` whole chunks, a staged forward, then a commit that fails at ``step``
    (`KERNEL_STEPS`): asserts it left the cache as before, then commits again and
    verifies the next forwards."""
    for _ in range(chunks):
        twin.chunk()
    twin.forward(GEOMETRY.max_staged_tokens)
    C, M = twin.cache.committed_tokens, GEOMETRY.max_staged_tokens
    name, when = KERNEL_STEPS[step]
    fault = Fault(getattr(ops, name), when=when)
    monkeypatch.setattr(ops, name, fault)
    with pytest.raises(InjectedFault):
        twin.cache.commit(M)
    assert fault.fired and twin.settle(C, M) == "before"
    monkeypatch.undo()
    twin.commit()
    twin.verify()


def first_scatter_fails(monkeypatch) -> list:
    """Make the first staging launcher a cache binds write its K/V, then fail once;
    returns the list that will hold its `Fault`."""
    bind, faults = ops.bind_scatter_kv_slots, []

    def faulty_bind(*args, **kwargs):
        launch = bind(*args, **kwargs)
        if faults:
            return launch
        faults.append(Fault(launch, when="after"))
        return faults[-1]

    monkeypatch.setattr(ops, "bind_scatter_kv_slots", faulty_bind)
    return faults
