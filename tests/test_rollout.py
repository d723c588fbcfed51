"""The rollout driver: cached rollout == dense recompute, graphs, constant memory."""
from __future__ import annotations

import gc

import msgspec
import pytest
import torch

from framekv.engine.attention_backends import ReferenceBackend
from framekv.engine.rollout import Rollout, resolve_device, verify_rollout, with_chunks
from framekv.engine.verify import ReferenceRollout
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
    assert len(got) == 22 and all(x.shape == (2, 4, 8, 8) for x in got)
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
    assert a.graphs.keys()[0].program == "chunk:2x32+clean16+commit"
    assert len(b.graphs) == 0


def test_reset_replays_the_same_rollout():
    r = Rollout("tiny")
    first = r.run(3)
    r.reset()
    assert r.cache.committed_tokens == 0 and r.frames_done == 0
    assert _max_err(first, r.run(3)) == 0.0


def test_shorter_last_chunk():
    spec = _specs(chunks=4, last_chunk_frames=1)
    r = Rollout(spec)
    out = r.run()
    assert [x.shape[0] for x in out] == [2, 2, 2, 1]
    assert len(r.graphs) == 2                                     # one graph per chunk length
    assert r.frames_done == 7
    want = ReferenceRollout(spec, model=r.model).run()
    assert _max_err(out, want) < 1e-4
    # Past the planned chunks the rollout goes on with full chunks.
    assert r.step().shape[0] == 2


def test_frame_index_input_grows_with_the_rollout():
    r = Rollout(_specs(chunks=3, last_chunk_frames=1), use_graphs=False)
    r.prefill()
    seen = []
    for _ in range(4):
        seen.append(int(r.inputs(r.chunk_index)["frame0"]))
        r.step()
    assert seen == [0, 2, 4, 5]  # the short chunk is the third


def test_warmup_builder_captures_the_plan():
    r = Rollout(_specs(chunks=3, last_chunk_frames=1))
    plan = TINY.warmup_plan().__class__.from_rollout(TINY.kv_spec(), r.spec)
    report = r.graphs.warmup(plan.items(), r.capture_request, progress=False)
    assert report.graphs == 2 and report.captured == 2
    r.reset()  # the warm-up calls moved the cache
    out = r.run()
    assert len(r.graphs) == 2
    eager = Rollout((r.model_spec, r.spec), use_graphs=False, model=r.model)
    assert _max_err(out, eager.run()) == 0.0


def test_resident_rollout_equals_the_replayed_one_and_keeps_a_runner_per_chunk_length():
    spec = _specs(chunks=5, last_chunk_frames=1)
    replayed = Rollout(spec)
    resident = Rollout(spec, resident=True, model=replayed.model)
    want, got = replayed.run(), resident.run()
    assert [x.shape[0] for x in got] == [2, 2, 2, 2, 1]
    assert _max_err(want, got) == 0.0
    runners = resident._runners
    assert sorted(runners) == sorted(spec[1].chunk_token_counts())
    assert sorted(r.completed for r in runners.values()) == [1, 4]
    assert all(r.eager for r in runners.values())
    resident.reset()  # the runners stay open across a reset
    assert _max_err(want[:2], resident.run(2)) == 0.0
    assert not any(r.closed for r in runners.values())
    resident.close()
    assert all(r.closed for r in runners.values())


def test_resident_needs_graphs():
    with pytest.raises(ValueError, match="needs use_graphs=True, got use_graphs=False"):
        Rollout("tiny", use_graphs=False, resident=True)


def test_lifecycle_errors():
    r = Rollout("tiny")
    with pytest.raises(ValueError, match="prefill"):
        r.step()
    r.prefill()
    with pytest.raises(ValueError, match="already prefilled"):
        r.prefill()
    with pytest.raises(ValueError, match="before prefill"):
        r.capture()
    with pytest.raises(ValueError, match="chunk lengths"):
        r.capture_request(r.geometry, 16)
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


class _Perturbed(ReferenceBackend):
    """The reference backend with a planted error in every cached attention."""

    def cached(self, q, cache, layer, block_size, scale, out):
        super().cached(q, cache, layer, block_size, scale, out)
        out.add_(1e-2)


def test_verify_rollout_catches_a_planted_error():
    report = verify_rollout("tiny", chunks=2, backend=_Perturbed())
    assert not report.ok
    assert report.max_attention_error == pytest.approx(1e-2, rel=1e-3)
    with pytest.raises(AssertionError, match="FAILED"):
        report.assert_ok()
    # A tolerance above the planted error lets it pass.
    assert verify_rollout("tiny", chunks=2, backend=_Perturbed(), tolerance=0.1).ok
