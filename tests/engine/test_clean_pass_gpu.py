"""The clean pass kept for its K/V only, on a GPU: cuDNN, bf16, graph replay. Latents
bit for bit those of the whole clean pass, eager and replayed, for both models; the
last layer's cuDNN attention is not launched in a clean pass."""
from __future__ import annotations

import pytest
import torch

from framekv.engine import WanRollout
from framekv.engine.attention.cudnn import CudnnPlan
from framekv.engine.rollout import Rollout
from framekv.engine.wan import build_model
from test_rollout_gpu import WIDE
from test_wan_gpu import CONFIG, KW, noise, prompt

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _steps(r, chunks):
    r.prefill()
    return [r.step() for _ in range(chunks)]


@pytest.mark.parametrize("use_graphs", [False, True], ids=["eager", "graphs"])
def test_reference_trimmed_clean_pass_is_the_whole_one_bit_for_bit(use_graphs):
    trimmed = Rollout(WIDE, DEV, use_graphs=use_graphs)
    got = _steps(trimmed, 12)
    want = _steps(Rollout(WIDE, DEV, use_graphs=use_graphs, model=trimmed.model,
                          trim_clean_pass=False), 12)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"chunk {i}"


def _launches(monkeypatch):
    """Spy on the cuDNN plans' launches: [layer]."""
    seen, run = [], CudnnPlan.run

    def spy(self, q, layer, out):
        seen.append(layer)
        return run(self, q, layer, out)
    monkeypatch.setattr(CudnnPlan, "run", spy)
    return seen


@pytest.mark.parametrize("model", ["reference", "wan"])
def test_clean_pass_launches_no_last_layer_attention(model, monkeypatch):
    if model == "reference":
        r = Rollout(WIDE, DEV, use_graphs=False)
        r.prefill()
        step, L, steps = r.step, len(r.model.blocks), r.spec.denoising_steps
    else:
        r = WanRollout(build_model(CONFIG, device=DEV, seed=1), use_graphs=False, **KW)
        r.set_prompt(prompt(0))
        step, L, steps = (lambda: r.step(noise(0))), CONFIG["num_layers"], len(r._t)
    assert getattr(r.backend, "name", r.backend) == "cudnn"
    step()
    seen = _launches(monkeypatch)
    step()
    assert seen == list(range(L)) * steps + list(range(L - 1))


@pytest.mark.parametrize("use_graphs", [False, True], ids=["eager", "graphs"])
def test_wan_trimmed_clean_pass_is_the_whole_one_bit_for_bit(use_graphs):
    m = build_model(CONFIG, device=DEV, seed=1)

    def chunks(r):
        r.set_prompt(prompt(0))
        return [r.step(noise(i)) for i in range(10)]

    got = chunks(WanRollout(m, use_graphs=use_graphs, **KW))
    want = chunks(WanRollout(m, use_graphs=use_graphs, trim_clean_pass=False, **KW))
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.isfinite(a).all() and torch.equal(a, b), f"chunk {i}"
