"""diffusers' Wan transformer rolled out through framekv, on the CPU (fp32): every step of
every chunk equals the model's own math over the whole sequence with a dense mask
(`wan_oracle.Oracle`), and the controls that should break that equality do."""
from __future__ import annotations

import pytest
import torch

from framekv.engine import WanRollout
from framekv.engine.wan import CONFIGS, build_model
from wan_oracle import Oracle

TS = (1000, 750, 500, 250)
TEXT = torch.randn(1, 7, CONFIGS["tiny"]["text_dim"], generator=torch.Generator().manual_seed(9))


def model(fused=False, seed=0):
    m = build_model("tiny", seed=seed)
    if fused:
        m.fuse_qkv_projections()
    return m


def run_pair(m, *, sink, window, frames, clean_block="chunk", chunks=6, oracle_kw=None,
             rollout_kw=None):
    """(max |framekv - oracle| over every step's velocity and every chunk's latents)."""
    oracle = Oracle(m, TEXT, tokens_per_frame=4, frames_per_chunk=frames, sink_frames=sink,
                    window_frames=window, timesteps=TS, clean_block=clean_block,
                    **(oracle_kw or {}))
    kw = dict(latent_size=(4, 4), frames_per_chunk=frames, sink_frames=sink,
              window_frames=window, timesteps=TS, clean_block=clean_block, use_graphs=False)
    r = WanRollout(m, **{**kw, **(rollout_kw or {})})
    r.set_prompt(TEXT)
    seen = []
    r.recorder = lambda label, v: seen.append((label, None if v is None else v.float()))
    gen, worst = torch.Generator().manual_seed(1), 0.0
    for _ in range(chunks):
        noise = torch.randn(1, 4, frames, 4, 4, generator=gen)
        seen.clear()
        got = r.step(noise)
        want, vs = oracle.chunk(noise)
        steps = [v for label, v in seen if label != "clean"]
        assert [label for label, _ in seen] == [f"step {i}" for i in range(len(TS))] + ["clean"]
        worst = max(worst, float((got - want).abs().max()),
                    *(float((a - b).abs().max()) for a, b in zip(steps, vs, strict=True)))
    return worst


@pytest.mark.parametrize("fused", [False, True], ids=["qkv", "fused-qkv"])
@pytest.mark.parametrize("clean_block", ["chunk", "frame"])
@pytest.mark.parametrize("sink, window, frames", [(1, 3, 2), (2, 2, 1), (0, 4, 3), (1, 1, 2)])
def test_every_step_equals_the_models_own_math(sink, window, frames, clean_block, fused):
    err = run_pair(model(fused), sink=sink, window=window, frames=frames, clean_block=clean_block)
    assert err <= 1e-5, err


@pytest.mark.parametrize("fused", [False, True], ids=["qkv", "fused-qkv"])
@pytest.mark.parametrize("clean_block", ["chunk", "frame"])
@pytest.mark.parametrize("sink, window, frames", [(1, 3, 2), (0, 4, 3)])
def test_the_fused_glue_is_the_same_math(sink, window, frames, clean_block, fused):
    """``glue="fused"``: the blocks' glue, QK norm and rope through framekv's ops (their
    references here), the QK prologue staged by the paged store."""
    err = run_pair(model(fused), sink=sink, window=window, frames=frames,
                   clean_block=clean_block, rollout_kw={"glue": "fused"})
    assert err <= 1e-5, err


@pytest.mark.parametrize("sink, window, frames", [(1, 3, 2), (3, 2, 1), (0, 4, 3)])
def test_the_dense_rolling_baseline_is_the_same_math(sink, window, frames):
    """The Self-Forcing-style store (dense per-layer K/V rolled by copying) under the
    same processors: the oracle's math too, the sink filled by the first chunks."""
    from framekv.bench.dense import DenseRollingKV
    from framekv.engine.wan import WanShape

    m = model()
    g = WanShape.of(m, (4, 4), frames, sink, window).geometry()
    dense = DenseRollingKV(g, num_layers=2, num_kv_heads=2, head_dim=12)
    err = run_pair(m, sink=sink, window=window, frames=frames, rollout_kw={"kv": dense})
    assert err <= 1e-5, err


