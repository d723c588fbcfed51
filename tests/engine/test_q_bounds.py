"""The |q| bound that lets the fused staging quantize Q for fp8 attention: it holds for
the op's norm and rope, it is tight, and the chunk runner declares it to a backend that
takes it."""
from __future__ import annotations

import pytest
import torch

from cudnn_fake import FakeCudnnBackend
from framekv import ops
from framekv.engine.rollout import Rollout


class DenseOnCpu(FakeCudnnBackend):
    """The fake cuDNN backend with the prompt's dense attention in plain torch."""

    def dense(self, q, k, v, scale):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(
            qt, kt, vt, scale=scale, enable_gqa=kt.shape[1] != qt.shape[1])
        return o.transpose(1, 2)


@pytest.mark.parametrize("norm", ["head", "all"])
def test_bound_holds_after_norm_and_rope_and_is_reached(norm):
    H, D, S = 3, 16, 40
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(1, S, 3 * H, D, generator=g) * 5
    qkv[0, 0, :H] = 0
    qkv[0, 0, 0, 0] = 7.0                        # one value holds all of the row's energy
    n = D if norm == "head" else H * D
    qw = torch.rand(n, generator=g) + 0.5
    qw[0] = 3.0                                  # the largest weight, on that value
    kw = torch.ones(n)
    rope = ops.RopeGrid(inv_freq=1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64) / D)),
                        frame0=torch.zeros(1, dtype=torch.int64), grid=(2, 4), axes=(D // 2, 0, 0),
                        token_offset=0, style="interleaved")
    ops.qk_norm_rope_stage_(qkv, q_weight=qw, k_weight=kw, num_heads=H, num_kv_heads=H,
                            norm=norm, eps=1e-6, rope=rope)
    bound = ops.q_bound(qw, norm, D)
    top = qkv[0, :, :H].abs().max().item()
    assert top <= bound
    assert top >= 0.99 * bound / (1 + 2.0 ** -8)   # token 0 at rope angle 0 reaches it


def test_bound_names_a_bad_norm():
    with pytest.raises(ValueError, match="norm: expected one of"):
        ops.q_bound(torch.ones(4), "rms", 4)


@pytest.mark.parametrize("glue", ["fused", "torch"])
def test_runner_declares_bounds_for_an_fp8_pool(glue):
    backend = DenseOnCpu()
    r = Rollout("tiny", "cpu", backend=backend, kv_dtype="fp8", use_graphs=False, glue=glue)
    state = backend.q_state(r.cache)
    want = [ops.q_bound(b.q_norm.weight, "head", r.model_spec.head_dim) for b in r.model.blocks]
    if glue == "torch":                          # no staging pass: the plan quantizes Q
        assert not any(state.known)
    else:
        assert all(state.known)
        torch.testing.assert_close(state.bound, torch.tensor(want))
    assert backend.q_saturated(r.cache) == [0] * len(want)
    r.close()


def test_runner_leaves_a_bf16_pool_alone():
    backend = DenseOnCpu()
    r = Rollout("tiny", "cpu", backend=backend, use_graphs=False)
    assert backend._q_states == {}
    r.close()
