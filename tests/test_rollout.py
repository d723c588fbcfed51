"""The rollout driver: cached rollout == dense recompute, graphs, constant memory."""
from __future__ import annotations

import gc

import msgspec
import pytest
import torch

from framekv.engine import KVStore, PagedKV, ReferenceKV
from framekv.engine.attention.backend import ReferenceBackend, ReferencePlan
from framekv.engine.rollout import Rollout, resolve_device, with_chunks
from framekv.engine.verify import ReferenceRollout, verify_rollout
from framekv.specs import load_preset

TINY = load_preset("tiny")


def _specs(model=None, **rollout):
    return (msgspec.structs.replace(TINY.model, **(model or {})),
            msgspec.structs.replace(TINY.rollout, **rollout))


def _max_err(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_cached_rollout_equals_dense_recompute_over_visible_context():
    spec = _specs(chunks=22)
    cached = Rollout(spec)
    got = cached.run()
    dense = ReferenceRollout(spec, model=cached.model)
    want = dense.run()
    assert len(got) == 22 and all(x.shape == (1, 4, 2, 8, 8) for x in got)
    # The window slid far past its size, so pages were recycled along the way.
    g = cached.geometry
    assert cached.cache.committed_tokens == g.pin_tokens + 22 * spec[1].chunk_tokens
    assert cached.cache.committed_tokens > g.pin_tokens + 10 * g.window_tokens
    assert _max_err(got, want) < 1e-4
    assert max(float(x.abs().max()) for x in got) > 0.5          # non-trivial latents


@pytest.mark.parametrize("prompt", [0, 45])  # no prompt; a prompt longer than one forward
def test_prompt_lengths_match_the_dense_recompute(prompt):
    spec = _specs(prompt_tokens=prompt, chunks=4)
    cached = Rollout(spec)
    got = cached.run()
    assert cached.cache.committed_tokens == prompt + 4 * spec[1].chunk_tokens
    assert _max_err(got, ReferenceRollout(spec, model=cached.model).run()) < 1e-4


def test_graphs_and_eager_agree_and_capture_does_not_corrupt():
    a = Rollout("tiny", use_graphs=True)
    b = Rollout("tiny", use_graphs=False, model=a.model)
    out_a, out_b = a.run(), b.run()
    assert _max_err(out_a, out_b) == 0.0
    stats = a.graphs.stats()
    assert stats.graphs == 1 and stats.hits == TINY.rollout.chunks and stats.eager
    assert a.graphs.keys()[0].program == "chunk[euler]:2x32+clean16+commit"
    assert len(b.graphs) == 0


def test_reset_replays_the_same_rollout():
    r = Rollout("tiny")
    first = r.run(3)
    r.reset()                                       # back to position 0, the prompt kept
    assert r.cache.committed_tokens == TINY.rollout.prompt_tokens and r.frames_done == 0
    assert _max_err(first, r.run(3)) == 0.0


def test_shorter_last_chunk():
    spec = _specs(chunks=4, last_chunk_frames=1)
    r = Rollout(spec)
    out = r.run()
    assert [x.shape[2] for x in out] == [2, 2, 2, 1]
    assert len(r.graphs) == 2                                     # one graph per chunk length
    assert r.frames_done == 7
    want = ReferenceRollout(spec, model=r.model).run()
    assert _max_err(out, want) < 1e-4
    # Past the planned chunks the rollout goes on with full chunks.
    assert r.step().shape[2] == 2


def test_frame_index_input_grows_with_the_rollout():
    r = Rollout(_specs(chunks=3, last_chunk_frames=1), use_graphs=False)
    r.prefill()
    seen = []
    for _ in range(4):
        seen.append(r.frames_done)                  # the next chunk's first frame
        r.step()
    assert seen == [0, 2, 4, 5]  # the short chunk is the third


def test_capture_warms_exactly_what_is_replayed():
    r = Rollout(_specs(chunks=3, last_chunk_frames=1))
    requests = r.capture_requests()
    assert [q.key.tokens for q in requests] == [32, 16]
    assert [q.key.program for q in requests] == ["chunk[euler]:2x32+clean16+commit",
                                                 "chunk[euler]:2x16+clean16+commit"]
    report = r.capture(progress=False)
    assert report.graphs == 2 and report.captured == 2
    assert [rec.program for rec in report.records] == [q.key.program for q in requests]
    again = r.capture(progress=False)  # nothing new: every graph is there
    assert again.captured == 0 and [x.status for x in again.records] == ["cached"] * 2
    assert r.cache.committed_tokens == 0  # the store was reset after the captures
    out = r.run()
    assert len(r.graphs) == 2 and r.paths == {"graphs": 3, "eager": 0}
    assert set(r.graphs.keys()) == {q.key for q in requests}
    eager = Rollout((r.model_spec, r.spec), use_graphs=False, model=r.model)
    assert _max_err(out, eager.run()) == 0.0 and eager.paths == {"graphs": 0, "eager": 3}


class _CountingKV(PagedKV):
    """The paged store, counting what the rollout asks of the seam."""

    def __init__(self, *args):
        super().__init__(*args)
        self.calls = {"forward": 0, "commit": 0, "after_replay": 0, "prompt": 0}

    def forward(self, seq_len, block_size):
        self.calls["forward"] += 1
        return super().forward(seq_len, block_size)

    def commit(self, n):
        self.calls["commit"] += 1
        super().commit(n)

    def after_replay(self, tokens):
        self.calls["after_replay"] += 1
        super().after_replay(tokens)

    def commit_prompt(self):
        self.calls["prompt"] += 1
        super().commit_prompt()


def test_a_store_given_to_the_rollout_is_the_one_seam():
    from framekv.engine import CausalKVCache

    g, m = TINY.geometry(), TINY.model
    cache = CausalKVCache(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                          head_dim=m.head_dim, dtype=torch.float32, tokens_per_page=8,
                          device="cpu", pool_tokens=CausalKVCache.pool_tokens_for(g, 8))
    kv = _CountingKV(cache, g)
    r = Rollout("tiny", kv=kv, use_graphs=False)
    want = Rollout("tiny", use_graphs=False, model=r.model).run(3)
    assert _max_err(r.run(3), want) == 0.0 and r.cache is cache
    steps = TINY.rollout.denoising_steps
    assert kv.calls == {"forward": 3 * (steps + 1), "commit": 3, "after_replay": 0, "prompt": 1}
    with pytest.raises(ValueError, match="kv keeps geometry"):
        Rollout(_specs(window_frames=1), kv=kv)
    with pytest.raises(ValueError, match="kv must be 'paged', 'reference' or a KVStore"):
        Rollout("tiny", kv="dense")
    with pytest.raises(ValueError, match="cannot be captured in graphs"):
        Rollout("tiny", kv="reference")
    assert isinstance(ReferenceRollout("tiny").kv, ReferenceKV)
    assert isinstance(r.kv, KVStore) and ReferenceRollout("tiny").cache is None


def _noting_replays(device: str) -> tuple[Rollout, list]:
    """The tiny rollout on ``device``, graphs on, and the tokens of each call of its
    store's host half after a replay (`KVStore.after_replay`), as they come."""
    r, calls = Rollout("tiny", device), []
    real = r.kv.after_replay
    r.kv.after_replay = lambda tokens: (calls.append(tokens), real(tokens))
    return r, calls


def test_the_runners_graphs_carry_no_replay_hook_and_an_eager_call_commits_itself():
    r, calls = _noting_replays("cpu")
    assert [q.after_replay for q in r.capture_requests()] == [None]
    out = r.run(3)                   # a CPU's graph cache calls the chunk eagerly
    assert r.paths == {"graphs": 3, "eager": 0} and calls == []
    eager = Rollout("tiny", use_graphs=False, model=r.model)
    assert _max_err(out, eager.run(3)) == 0.0
    assert r.cache.committed_tokens == eager.cache.committed_tokens


@pytest.mark.gpu
def test_after_each_replay_the_runner_advances_the_stores_host_half_once():
    r, calls = _noting_replays("cuda")
    r.run(3)
    assert r.paths["graphs"] == 3 and calls == [r.capture_requests()[0].key.tokens] * 3
    torch.cuda.synchronize()
    assert int(r.cache._open.seqs[0].counters[0]) == r.cache.committed_tokens


def test_lifecycle_errors():
    r = Rollout("tiny")
    with pytest.raises(ValueError, match="prefill"):
        r.step()
    r.prefill()
    with pytest.raises(ValueError, match="already prefilled"):
        r.prefill()
    r.step()
    with pytest.raises(ValueError, match="before the first chunk"):
        r.capture()
    with pytest.raises(ValueError, match="chunk lengths"):
        r.capture_request(16)
    with pytest.raises(ValueError, match="unknown preset"):
        Rollout("no-such-preset")
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="preset must be"):
        Rollout(42)
    with pytest.raises(ValueError, match="another spec or prompt length"):
        Rollout(_specs(prompt_tokens=7), model=r.model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(ValueError, match="CUDA is not available"):
        Rollout("tiny", device="cuda")


def test_with_chunks_keeps_or_drops_the_short_last_chunk():
    base = _specs(chunks=4, last_chunk_frames=1)[1]
    assert with_chunks(base, 7).last_chunk_frames == 1
    assert with_chunks(base, 1).last_chunk_frames == 0


def test_thousand_chunks_in_constant_memory():
    # One layer, one denoising step: the cache and the driver, not the model, are tested.
    # 4 x 4 latents in 2 x 2 patches: 4 tokens per frame, so the window slides every chunk.
    spec = _specs(model={"num_layers": 1, "latent_height": 4, "latent_width": 4},
                  tokens_per_frame=4, chunks=1000, denoising_steps=1)
    r = Rollout(spec)
    arena = r.cache._arena
    r.prefill()
    for _ in range(20):
        r.step()
    gc.collect()
    before = (arena.mapped_bytes, arena.used_bytes, len(arena.allocations), len(r.graphs),
              len(r.cache._states))
    objects = len(gc.get_objects())
    for _ in range(980):
        r.step()
    gc.collect()
    after = (arena.mapped_bytes, arena.used_bytes, len(arena.allocations), len(r.graphs),
             len(r.cache._states))
    assert after == before
    assert len(gc.get_objects()) - objects < 200                 # nothing kept per chunk
    assert r.chunk_index == 1000 and r.graphs.stats().hits == 1000
    assert r.cache.committed_tokens == spec[1].prompt_tokens + 1000 * spec[1].chunk_tokens


def test_verify_rollout_api():
    report = verify_rollout("tiny", chunks=3)
    assert report.ok and report.chunks == 3 and len(report.replay_errors) == 3
    assert list(report.attention_errors) == ["prefill", "denoise 0", "denoise 1", "clean"]
    assert all(len(row) == TINY.model.num_layers for row in report.attention_errors.values())
    report.assert_ok()


class _PerturbedPlan(ReferencePlan):
    def run(self, q, layer, out):
        super().run(q, layer, out)
        out.add_(1e-2)


class _Perturbed(ReferenceBackend):
    """The reference backend with a planted error in every cached attention."""

    def plan(self, cache, *, tokens, block_size, num_heads, scale):
        return _PerturbedPlan(cache, tokens=tokens, block_size=block_size, num_heads=num_heads,
                              scale=scale)


def test_verify_rollout_catches_a_planted_error():
    report = verify_rollout("tiny", chunks=2, backend=_Perturbed())
    assert not report.ok
    assert report.max_attention_error == pytest.approx(1e-2, rel=1e-3)
    with pytest.raises(AssertionError, match="FAILED"):
        report.assert_ok()
    # A tolerance above the planted error lets it pass.
    assert verify_rollout("tiny", chunks=2, backend=_Perturbed(), tolerance=0.1).ok