def test_controls_that_break_the_contract_fail():
    ok = run_pair(model(), sink=1, window=2, frames=2)
    assert ok <= 1e-5
    # The rope started at frame 0 every chunk (no absolute positions).
    m = model()
    r_kw = {}
    err_rope = _with_frozen_rope(m, r_kw)
    # The wrong clean block: framekv cleans frame by frame, the oracle by chunk.
    err_clean = run_pair(model(), sink=1, window=2, frames=2, rollout_kw={"clean_block": "frame"})
    # No window in the oracle: everything before a block visible.
    err_window = run_pair(model(), sink=1, window=2, frames=2, oracle_kw={"window": False})
    assert min(err_rope, err_clean, err_window) > 1e-3, (err_rope, err_clean, err_window)


def _with_frozen_rope(m, kw) -> float:
    """The rollout with every forward's rope at frame 0 (tables or grid alike)."""
    from framekv.engine.model.blocks import Rope3D

    real = Rope3D.for_forward

    def frame_zero(self, frame0, frames, batch, fused, ctx):
        return real(self, torch.zeros_like(frame0), frames, batch, fused, ctx)

    Rope3D.for_forward = frame_zero
    try:
        return run_pair(m, sink=1, window=2, frames=2)
    finally:
        Rope3D.for_forward = real


def test_the_rope_equals_the_stock_table_at_frame_zero_and_shifts_after():
    """`Rope3D` in a Wan rollout: the stock table's angles (its cos at even, sin at odd
    columns: each angle stored twice there) bit for bit, at absolute frames past the
    table's; the fused glue's `RopeGrid` the same angles."""
    from framekv.engine import ForwardContext
    from framekv.ops.qk_norm_rope import _rope_cos_sin

    m = model()
    big = m.rope.__class__(12, (1, 2, 2), 1024)(torch.zeros(1, 4, 8, 4, 4))  # stock, 8 frames
    r = WanRollout(m, latent_size=(4, 4), frames_per_chunk=3, window_frames=2, use_graphs=False)
    rope, ctx = r.chunk_model.rope, ForwardContext(None, seq_len=None)
    for f0 in (0, 5):
        cos, sin = rope.for_forward(torch.tensor([f0]), 3, 1, False, ctx)  # [1, S, 1, D/2]
        assert torch.equal(cos[0, :, 0], big[0][0, f0 * 4:(f0 + 3) * 4, 0, 0::2])
        assert torch.equal(sin[0, :, 0], big[1][0, f0 * 4:(f0 + 3) * 4, 0, 1::2])
    grid = rope.for_forward(torch.tensor([5]), 3, 1, True, ctx)
    fcos, fsin = _rope_cos_sin(grid, 1, 12)                       # [1, S, 1, D/2]
    assert torch.equal(fcos[0, :, 0], big[0][0, 5 * 4:8 * 4, 0, 0::2])
    assert torch.equal(fsin[0, :, 0], big[1][0, 5 * 4:8 * 4, 0, 1::2])


def test_prompt_changes_are_the_stock_cross_attention_of_the_new_prompt():
    m = model()
    other = torch.randn(1, 7, 16, generator=torch.Generator().manual_seed(4))
    oracle = Oracle(m, other, tokens_per_frame=4, frames_per_chunk=2, sink_frames=1,
                    window_frames=2, timesteps=TS)        # a stock copy, before the patches
    r = WanRollout(m, latent_size=(4, 4), frames_per_chunk=2, window_frames=2, use_graphs=False)
    r.set_prompt(TEXT)
    r.set_prompt(other)                             # again, before a step: the new one counts
    noise = torch.randn(1, 4, 2, 4, 4, generator=torch.Generator().manual_seed(2))
    got = r.step(noise)
    want, _ = oracle.chunk(noise)
    assert float((got - want).abs().max()) <= 1e-5
    with pytest.raises(ValueError, match="keep the prompt length of the first set_prompt"):
        r.set_prompt(torch.randn(1, 5, 16))


