"""Faults injected into prompt changes, on the CPU: a prompt write that fails at any layer
(its forward, a layer's write of a sequence, a block's cross-attention K/V, a re-cache's
clean pass) is undone, so the next chunks are those of a rollout where it never happened,
and a change after a failed one is the change made alone. See `test_faults.py` for the
cache's own mutations."""
from __future__ import annotations

import pytest
import torch

from fault_harness import Fault, InjectedFault, patch_method
from framekv.engine import CachedAttention, CausalKVCache, Rollout, WanRollout
from framekv.engine.step import chunk_noise
from framekv.engine.wan import build_model
from framekv.engine.wan.attention import PromptKV


def _steps(r, n: int, first: int = 0) -> list:
    """``n`` chunks (a Wan rollout from its own seed-0 noise, chunk ``first`` on)."""
    if not isinstance(r, WanRollout):
        return [r.step() for _ in range(n)]
    return [r.step(chunk_noise(0, first + i, (4, 2, 4, 4))[None]) for i in range(n)]


def _close(a, b, tol: float = 0.0) -> None:
    """Chunks ``a`` equal ``b`` to ``tol`` (default: bit for bit)."""
    assert max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True)) <= tol


#: Every layer of a rewrite of two sequences' prompts: the prompt forward, and each
#: sequence's write of each layer (made, then failing).
REWRITE_FAULTS = {f"forward layer {i}": (CachedAttention, "forward", i + 1, "before")
                  for i in range(2)}
REWRITE_FAULTS.update({f"write of sequence {s} layer {i}": (CausalKVCache, "write_range",
                                                             2 * s + i + 1, "after")
                       for s in range(2) for i in range(2)})


@pytest.mark.parametrize("point", sorted(REWRITE_FAULTS))
def test_a_prompt_rewrite_that_fails_at_any_layer_is_undone(monkeypatch, point):
    r = Rollout("tiny", device="cpu", sequences=2)
    twin = Rollout("tiny", device="cpu", sequences=2, model=r.model)
    _close(r.run(2), twin.run(2))
    new = torch.randn(r.prompt_shape, generator=torch.Generator().manual_seed(5))
    cls, name, at, when = REWRITE_FAULTS[point]
    fault = patch_method(monkeypatch, cls, name, Fault(None, at=at, when=when))
    with pytest.raises(InjectedFault):
        r.prefill_rows([0, 1], new, rewrite=True)
    assert fault.fired
    monkeypatch.undo()
    _close(_steps(r, 2), _steps(twin, 2))              # as if the rewrite never happened
    old = r.cache.k_pool[:, r.cache.slot_of(0, 1)].clone()
    for x in (r, twin):
        x.prefill_rows([0, 1], new, rewrite=True)      # a rewrite after a failed one
    assert not torch.equal(r.cache.k_pool[:, r.cache.slot_of(0, 1)], old)
    _close(_steps(r, 2), _steps(twin, 2))


def test_a_prompt_start_that_fails_part_way_leaves_the_sequence_at_zero(monkeypatch):
    r = Rollout("tiny", device="cpu", sequences=2)
    twin = Rollout("tiny", device="cpu", sequences=2, model=r.model)
    _close(r.run(2), twin.run(2))
    patch_method(monkeypatch, CausalKVCache, "commit", Fault(None, when="after"))
    with pytest.raises(InjectedFault):
        r.prefill_rows([1])                            # the prompt's commit went through
    monkeypatch.undo()
    assert r.cache.sequence_committed_tokens(1) == 0 and r.sequence_chunks == [2, 0]
    with pytest.raises(ValueError, match=r"sequences without one: \[1\]"):
        r.step()
    for x in (r, twin):
        x.prefill_rows([1])
    _close(_steps(r, 2), _steps(twin, 2))


@pytest.fixture(scope="module")
def wan_model():
    return build_model("tiny", seed=3)


WAN = dict(latent_size=(4, 4), frames_per_chunk=2, sink_frames=2, window_frames=4,
           timesteps=(1000, 500), use_graphs=False)
#: (what fails, which call, tolerance of the chunks after against no change): a
#: block's cross-attention K/V (put back exactly), or a re-cache's clean pass (re-cached
#: under the old prompt: its chunks equal to rounding, the sink one chunk and nothing
#: slid out of the window yet; a chunk after holds that rounding in its history).
WAN_FAULTS = {f"cross-attention K/V of block {i}": (PromptKV, "write", i + 1, 0.0)
              for i in range(2)}
WAN_FAULTS.update({f"re-cache layer {i}": (CachedAttention, "forward", i + 1, 1e-5)
                   for i in range(2)})


@pytest.mark.parametrize("guided", [False, True], ids=["one", "guided"])
@pytest.mark.parametrize("point", sorted(WAN_FAULTS))
def test_a_wan_prompt_change_that_fails_at_any_layer_is_undone(monkeypatch, wan_model, point,
                                                              guided):
    kw = {**WAN, "guidance_scale": 3.0 if guided else None}
    r, twin = WanRollout(wan_model, **kw), WanRollout(wan_model, **kw)
    gen = torch.Generator().manual_seed(1)
    old, new = ([torch.randn(1, 5, 16, generator=gen) for _ in range(1 + guided)]  # + negative
                for _ in range(2))
    for x in (r, twin):
        x.set_prompt(*old)
    _close(_steps(r, 2), _steps(twin, 2))
    cls, name, at, tol = WAN_FAULTS[point]
    if guided:  # the positive branch fails once the negative one was rewritten and re-cached
        at, tol = at + 4, 1e-5  # (its write and re-cache: 4 block writes, 2 passes x 2 layers)
    fault = patch_method(monkeypatch, cls, name, Fault(None, at=at, when="after"))
    with pytest.raises(InjectedFault):
        r.set_prompt(*new, recache=True)
    assert fault.fired
    monkeypatch.undo()
    _close(_steps(r, 1, 2), _steps(twin, 1, 2), tol)
    for x in (r, twin):
        x.set_prompt(*new, recache=True)               # a change after a failed one
    _close(_steps(r, 2, 3), _steps(twin, 2, 3), tol)
