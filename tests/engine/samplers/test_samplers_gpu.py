"""Samplers inside the captured chunk on the GPU: a `WanRollout` sampled by self_forcing
(its fresh noise a static input) or by the toy sampler of tests/engine/samplers/test_samplers.py
(registered here: a suffix of its schedule, a start of its own, its own static input)
replays its whole-chunk graph like eager bit for bit, and the two are different
chunks (the sampler's work is in the graph)."""
from __future__ import annotations

import pytest
import torch

from framekv.engine import WanRollout
from framekv.engine.samplers import register_sampler, unregister_sampler
from framekv.engine.wan import build_model
from test_samplers import ToySampler

pytestmark = pytest.mark.gpu
#: Small but cuDNN-shaped: head dim 64, 16 tokens per frame.
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=4,
              out_channels=4, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2,
              cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024)
KW = dict(latent_size=(8, 8), frames_per_chunk=3, sink_frames=1, window_frames=5,
          timesteps=(1000, 750, 500, 250))


@pytest.fixture
def toy():
    register_sampler("toy", ToySampler)
    yield "toy"
    unregister_sampler("toy")


def rollouts(**kw) -> tuple[WanRollout, WanRollout]:
    graphed = WanRollout(build_model(CONFIG, device="cuda", seed=1), **KW, **kw)
    eager = WanRollout(build_model(CONFIG, device="cuda", seed=1), use_graphs=False, **KW, **kw)
    text = torch.randn(1, 11, 32, generator=torch.Generator().manual_seed(0))
    for r in (graphed, eager):
        r.set_prompt(text)
    return graphed, eager


@pytest.mark.parametrize("sampler, options, program", [
    ("self_forcing", None, "chunk[self_forcing]:4x48+clean48+commit"),
    ("toy", {"eta": 0.5, "skip": 1}, "chunk[toy(eta=0.5,skip=1)]:3x48+clean48+commit")])
def test_a_samplers_chunk_graph_replays_as_it_runs_eagerly(toy, sampler, options, program):
    graphed, eager = rollouts(sampler=sampler, sampler_options=options)
    euler, _ = rollouts()
    for i in range(8):
        a, b = graphed.step(), eager.step()               # each row's own inputs, drawn
        assert torch.isfinite(a).all() and torch.equal(a, b), f"chunk {i}"
        assert not torch.equal(a, euler.step())
    assert graphed.graphs.stats().hits == 8 and graphed.graphs.keys()[0].program == program