def test_graphs_on_cpu_run_the_same_chunks_and_reset_replays():
    m = model()
    kw = dict(latent_size=(4, 4), frames_per_chunk=2, window_frames=3, sampler="self_forcing")
    a = WanRollout(m, **kw)
    b = WanRollout(model(), **{**kw, "use_graphs": False})
    for r in (a, b):
        r.set_prompt(TEXT)
    a.capture()                                      # its warm-up calls draw numbers too
    torch.manual_seed(0)
    first = [a.step() for _ in range(4)]
    torch.manual_seed(0)
    other = [b.step() for _ in range(4)]
    assert all(torch.equal(x, y) for x, y in zip(first, other))
    assert a.graphs.stats().hits == 4 and a.frames_done == 8
    a.reset()
    torch.manual_seed(0)
    assert all(torch.equal(x, a.step()) for x in first)


@pytest.mark.parametrize("kwargs, words", [
    ({"sampler": "ddim"}, "sampler must be one of 'euler', 'self_forcing', 'v2v', got 'ddim'"),
    ({"clean_block": "row"}, "clean_block must be one of 'chunk', 'frame'"),
    ({"timesteps": (250, 500)}, "timesteps must be a decreasing sequence in (0, 1000]"),
    ({"latent_size": (5, 4)}, "must be a multiple of the model's patch"),
    ({"frames_per_chunk": 0}, "frames_per_chunk must be an integer >= 1, got 0"),
])
def test_bad_arguments_are_named(kwargs, words):
    kw = dict(latent_size=(4, 4), frames_per_chunk=2, window_frames=2, use_graphs=False)
    with pytest.raises(ValueError) as exc:
        WanRollout(model(), **{**kw, **kwargs})
    assert words in str(exc.value)


def test_misuse_is_named():
    kw = dict(latent_size=(4, 4), frames_per_chunk=2, window_frames=2, use_graphs=False)
    with pytest.raises(ValueError, match="must be a diffusers WanTransformer3DModel"):
        WanRollout(torch.nn.Linear(2, 2), **kw)
    r = WanRollout(model(), **kw)
    with pytest.raises(ValueError, match="no prompt: call set_prompt"):
        r.step()
    with pytest.raises(ValueError, match=r"text_embeds must be a \[1, L, 16\] tensor"):
        r.set_prompt(torch.randn(1, 7, 8))
    r.set_prompt(TEXT)
    with pytest.raises(ValueError, match=r"noise must be a \[1, 4, 2, 4, 4\] tensor"):
        r.step(torch.randn(1, 4, 3, 4, 4))


def test_weights_from_a_local_folder_and_nothing_fetched(tmp_path):
    m = model(seed=5)
    m.save_pretrained(tmp_path / "wan")
    r = WanRollout.from_pretrained(tmp_path / "wan", latent_size=(4, 4), frames_per_chunk=2,
                                   window_frames=2, use_graphs=False)
    for (na, a), (nb, b) in zip(m.state_dict().items(), r.model.state_dict().items()):
        assert na == nb and torch.equal(a, b), na
    with pytest.raises(ValueError, match="do not exist"):
        WanRollout.from_pretrained(tmp_path / "missing", latent_size=(4, 4), frames_per_chunk=2,
                                   window_frames=2)
    with pytest.raises(ValueError, match="a single-file checkpoint needs config="):
        (tmp_path / "w.safetensors").write_bytes(b"")
        WanRollout.from_pretrained(tmp_path / "w.safetensors", latent_size=(4, 4),
                                   frames_per_chunk=2, window_frames=2)
    r = WanRollout.from_config("tiny", seed=5, latent_size=(4, 4), frames_per_chunk=2,
                               window_frames=2)
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(),
                                                  r.model.state_dict().values()))


def test_the_wan_bench_and_demo_run_on_the_cpu(capsys):
    from framekv.bench.wan import format_wan, measure_wan
    from framekv.tools.cli import main

    res = measure_wan("tiny", latent_size=(4, 4), frames_per_chunk=2, window_frames=3, chunks=2,
                      recompute_chunks=1, device="cpu", progress=lambda m: None)
    v = res["variants"]
    assert set(v) == {"stock-recompute", "framekv-graphs", "framekv-fused-graphs",
                      "framekv-eager", "dense-eager", "dense-graphs"}
    assert v["dense-graphs"]["path"] == "graphs" and v["framekv-eager"]["path"] == "eager"
    for name in ("framekv-graphs", "framekv-fused-graphs", "dense-eager", "dense-graphs"):
        assert v[name]["max_abs_diff_vs_framekv_eager"] <= 1e-5, name  # the same math
    assert "framekv-graphs / dense-eager frames per second" in format_wan(res)
    assert main(["demo", "--model", "wan-diffusers", "--chunks", "3"]) == 0
    out = capsys.readouterr().out
    assert "framekv demo: Wan tiny" in out and "graphs vs eager" in out and "FAILED" not in out


