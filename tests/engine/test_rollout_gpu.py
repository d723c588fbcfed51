"""The reference model's rollout on a GPU: graph replay against eager bit for bit, and
the cuDNN backend against the fp32 exact-window reference within bf16 tolerance."""
from __future__ import annotations

import msgspec
import pytest
import torch

from framekv import specs
from framekv.engine.rollout import Rollout
from framekv.engine.verify import verify_rollout

pytestmark = pytest.mark.gpu

DEV = "cuda"
TINY = specs.load_preset("tiny")
# Head size 128, GQA and 32-token pages (the cuDNN kernels the large presets use) at a
# size that runs in seconds; windows of 6 frames so the window slides early.
WIDE = (msgspec.structs.replace(TINY.model, name="wide", num_layers=3, hidden_size=512,
                                num_heads=4, num_kv_heads=2, head_dim=128, ffn_size=1024,
                                latent_height=16, latent_width=16, tokens_per_page=32),
        msgspec.structs.replace(TINY.rollout, tokens_per_frame=64, frames_per_chunk=2,
                                window_frames=6, prompt_tokens=40, denoising_steps=3, chunks=10,
                                last_chunk_frames=1))


def steps_equal_eager(eager: Rollout, other: Rollout, chunks: int, what: str) -> None:
    """Prefill both rollouts, then ``chunks`` steps of each, equal bit for bit."""
    eager.prefill()
    other.prefill()
    for i in range(chunks):
        want, got = eager.step(), other.step()
        assert torch.isfinite(want).all(), f"chunk {i}: eager latents not finite"
        assert torch.equal(want, got), (f"chunk {i}: {what} differs from eager by "
                                        f"{(want - got).abs().max().item():.3g}")
    assert eager.cache.committed_tokens == other.cache.committed_tokens


@pytest.mark.parametrize("preset,chunks", [("tiny", 60), (WIDE, 52)], ids=["tiny", "wide"])
def test_graph_replay_equals_eager_bit_for_bit(preset, chunks):
    eager = Rollout(preset, DEV, use_graphs=False)
    graphed = Rollout(preset, DEV, use_graphs=True, model=eager.model)
    steps_equal_eager(eager, graphed, chunks, "replay")
    stats = graphed.graphs.stats()
    assert stats.hits == chunks and stats.graphs == len(graphed.spec.chunk_token_counts())
    eager.close()
    graphed.close()


@pytest.mark.parametrize("preset,chunks", [("tiny", 24), (WIDE, 20)], ids=["tiny", "wide"])
def test_a_reset_replays_the_same_rollout(preset, chunks):
    """After a reset (every sequence back at 0, the prompt kept) the graphs replay the
    same rollout again, bit for bit against eager."""
    eager = Rollout(preset, DEV, use_graphs=False)
    graphed = Rollout(preset, DEV, use_graphs=True, model=eager.model)
    first = [graphed.run(chunks)]
    graphed.reset()
    again = graphed.run(chunks)
    assert all(torch.equal(a, b) for a, b in zip(first[0], again))
    eager.prefill()
    assert all(torch.equal(eager.step(), b) for b in again)
    assert graphed.paths == {"graphs": chunks, "eager": 0}
    eager.close()
    graphed.close()


@pytest.mark.parametrize("preset", ["tiny", WIDE], ids=["tiny", "wide"])
def test_cudnn_attention_within_bf16_tolerance_of_the_fp32_reference(preset):
    report = verify_rollout(preset, chunks=8, device=DEV)
    print("\n" + report.format())
    assert report.backend == "cudnn" and report.dtype == "bfloat16" and not report.graphs_eager
    report.assert_ok()
    assert report.max_replay_error == 0.0  # graphs replay bit for bit


def test_cudnn_rollout_tracks_the_reference_backend_rollout():
    """Whole model, both backends: the latents stay close (relative L2 per chunk)."""
    ref = Rollout(WIDE, DEV, backend="reference", use_graphs=False)
    cud = Rollout(WIDE, DEV, use_graphs=True)
    ref.prefill()
    cud.prefill()
    worst = 0.0
    for i in range(12):
        a, b = ref.step(), cud.step()
        rel = ((a - b).norm() / a.norm()).item()
        worst = max(worst, rel)
    print(f"\nworst per-chunk relative L2 difference, cudnn vs reference backend: {worst:.2e}")
    assert worst < 2e-2
    ref.close()
    cud.close()
