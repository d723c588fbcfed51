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

from framekv.engine.wan import StreamingVAEDecoder, build_vae

pytestmark = pytest.mark.gpu
H, W = 6, 10  # latent size
SPLITS = [(1, 2, 4), (3, 3, 1), (1,) * 7]


def latents(seed: int, B: int = 1, F: int = 7, stamp: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, 4, F, H, W, generator=g) + stamp).to("cuda")  # [B, C, F, H, W]


def chunked(dec, z: torch.Tensor, split, rows=None) -> torch.Tensor:
    outs, f0 = [], 0
    for f in split:
        outs.append(dec.decode(z[:, :, f0:f0 + f], rows))
        f0 += f
    return torch.cat(outs, dim=2)


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_chunks_equal_eager_bit_for_bit_and_diffusers_within_tolerance(dtype):
    vae = build_vae("tiny", dtype=dtype, device="cuda", seed=1)
    graphed, eager = StreamingVAEDecoder(vae), StreamingVAEDecoder(vae, use_graphs=False)
    assert graphed.use_graphs and not eager.use_graphs
    z = latents(0, B=2)
    mean = torch.tensor(vae.config.latents_mean).view(1, 4, 1, 1, 1).to("cuda", dtype)
    inv_std = (1.0 / torch.tensor(vae.config.latents_std).view(1, 4, 1, 1, 1)).to("cuda", dtype)
    with torch.no_grad():
        ref = vae.decode(z.to(dtype) / inv_std + mean).sample  # WanPipeline's decode
        exact = build_vae("tiny", dtype=torch.float32, device="cuda", seed=1).decode(
            z / inv_std.float() + mean.float()).sample
    for split in SPLITS:
        graphed.reset()
        eager.reset()
        a, b = chunked(graphed, z, split), chunked(eager, z, split)
        assert a.dtype == dtype and a.shape == ref.shape == (2, 3, 25, 8 * H, 8 * W)
        assert torch.isfinite(a).all() and torch.equal(a, b), split
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
    graphed = StreamingVAEDecoder(vae, sequences=2)
    eager = StreamingVAEDecoder(vae, sequences=2, use_graphs=False)
    z = [latents(10 + s, F=6, stamp=0.5 * s) for s in range(2)]
    calls = [([1, 0], 0, 2), ([0], 2, 1), ([1], 2, 3), ([0], 3, 2), ([0, 1], 5, 1)]
    splits = {0: (2, 1, 2, 1), 1: (2, 3, 1)}  # each sequence's chunks in ``calls``
    got = {d: {0: [], 1: []} for d in ("graphed", "eager")}
    for rows, f0, f in calls:
        for name, dec in (("graphed", graphed), ("eager", eager)):
            out = dec.decode(torch.cat([z[s][:, :, f0:f0 + f] for s in rows]), rows)
            for i, s in enumerate(rows):
                got[name][s].append(out[i:i + 1])
    assert graphed.state == eager.state == (6, 6)
    for s in range(2):
        a, b = torch.cat(got["graphed"][s], 2), torch.cat(got["eager"][s], 2)
        assert torch.equal(a, b), s
        alone = chunked(StreamingVAEDecoder(vae, use_graphs=False), z[s], splits[s])
        torch.testing.assert_close(a, alone, rtol=0, atol=1e-4)


def test_a_long_stream_replays_a_fixed_set_of_graphs_and_reset_reproduces():
    vae = build_vae("tiny", device="cuda", seed=3)  # bf16
    dec = StreamingVAEDecoder(vae)
    assert dec.capture(1, 3, (H, W)) == 2 and dec.graph_count == 2 and dec.state == (0,)
    assert dec.capture(1, 3, (H, W)) == 0
    zs = [latents(100 + i, F=3) for i in range(40)]
    first = [dec.decode(z) for z in zs]
    stats = dec._graphs.stats()
    assert dec.graph_count == 2 and stats.captures == 2 and stats.hits == 40
    assert dec.frames_decoded(0) == 120
    dec.reset()
    again = [dec.decode(z) for z in zs[:5]]
    assert all(torch.equal(a, b) for a, b in zip(again, first))
    assert dec.graph_count == 2
    assert dec.arena_bytes > 0 and dec.arena_bytes % (2 << 20) == 0  # the arena's chunks
    dec.close()
    assert dec.arena_bytes == 0 and dec.graph_count == 0


def test_output_is_a_fresh_tensor_and_latents_must_be_on_the_device():
    vae = build_vae("tiny", device="cuda", seed=4)
    dec = StreamingVAEDecoder(vae)
    a = dec.decode(latents(1, F=2))
    keep = a.clone()
    dec.decode(latents(2, F=2))  # replays the steady graph; ``a`` must not change
    assert torch.equal(a, keep)
    with pytest.raises(ValueError, match=r"on the decoder's device cuda:\d, got cpu"):
        dec.decode(latents(3, F=1).cpu())


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
    ref = chunked(modules, z, (1, 3)).float()
    assert torch.equal(got, plain)
    err, base = (got.float() - exact).abs(), (ref - exact).abs()
    assert err.max() <= base.max() + 2 ** -7, (float(err.max()), float(base.max()))
    assert err.mean() <= 1.5 * base.mean(), (float(err.mean()), float(base.mean()))