@pytest.mark.parametrize("g", [1.0, 4.5])
def test_guidance_equals_the_two_branches_run_apart(g):
    """guidance_scale: conditional and unconditional branches as two sequences of one
    pool equal each branch over its own rollout, combined in lockstep (fp32)."""
    from wan_oracle import guidance_pair

    negative = torch.randn(1, 7, CONFIGS["tiny"]["text_dim"],
                           generator=torch.Generator().manual_seed(3))
    err = guidance_pair(model, TEXT, negative, g=g, chunks=6, latent_size=(4, 4), frames=2,
                        sink=1, window=3, timesteps=TS, use_graphs=False,
                        noise=lambda i: torch.randn(1, 4, 2, 4, 4,
                                                    generator=torch.Generator().manual_seed(i)))
    assert err <= 1e-5, err


def test_guidance_arguments_are_checked():
    kw = dict(latent_size=(4, 4), frames_per_chunk=2, window_frames=3, use_graphs=False)
    with pytest.raises(ValueError, match="guidance_scale must be None or a number"):
        WanRollout(model(), guidance_scale="7", **kw)
    r = WanRollout(model(), **kw)
    with pytest.raises(ValueError, match="negative_embeds needs guidance_scale"):
        r.set_prompt(TEXT, TEXT)
    r = WanRollout(model(), guidance_scale=3.0, **kw)
    with pytest.raises(ValueError, match="shape of text_embeds"):
        r.set_prompt(TEXT, TEXT[:, :5])
    assert r.cache.num_sequences == 2


def _cat_qkv(a, x):
    return torch.cat([a.to_q(x), a.to_k(x), a.to_v(x)], dim=-1)


def test_packed_projections_share_one_weight_and_give_the_same_qkv():
    """`pack_projections`: q, k, v become row blocks of one weight (no second copy), one
    GEMM gives what the three projections and a cat give; a load that replaces the
    tensors falls back to the cat, one that copies into them keeps the packing."""
    from framekv.engine.wan.attention import _packed_parts, pack_projections, packed_qkv

    m = model(seed=3)
    a, b = m.blocks[0].attn1, m.blocks[1].attn1
    x = torch.randn(2, 5, a.to_q.in_features, generator=torch.Generator().manual_seed(4))
    want = _cat_qkv(a, x)
    before = [t.clone() for t in (a.to_q.weight, a.to_k.weight, a.to_v.weight, a.to_v.bias)]
    pack_projections(a)
    after = (a.to_q.weight, a.to_k.weight, a.to_v.weight, a.to_v.bias)
    assert all(torch.equal(t, u) for t, u in zip(before, after))
    weight, bias = _packed_parts(a)
    assert weight.shape == (3 * a.to_q.out_features, a.to_q.in_features)
    assert {t.untyped_storage().data_ptr() for t in after[:3]} == {weight.untyped_storage().data_ptr()}
    torch.testing.assert_close(packed_qkv(a, x), want, rtol=1e-6, atol=1e-6)
    pack_projections(a)  # again: the same packing
    assert _packed_parts(a)[0] is weight
    a.load_state_dict({k: v.clone() for k, v in a.state_dict().items()}, assign=True)
    assert _packed_parts(a) is None
    torch.testing.assert_close(packed_qkv(a, x), want, rtol=1e-6, atol=1e-6)
    pack_projections(b)
    g = torch.Generator().manual_seed(5)
    b.load_state_dict({k: torch.randn(v.shape, generator=g) for k, v in b.state_dict().items()})
    assert _packed_parts(b) is not None
    torch.testing.assert_close(packed_qkv(b, x), _cat_qkv(b, x), rtol=1e-6, atol=1e-6)


def test_fused_projections_are_left_alone():
    from framekv.engine.wan.attention import _packed_parts, pack_projections, packed_qkv

    a = model(fused=True).blocks[0].attn1
    pack_projections(a)
    assert _packed_parts(a) is None
    x = torch.randn(1, 3, a.to_qkv.in_features, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(packed_qkv(a, x), a.to_qkv(x))
