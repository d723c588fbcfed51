"""`StreamingVAEDecoder` on the GPU: the graphed chunk equals the eager one bit for bit
(fp32 and bf16, odd splits, row subsets of two sequences), a long stream replays a
fixed set of graphs, reset reproduces, and the frames stay within tolerance of
diffusers' own whole-video decode on the same GPU (bf16: no further from its fp32
decode than diffusers' bf16 decode is).

Bit for bit: a graph replays the very kernels the eager chunk program launches, with the
same arguments over the same shapes (cuDNN picks its algorithms by shape, deterministically
with benchmarking off), so nothing may differ. Against diffusers the post_quant_conv runs
over a chunk's frames rather than the whole video (a different shape, so possibly a
different cuDNN algorithm): fp32 with TF32 off within 1e-4; bf16 no further from the fp32
decode than diffusers' bf16 decode, give or take a bf16 step."""
from __future__ import annotations

import pytest
import torch

from coder_harness import (check_as_close_as, check_fresh_output, check_graphed_equal_eager,
                           check_long_stream, check_rows_graphed_equal_eager, chunked)
from framekv.engine.wan import StreamingVAEDecoder, build_vae

pytestmark = pytest.mark.gpu
H, W = 6, 10  # latent size
SPLITS = [(1, 2, 4), (3, 3, 1), (1,) * 7]


def latents(seed: int, B: int = 1, F: int = 7, stamp: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, 4, F, H, W, generator=g) + stamp).to("cuda")  # [B, C, F, H, W]


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_chunks_equal_eager_bit_for_bit_and_diffusers_within_tolerance(dtype):
    vae = build_vae("tiny", dtype=dtype, device="cuda", seed=1)
    graphed, eager = StreamingVAEDecoder(vae), StreamingVAEDecoder(vae, use_graphs=False)
    z = latents(0, B=2)
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1).to("cuda", dtype)
    inv_std = (1.0 / torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)).to("cuda", dtype)
    with torch.no_grad():
        ref = vae.decode(z.to(dtype) / inv_std + mean).sample  # WanPipeline's decode
        exact = build_vae("tiny", dtype=torch.float32, device="cuda", seed=1).decode(
            z / inv_std.float() + mean.float()).sample
    for split in SPLITS:
        a = check_graphed_equal_eager(graphed, eager, z, [split], ref.shape, dtype)
        assert a.shape == (2, 3, 25, 8 * H, 8 * W)
        if dtype == torch.float32:
            torch.testing.assert_close(a, ref, rtol=0, atol=1e-4)
        else:  # the fused program rounds once where diffusers' modules round five times:
            # no further from fp32 than the modules' own bf16 frames, give or take a step
            base = (ref.float() - exact).abs().max()
            assert (a.float() - exact).abs().max() <= base + 2 ** -6, split
    # first:1, first:3, steady:1, steady:2, steady:3, steady:4
    assert graphed.graph_count == 6 and eager.graph_count == 0


def test_row_subsets_of_two_sequences_graphed_equal_eager():
    vae = build_vae("tiny", dtype=torch.float32, device="cuda", seed=2)
    z = [latents(10 + s, F=6, stamp=0.5 * s) for s in range(2)]
    steps = [([1, 0], 0, 2), ([0], 2, 1), ([1], 2, 3), ([0], 3, 2), ([0, 1], 5, 1)]
    splits = {0: (2, 1, 2, 1), 1: (2, 3, 1)}  # each sequence's chunks in ``steps``
    got = check_rows_graphed_equal_eager(
        lambda g: StreamingVAEDecoder(vae, sequences=2, use_graphs=g), z, steps)
    for s in range(2):
        alone = chunked(StreamingVAEDecoder(vae, use_graphs=False), z[s], splits[s])
        torch.testing.assert_close(got[s], alone, rtol=0, atol=1e-4)


def test_a_long_stream_replays_a_fixed_set_of_graphs_and_reset_reproduces():
    vae = build_vae("tiny", device="cuda", seed=3)  # bf16
    zs = [latents(100 + i, F=3) for i in range(40)]
    check_long_stream(StreamingVAEDecoder(vae), zs, (1, 3, (H, W)))


def test_output_is_a_fresh_tensor_and_latents_must_be_on_the_device():
    vae = build_vae("tiny", device="cuda", seed=4)
    dec = StreamingVAEDecoder(vae)
    check_fresh_output(dec, latents(1, F=2), [latents(2, F=2), latents(3, F=2)])
    with pytest.raises(ValueError, match=r"on the decoder's device cuda:\d, got cpu"):
        dec.decode(latents(4, F=1).cpu())


def test_the_fused_13b_decoder_is_as_close_to_fp32_as_the_modules():
    """The 1.3B decoder in bf16 at a small size, fused and through diffusers' modules,
    against the modules in fp32: the fused frames no further from them than the
    modules' own bf16 frames, give or take a bf16 step; graphed equal to eager."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(2, 16, 4, 12, 20, generator=g).to("cuda")          # [B, C, F, H, W]
    exact = chunked(StreamingVAEDecoder(build_vae("1.3b", dtype=torch.float32, device="cuda"),
                                        fused=False, use_graphs=False), z, (1, 3)).float()
    vae = build_vae("1.3b", device="cuda")                             # bf16
    fused, eager = StreamingVAEDecoder(vae), StreamingVAEDecoder(vae, use_graphs=False)
    modules = StreamingVAEDecoder(vae, fused=False)
    got, plain = chunked(fused, z, (1, 3)), chunked(eager, z, (1, 3))
    assert torch.equal(got, plain)
    check_as_close_as(got, chunked(modules, z, (1, 3)), exact, 2 ** -7)
