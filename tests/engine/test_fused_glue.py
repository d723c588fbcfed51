"""The reference model's glue through framekv's ops (``glue="fused"``: `adaln_`,
`gated_residual_`, `qk_norm_rope_stage_` staged into the cache by `PagedKV`) against the
same model's torch glue, on the CPU in fp32 (the ops' references), with controls."""
from __future__ import annotations

import pytest
import torch

from framekv.engine import ForwardContext, Rollout
from framekv.engine.model import CausalVideoDiT
from framekv.specs import load_preset

TINY = load_preset("tiny")


def _err(a, b) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _latents(spec, B: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(B, spec.in_channels, 2, spec.latent_height, spec.latent_width,
                       generator=gen)


def _dense(f0):
    return ForwardContext(None, seq_len=None, frame0=f0)


def test_dense_forward_fused_equals_torch_glue():
    """No store: the prologue runs in place before dense attention (one sequence; the
    rollouts below batch sequences at different frames)."""
    m = CausalVideoDiT(TINY.model, prompt_tokens=0)
    x, t, f0 = _latents(TINY.model, 1, 1), torch.rand(1), torch.tensor([3])
    want = m(x, t, _dense(f0), glue="torch")
    got = m(x, t, _dense(f0), glue="fused")
    assert float((got - want).abs().max()) <= 1e-5
    assert float(want.abs().max()) > 1e-2  # a real signal


@pytest.mark.parametrize("sequences", [None, 2])
def test_rollout_with_staged_prologue_equals_torch_glue(sequences):
    """PagedKV stages the QK prologue (Q normed and rotated in place, K/V written by the
    fused op straight into the cache): chunks equal the torch glue's over a rollout, on
    one shared model."""
    fused = Rollout("tiny", use_graphs=False, sequences=sequences, glue="fused")
    torch_glue = Rollout("tiny", use_graphs=False, sequences=sequences, model=fused.model,
                         glue="torch")
    assert _err(fused.run(5), torch_glue.run(5)) <= 1e-5
    with pytest.raises(ValueError, match="glue must be one of 'fused', 'torch'"):
        Rollout("tiny", glue="inductor")


def test_recorder_sees_the_normed_rotated_k():
    """With a recorder the prologue runs in place (the packed K the recorder reads is
    the normed, rotated one), and the rollout is unchanged."""
    seen = []
    r = Rollout("tiny", use_graphs=False, glue="fused")
    want = Rollout("tiny", use_graphs=False, model=r.model, glue="fused").run(2)
    r.attention_recorder = lambda layer, qkv, out, T, b: seen.append(qkv.clone())
    got = r.run(2)
    assert _err(got, want) <= 1e-6 and seen
    H = TINY.model.num_heads
    k = seen[-1][0, :, H:H + TINY.model.num_kv_heads]                     # [S, Hkv, D]
    ms = k.pow(2).mean(-1)  # RMS-normed rows times the k_norm weight: not raw projections
    assert float(ms.max()) < 10.0


def test_a_wrong_rope_offset_breaks_the_equality():
    """Control: the fused rope one token off is another rotation (a whole frame off
    would not be: attention over the forward's own tokens sees only relative
    positions, and a frame shift moves them all alike)."""
    m = CausalVideoDiT(TINY.model, prompt_tokens=0)
    m.glue = "fused"
    x, t, f0 = _latents(TINY.model, 1, 2), torch.rand(1), torch.tensor([4])
    want = m(x, t, _dense(f0))
    grid = m.rope.grid
    m.rope.grid = lambda frame0, offset=0: grid(frame0, offset + 1)
    try:
        assert float((m(x, t, _dense(f0)) - want).abs().max()) > 1e-3
    finally:
        m.rope.grid = grid
