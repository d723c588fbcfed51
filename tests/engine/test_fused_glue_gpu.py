"""The fused glue on the GPU: the cuBLASLt bias + GELU epilogue is GELU-tanh; the
reference model and `WanRollout` with ``glue="fused"`` replay their whole-chunk graphs
bit for bit against eager and stay within bf16 tolerance of ``glue="torch"`` over a
rollout, the QK prologue staged by the paged cache."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framekv.engine.model.blocks import linear_gelu
from framekv.engine.rollout import Rollout
from test_rollout_gpu import WIDE

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_gelu_epilogue_is_gelu_tanh(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    fc = torch.nn.Linear(256, 512, device="cuda", dtype=dtype)
    x = torch.randn(2, 100, 256, device="cuda", generator=g).to(dtype)
    got = linear_gelu(fc, x).float()
    lin = F.linear(x.float(), fc.weight.float(), fc.bias.float())
    tanh, erf = F.gelu(lin, approximate="tanh"), F.gelu(lin)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert got.shape == (2, 100, 512)
    assert float((got - tanh).abs().max()) <= tol * max(1.0, float(tanh.abs().max()))
    if dtype == torch.float32:  # control: the erf form is measurably elsewhere
        assert float((got - erf).abs().max()) > 10 * float((got - tanh).abs().max())


@pytest.mark.parametrize("sequences", [None, 2])
def test_fused_glue_replays_like_eager_and_is_within_bf16_of_the_torch_glue(sequences):
    graphed = Rollout(WIDE, "cuda", use_graphs=True, sequences=sequences, glue="fused")
    eager = Rollout(WIDE, "cuda", use_graphs=False, sequences=sequences, model=graphed.model,
                    glue="fused")
    plain = Rollout(WIDE, "cuda", use_graphs=False, sequences=sequences, model=graphed.model,
                    glue="torch")
    for r in (graphed, eager, plain):
        r.prefill()
    worst = 0.0
    for i in range(24):
        a, b, c = graphed.step(), eager.step(), plain.step()
        assert torch.isfinite(a).all() and torch.equal(a, b), f"chunk {i}"
        worst = max(worst, float((a - c).abs().max()) / max(1.0, float(c.abs().max())))
    assert worst <= 5e-2, worst
    assert graphed.paths["graphs"] == 24


def test_wan_fused_glue_replays_like_eager_and_is_within_bf16_of_the_torch_glue():
    from framekv.engine import WanRollout
    from framekv.engine.wan import build_model
    from test_wan_gpu import CONFIG, KW, noise, prompt

    rs = {name: WanRollout(build_model(CONFIG, device="cuda", seed=4), use_graphs=g,
                           glue=glue, **KW)
          for name, g, glue in (("graphs", True, "fused"), ("eager", False, "fused"),
                                ("torch", False, "torch"))}
    for r in rs.values():
        r.set_prompt(prompt(0))
    worst = 0.0
    for i in range(20):
        out = {name: r.step(noise(i)) for name, r in rs.items()}
        assert torch.isfinite(out["graphs"]).all() and torch.equal(out["graphs"], out["eager"])
        ref = out["torch"]
        worst = max(worst, float((out["graphs"] - ref).abs().max()) / max(1.0, float(ref.abs().max())))
    assert worst <= 5e-2, worst
