"""`StreamingVAEEncoder` on the GPU: graphed chunks equal eager ones bit for bit (fp32 and
bf16, fused and through diffusers' modules, several cuts, row subsets of two
sequences), a long stream replays a fixed set of graphs, reset reproduces, and the
latents stay within tolerance of diffusers' own whole-video encode on the same GPU; the
1.3B encoder in bf16 at 480 x 832, two rows, fused and graphed, no further from the
fp32 encode than diffusers' modules in bf16 are.

Why graphed equals eager, and why fp32 is held to 1e-4 (TF32 off): test_vae_gpu.py's
doc. Here the fused program runs a chunk's frames at once where diffusers runs groups
of 4: other shapes, so possibly other cuDNN algorithms."""
from __future__ import annotations

import pytest
import torch

from coder_harness import (check_as_close_as, check_fresh_output, check_graphed_equal_eager,
                           check_long_stream, check_rows_graphed_equal_eager, chunked)
from framekv.engine.wan import StreamingVAEEncoder, build_vae
from test_vae_gpu import no_tf32  # noqa: F401  (autouse: TF32 off)

pytestmark = pytest.mark.gpu
H, W = 48, 80  # frame size: latents 6 x 10
CUTS = [(1, 4, 12), (5, 8, 4), (9, 8), (17,)]


def frames(seed: int, B: int = 1, F: int = 17, size=(H, W), stamp: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(B, 3, F, *size, generator=g) * 2 - 1) * 0.8 + stamp
    return x.to("cuda")                                                # [B, 3, F, H, W]


@torch.no_grad()
def whole(vae, x: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """diffusers' whole-video encode, normalised as WanVideoToVideoPipeline does (in ``dtype``)."""
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to("cuda", dtype)
    inv_std = (1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)).to("cuda", dtype)
    return (vae.encode(x.to(vae.dtype)).latent_dist.mode().to(dtype) - mean) * inv_std


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_chunks_equal_eager_bit_for_bit_and_diffusers_within_tolerance(dtype, fused):
    vae = build_vae("tiny", dtype=dtype, device="cuda", seed=1)
    graphed = StreamingVAEEncoder(vae, fused=fused)
    eager = StreamingVAEEncoder(vae, fused=fused, use_graphs=False)
    x = frames(0, B=2)
    ref = whole(vae, x, dtype)
    exact = whole(build_vae("tiny", dtype=torch.float32, device="cuda", seed=1), x)
    assert ref.shape == (2, 4, 5, H // 8, W // 8)
    for cut in CUTS:
        a = check_graphed_equal_eager(graphed, eager, x, [cut], ref.shape, dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(a, ref, rtol=0, atol=1e-4)
        else:  # no further from fp32 than diffusers' own bf16 latents, give or take a step
            assert (a.float() - exact).abs().max() <= (ref.float() - exact).abs().max() + 2 ** -6
    # first: 1, 5, 9, 17 frames; steady: 4, 12, 8
    assert graphed.graph_count == 7 and eager.graph_count == 0


def test_row_subsets_of_two_sequences_graphed_equal_eager():
    vae = build_vae("tiny", dtype=torch.float32, device="cuda", seed=2)
    x = [frames(10 + s, F=17, stamp=0.15 * s) for s in range(2)]
    make = (lambda g: StreamingVAEEncoder(vae, sequences=2, use_graphs=g))
    got = check_rows_graphed_equal_eager(make, x, [([1, 0], 0, 5), ([0], 5, 4), ([1], 5, 8),
                                                   ([0], 9, 4), ([0, 1], 13, 4)])
    for s in range(2):
        torch.testing.assert_close(got[s], whole(vae, x[s]), rtol=0, atol=1e-4)


def test_a_long_stream_replays_a_fixed_set_of_graphs_and_reset_reproduces():
    vae = build_vae("tiny", device="cuda", seed=3)  # bf16
    xs = [frames(100, F=9)] + [frames(100 + i, F=12) for i in range(1, 40)]
    first = check_long_stream(StreamingVAEEncoder(vae), xs, (1, 3, (H, W)))
    assert all(o.shape[2] == 3 for o in first)


def test_output_is_a_fresh_tensor_and_frames_must_be_on_the_device():
    enc = StreamingVAEEncoder(build_vae("tiny", device="cuda", seed=4))
    check_fresh_output(enc, frames(1, F=5), [frames(2, F=4), frames(3, F=4)])
    with pytest.raises(ValueError, match=r"on the encoder's device cuda:\d, got cpu"):
        enc.encode(frames(4, F=4).cpu())


def test_the_fused_13b_encoder_at_480x832_is_as_close_to_fp32_as_the_modules():
    """The 1.3B encoder in bf16 at 480 x 832, two rows, a first chunk of 9 frames then
    one of 12: fused and graphed equal to eager bit for bit; against diffusers' fp32
    whole-video encode no further than the modules in bf16 (WanVideoToVideoPipeline's
    bf16 latents), give or take a bf16 step of the latents' scale."""
    x = frames(5, B=2, F=21, size=(480, 832))
    exact = whole(build_vae("1.3b", dtype=torch.float32, device="cuda"), x)
    vae = build_vae("1.3b", device="cuda")                             # bf16
    fused, eager = StreamingVAEEncoder(vae), StreamingVAEEncoder(vae, use_graphs=False)
    modules = StreamingVAEEncoder(vae, fused=False, use_graphs=False)
    got, plain = chunked(fused, x, (9, 12)), chunked(eager, x, (9, 12))
    assert got.shape == exact.shape == (2, 16, 6, 60, 104) and torch.equal(got, plain)
    check_as_close_as(got, chunked(modules, x, (9, 12)), exact, 2 ** -7 * float(exact.abs().max()))
