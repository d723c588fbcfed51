"""The video-to-video sampler (`framekv.engine.samplers.VideoToVideoSampler`, ``v2v``):
a chunk from its input latents noised to part way, then the base sampler's remaining
steps. Checked against the arithmetic written out over the runner's own forwards
(fp32), at strength 1 against text to video bit for bit, with inputs stamped per chunk
and per stream so a mix-up fails, and its refusals.
"""
from __future__ import annotations

import pytest
import torch

from framekv.engine.rollout import Rollout
from framekv.engine.samplers import build_sampler
from framekv.engine.samplers.v2v import first_step
from framekv.engine.step import StepPlan, chunk_noise, chunk_renoise, sampler_inputs
from test_samplers import by_hand, specs

SCHEDULE = (1000.0, 750.0, 500.0, 250.0)


def v2v(base: str, strength: float, **kw) -> dict:
    return dict(sampler="v2v", sampler_options={"base": base, "strength": strength}, **kw)


def stamped(shape, stream: int, index: int) -> torch.Tensor:
    """Input latents that say which stream and chunk they are: a mix-up shows."""
    g = torch.Generator().manual_seed(1000 * stream + index)
    return torch.randn(*shape, generator=g) + stream + 0.1 * index


@pytest.mark.parametrize("strength, run", [
    (1.0, SCHEDULE), (0.9, SCHEDULE[1:]), (0.75, SCHEDULE[1:]), (0.6, SCHEDULE[2:]),
    (0.5, SCHEDULE[2:]), (0.25, SCHEDULE[3:])])
def test_strength_picks_the_first_step_at_or_below_it(strength, run):
    s = build_sampler("v2v", SCHEDULE, 1000.0, {"base": "euler", "strength": strength})
    assert s.timesteps == run and s.sigmas == tuple(t / 1000 for t in run) + (0.0,)
    assert s.options == {"base": "euler", "strength": strength}


@pytest.mark.parametrize("strength, words", [
    (0.0, r"strength must be a number in \(0, 1\]"), (1.5, "in \\(0, 1\\]"),
    (float("nan"), "in \\(0, 1\\]"), (True, "got True"), ("0.5", "got '0.5'"),
    (0.2, r"strength 0.2 runs none of the steps .* at least 0.25")])
def test_a_bad_strength_is_named(strength, words):
    with pytest.raises(ValueError, match=words):
        first_step(SCHEDULE, 1000.0, strength)
    with pytest.raises(ValueError, match="strength"):
        build_sampler("v2v", SCHEDULE, 1000.0, {"base": "euler", "strength": strength})


def test_a_base_must_be_a_plain_sampler_and_a_source_the_chunks_input():
    with pytest.raises(ValueError, match="base must be one of 'euler', 'self_forcing', got 'v2v'"):
        build_sampler("v2v", SCHEDULE, 1000.0, {"base": "v2v", "strength": 0.5})
    s = build_sampler("v2v", SCHEDULE, 1000.0, {"base": "euler", "strength": 0.5})
    shape = (4, 2, 8, 8)
    with pytest.raises(ValueError, match=r"source must be the chunk's input latents \[4, 2, 8, "
                                         r"8\] at strength 0.5 < 1, got None"):
        s.row_inputs(0, 0, shape)
    with pytest.raises(ValueError, match=r"input latents \[4, 2, 8, 8\], got \[4, 1, 8, 8\]"):
        s.row_inputs(0, 0, shape, source=torch.zeros(4, 1, 8, 8))
    full = build_sampler("v2v", SCHEDULE, 1000.0, {"base": "self_forcing", "strength": 1.0})
    got = full.row_inputs(3, 1, shape)                   # the input is not read at 1
    assert not got["video"].any() and torch.equal(got["renoise"],
                                                  chunk_renoise(3, 1, 4, shape))


@pytest.mark.parametrize("base", ["euler", "self_forcing"])
def test_strength_one_is_text_to_video_bit_for_bit(base):
    t2v = Rollout("tiny", "cpu", sampler=base)
    full = Rollout("tiny", "cpu", model=t2v.model, **v2v(base, 1.0))
    for r in (t2v, full):
        r.prefill()
    for i in range(3):
        video = stamped(t2v.chunk_shape, 0, i)[None]
        noise = chunk_noise(t2v.seed, i, t2v.chunk_shape)[None]
        inputs = sampler_inputs(full.sampling, [(full.seed, i)], full.chunk_shape,
                                sources=[video[0]])
        assert torch.equal(t2v.step(), full.step(noise, inputs)), i
    assert full.paths["graphs"] == 3 and "v2v(base=" in full.graphs.keys()[0].program


@pytest.mark.parametrize("base", ["euler", "self_forcing"])
def test_a_chunk_is_its_input_noised_then_the_remaining_steps(base):
    spec = specs(denoising_steps=4)
    r = Rollout(spec, "cpu", **v2v(base, 0.6))           # steps from t = 0.5: two of four
    ref = Rollout(spec, "cpu", use_graphs=False, model=r.model)
    for x in (r, ref):
        x.prefill()
    assert r.sigmas == [0.5, 0.25, 0.0]
    for i in range(3):
        video = stamped(r.chunk_shape, 0, i)[None]
        noise = chunk_noise(r.seed, i, r.chunk_shape)[None]
        inputs = sampler_inputs(r.sampling, [(r.seed, i)], r.chunk_shape, sources=[video[0]])
        e = chunk_renoise(r.seed, i, 2, r.chunk_shape)[None]

        def step(x, v, k):
            if base == "euler":
                return x + ([0.5, 0.25, 0.0][k + 1] - [0.5, 0.25][k]) * v
            x = x - [0.5, 0.25][k] * v
            return 0.75 * x + 0.25 * e[:, 0] if k == 0 else x
        want = by_hand(ref, 0.5 * video + 0.5 * noise, [0.5, 0.25], step)
        got = r.step(noise, inputs)
        assert float((got - want).abs().max()) <= 1e-6, i
        moved = r.sampling.start(noise, {"video": video + 1.0})    # the input is read
        assert torch.allclose(moved - r.sampling.start(noise, inputs), torch.full_like(noise, 0.5))


def test_the_same_input_seed_and_strength_give_the_same_chunks_per_stream():
    """Two streams batched, each its own seed and input; each equals itself run alone,
    and a stream's input latents land in its own row."""
    both = Rollout("tiny", "cpu", sequences=2, **v2v("self_forcing", 0.75))
    alone = Rollout("tiny", "cpu", model=both.model, **v2v("self_forcing", 0.75))
    for r in (both, alone):
        r.prefill()
    shape, seeds = both.chunk_shape, (5, 6)
    for i in range(2):
        plan = StepPlan(rows=[0, 1], keys=[(s, i) for s in seeds],
                        sources=[stamped(shape, k, i) for k in (0, 1)])
        plan.draw_noise(shape, both.sampling)
        out = both.step(plan.noise, plan.inputs)
        inputs = sampler_inputs(alone.sampling, [(seeds[0], i)], shape,
                                sources=[stamped(shape, 0, i)])
        assert torch.equal(out[:1], alone.step(chunk_noise(seeds[0], i, shape)[None], inputs)), i
        assert torch.equal(plan.inputs["video"][1], stamped(shape, 1, i))
