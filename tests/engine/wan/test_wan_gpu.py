"""`WanRollout` on the GPU: the whole-chunk graph replays like eager bit for bit (window
filled, a prompt change mid-rollout, a reset), and the cuDNN backend stays within bf16
tolerance of the reference backend and of the model's own math (`wan_oracle`)."""
from __future__ import annotations

import pytest
import torch

from framekv.engine import WanRollout
from framekv.engine.wan import build_model
from wan_oracle import Oracle

pytestmark = pytest.mark.gpu
#: Small but cuDNN-shaped: head dim 64, 16 tokens per frame.
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=4,
              out_channels=4, text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2,
              cross_attn_norm=True, eps=1e-6, rope_max_seq_len=1024)
KW = dict(latent_size=(8, 8), frames_per_chunk=3, sink_frames=1, window_frames=5)


def prompt(seed: int) -> torch.Tensor:
    return torch.randn(1, 11, 32, generator=torch.Generator().manual_seed(seed))


def noise(i: int) -> torch.Tensor:
    return torch.randn(1, 4, 3, 8, 8, generator=torch.Generator().manual_seed(1000 + i))


def test_graph_replay_equals_eager_bit_for_bit_over_60_chunks():
    graphed = WanRollout(build_model(CONFIG, device="cuda", seed=1), **KW)
    eager = WanRollout(build_model(CONFIG, device="cuda", seed=1), use_graphs=False, **KW)
    for r in (graphed, eager):
        r.set_prompt(prompt(0))
    for i in range(60):
        if i == 25:                                      # a prompt change mid-rollout
            for r in (graphed, eager):
                r.set_prompt(prompt(1))
        if i == 45:                                      # and a reset
            for r in (graphed, eager):
                r.reset()
        a, b = graphed.step(noise(i)), eager.step(noise(i))
        assert torch.isfinite(a).all() and torch.equal(a, b), f"chunk {i}"
    assert graphed.graphs.stats().hits == 60 and len(graphed.graphs) == 1
    torch.cuda.synchronize()
    assert int(graphed.cache._open.seqs[0].counters[0]) == graphed.cache.committed_tokens


def test_cudnn_is_within_bf16_of_the_reference_backend_and_the_models_math():
    model = build_model(CONFIG, device="cuda", seed=2)
    oracle = Oracle(model, prompt(0).to("cuda", torch.bfloat16), tokens_per_frame=16,
                    frames_per_chunk=3, sink_frames=1, window_frames=5,
                    timesteps=(1000, 750, 500, 250))
    rollouts = {b: WanRollout(build_model(CONFIG, device="cuda", seed=2), backend=b,
                              use_graphs=False, **KW) for b in ("cudnn", "reference")}
    for r in rollouts.values():
        r.set_prompt(prompt(0))
    worst = {"cudnn vs reference": 0.0, "cudnn vs model": 0.0}
    for i in range(6):
        n = noise(i)
        got = {b: r.step(n) for b, r in rollouts.items()}
        want, _ = oracle.chunk(n.to("cuda"))
        scale = float(got["reference"].abs().max())
        worst["cudnn vs reference"] = max(worst["cudnn vs reference"], float(
            (got["cudnn"] - got["reference"]).abs().max()) / scale)
        worst["cudnn vs model"] = max(worst["cudnn vs model"], float(
            (got["cudnn"] - want.float()).abs().max()) / scale)
    print(f"relative max errors over 6 chunks: {worst}")
    assert worst["cudnn vs reference"] <= 5e-2 and worst["cudnn vs model"] <= 5e-2, worst


def test_guidance_through_graphs_equals_the_two_branches_within_bf16():
    """guidance_scale=5: both branches as two sequences of one pool, one graph replay per
    chunk, against each branch over its own rollout and prompt, combined in lockstep."""
    from wan_oracle import guidance_pair

    err = guidance_pair(lambda: build_model(CONFIG, device="cuda", seed=3), prompt(0), prompt(7),
                        g=5.0, chunks=10, latent_size=(8, 8), frames=3, sink=1, window=5,
                        timesteps=(1000, 750, 500, 250), use_graphs=True, noise=noise)
    print(f"guided (one pool, graphs) vs branches apart: max |diff| {err:.3e}")
    assert err <= 5e-2, err


def test_wan_streams_replay_like_eager_with_joins_and_a_recache():
    """Four streams on one pool stepped in batches of 2 and 4 (rows chosen per step,
    one stream restarted, one re-cached under a new prompt): the graph replays equal
    the same steps eager bit for bit, and the re-cached stream stays finite."""
    rs = [WanRollout(build_model(CONFIG, device="cuda", seed=3), sequences=4, batch_sizes=(2, 4),
                     prompt_tokens=11, use_graphs=g, **KW) for g in (True, False)]
    rs[0].capture()
    for r in rs:
        r.prefill_rows(range(4), prompt(0)[0])
    frames = [0, 0, 0, 0]
    for i in range(24):
        rows = [0, 1, 2, 3] if i % 3 else [(i // 3) % 4, (i // 3 + 2) % 4]
        nz = torch.cat([noise(10 * r_ + frames[r_]) for r_ in rows])
        f0 = torch.tensor([frames[r_] for r_ in rows])
        a, b = (r.step_rows(rows, nz, f0) for r in rs)
        assert torch.isfinite(a).all() and torch.equal(a, b), f"step {i}"
        for r_ in rows:
            frames[r_] += 3
        if i == 9:                                       # stream 1 restarts
            for r in rs:
                r.prefill_rows([1], prompt(2)[0])            # starts over
            frames[1] = 0
        if i == 15:                                      # stream 2 re-cached
            for r in rs:
                r.prefill_rows([2], prompt(3)[0], rewrite=True)
    assert rs[0].graphs.stats().hits == 24 and len(rs[0].graphs) == 2
