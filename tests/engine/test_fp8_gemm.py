"""fp8 GEMMs through the runners and the commands, on the CPU: ``gemm_dtype="fp8"`` on
`Rollout` and `WanRollout` against fp32 (the reference DiT's own rollout; Wan's own
math over the whole sequence, `wan_oracle`), both glues, with an fp8 pool, graphs on a
CPU, a shared model left as it was, the layers each model quantizes, a layer that
cannot be one refused by name before the pool is built, the memory estimate,
`StreamScheduler`, and ``--fp8-gemm`` on demo, generate, serve and the pixels bench."""
from __future__ import annotations

import json

import msgspec
import pytest
import torch

from framekv.engine import Rollout, WanRollout
from framekv.engine.fp8_linear import FP8, Fp8Linear
from framekv.engine.memory import rollout_bytes
from framekv.engine.wan import CONFIGS, build_model
from framekv.specs import load_preset
from framekv.tools.cli import build_parser, main

#: Bound on an fp8-GEMM rollout's relative L2 distance per chunk from the fp32 one (tiny,
#: CPU). Measured: about 5e-3 (every GEMM's operands rounded to 3 mantissa bits, a few
#: percent per GEMM, averaged over the channels and damped by the sampler); a factor of
#: 4 left for platform differences. It fails if the fp8 path runs with wrong scales.
ROLLOUT_REL_L2 = 2e-2
#: Bound on |velocity - the model's own fp32 math| over every step of a Wan rollout
#: with fp8 GEMMs (tiny config of width 32, velocities up to about 4). Measured 0.05.
WAN_MAX_ABS = 0.2
#: The tiny Wan config with heads of 16 and an MLP of 64 (fp8 GEMMs need features that
#: are multiples of 16; the shipped tiny config's width is 24).
TINY16 = {**CONFIGS["tiny"], "attention_head_dim": 16, "ffn_dim": 64}
WAN_KW = dict(latent_size=(4, 4), frames_per_chunk=2, sink_frames=1, window_frames=3)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ----------------------------------------------------------------------------- Rollout
def test_an_fp8_gemm_rollout_stays_close_to_the_fp32_one():
    full = Rollout("tiny", "cpu")
    fp8 = Rollout("tiny", "cpu", model=full.model, gemm_dtype="fp8")
    assert fp8.gemm_dtype == FP8 and full.gemm_dtype == torch.float32
    assert fp8.kv_dtype == torch.float32                              # the pool is not fp8
    errs = [rel_l2(g, w) for g, w in zip(fp8.run(), full.run())]
    assert len(errs) == 6 and 1e-4 < min(errs) and max(errs) < ROLLOUT_REL_L2, errs
    full.close()
    fp8.close()


def test_both_glues_and_an_fp8_pool_beside_fp8_gemms():
    full = Rollout("tiny", "cpu")
    fused = Rollout("tiny", "cpu", model=full.model, gemm_dtype="fp8")
    torch_glue = Rollout("tiny", "cpu", model=full.model, gemm_dtype="fp8", glue="torch")
    both = Rollout("tiny", "cpu", model=full.model, gemm_dtype="fp8", kv_dtype="fp8")
    want, a, b, c = (r.run(3) for r in (full, fused, torch_glue, both))
    # on a CPU the fused glue is its torch reference: the same GEMMs, the same math
    assert max(rel_l2(x, y) for x, y in zip(b, a)) < 1e-6
    errs = [rel_l2(x, w) for x, w in zip(c, want)]
    assert max(errs) < ROLLOUT_REL_L2 and min(rel_l2(x, y) for x, y in zip(c, a)) > 0, errs
    for r in (full, fused, torch_glue, both):
        r.close()


def test_graphs_on_a_cpu_run_the_same_fp8_chunks():
    graphed = Rollout("tiny", "cpu", gemm_dtype="fp8", use_graphs=True)
    eager = Rollout("tiny", "cpu", gemm_dtype="fp8", use_graphs=False, model=graphed.model)
    graphed.capture()
    a, b = graphed.run(4), eager.run(4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    graphed.reset()
    assert all(torch.equal(x, graphed.step()) for x in a)
    graphed.close()
    eager.close()


def test_a_shared_model_is_left_as_it_was():
    full = Rollout("tiny", "cpu")
    before = {k: v.clone() for k, v in full.model.state_dict().items()}
    fp8 = Rollout("tiny", "cpu", model=full.model, gemm_dtype="fp8")
    after = full.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the copies are the rollout's: four per block, the embeddings and head not among them
    copies = fp8.chunk_model.fp8
    assert [sorted(c) for c in copies] == [["fc1", "fc2", "proj", "qkv"]] * 2
    assert copies[1]["fc2"].name == "blocks.1.fc2" and copies[0]["qkv"].weight.dtype == FP8
    # fast accumulation but for fc2, whose sum runs over the MLP's width
    assert [{n: v.fast_accum for n, v in c.items()} for c in copies] == [
        {"qkv": True, "proj": True, "fc1": True, "fc2": False}] * 2
    fresh = Rollout("tiny", "cpu")
    assert all(torch.equal(x, y) for x, y in zip(full.run(2), fresh.run(2)))
    for r in (full, fp8, fresh):
        r.close()


def test_a_layer_that_cannot_be_fp8_is_named_before_the_pool_is_built(monkeypatch):
    import framekv.engine.rollout as rollout_module

    p = load_preset("tiny")
    # 3 heads of 8: a width of 24, not a multiple of 16
    spec = msgspec.structs.replace(p.model, num_heads=3, num_kv_heads=3, head_dim=8,
                                   hidden_size=24)

    def no_pool(*args, **kwargs):
        raise AssertionError("the pool was built before the fp8 layers were checked")

    monkeypatch.setattr(rollout_module, "CausalKVCache", no_pool)
    with pytest.raises(ValueError) as exc:
        Rollout((spec, p.rollout), "cpu", gemm_dtype="fp8")
    assert str(exc.value).startswith("blocks.0.qkv: fp8 GEMMs need in and out features that "
                                     "are multiples of 16, got a [72, 24] (out, in) weight")


def test_a_bad_gemm_dtype_names_the_argument():
    with pytest.raises(ValueError, match=r"gemm_dtype must be None, 'bf16' .* got 'fp16'"):
        Rollout("tiny", "cpu", gemm_dtype="fp16")
    with pytest.raises(ValueError, match=r"gemm_dtype must be None, 'bf16' .* got 'int8'"):
        WanRollout(build_model(TINY16), gemm_dtype="int8", **WAN_KW)


def test_the_memory_estimate_counts_the_fp8_weights():
    p = load_preset("wan-1.3b")
    plain = rollout_bytes(p.model, p.rollout, torch.bfloat16)
    fp8 = rollout_bytes(p.model, p.rollout, torch.bfloat16, fp8_weights=True)
    assert plain["fp8_weights"] == 0 and fp8["weights"] == plain["weights"]
    # the four GEMMs of 30 blocks, a byte a weight: 30 x 1536 x (4608 + 1536 + 2 x 8960)
    assert fp8["fp8_weights"] == 30 * 1536 * (4608 + 1536 + 2 * 8960)


# ----------------------------------------------------------------------------- WanRollout
@pytest.mark.parametrize("glue, fused_qkv", [("fused", False), ("torch", True)],
                         ids=["fused-glue", "torch-glue-fused-qkv"])
def test_a_wan_fp8_gemm_rollout_against_the_models_own_fp32_math(glue, fused_qkv):
    from test_wan import run_pair

    m = build_model(TINY16, seed=0)
    if fused_qkv:
        m.fuse_qkv_projections()
    err = run_pair(m, sink=1, window=3, frames=2, chunks=3,
                   rollout_kw={"gemm_dtype": "fp8", "glue": glue})
    assert 1e-3 < err <= WAN_MAX_ABS, err


def test_wan_fp8_linears_are_the_blocks_projections_and_mlp():
    from framekv.engine.wan.blocks import FP8_FAST_ACCUM, fp8_linears

    m = build_model(TINY16, seed=1)
    r = WanRollout(m, gemm_dtype="fp8", use_graphs=False, **WAN_KW)
    assert r.gemm_dtype == FP8 and len(r.chunk_model.fp8) == 2
    f = r.chunk_model.fp8[0]
    assert sorted(f) == ["cross_out", "cross_q", "ffn_in", "ffn_out", "out", "qkv"]
    assert all(isinstance(v, Fp8Linear) for v in f.values())
    assert (f["qkv"].out_features, f["qkv"].in_features) == (96, 32)     # q, k, v stacked
    assert (f["ffn_in"].out_features, f["ffn_out"].in_features) == (64, 64)
    assert f["ffn_out"].name == "blocks.0.ffn.net.2" and f["cross_q"].name == "blocks.0.attn2.to_q"
    # fast accumulation where the sum runs over the model's width, not the MLP's output
    assert {n: v.fast_accum for n, v in f.items()} == FP8_FAST_ACCUM
    assert [n for n, fast in FP8_FAST_ACCUM.items() if not fast] == ["ffn_out"]
    # the stacked q, k, v is the three projections' GEMMs side by side
    blk = m.blocks[0]
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    parts = [Fp8Linear.of(p, "p")(x) for p in (blk.attn1.to_q, blk.attn1.to_k, blk.attn1.to_v)]
    assert torch.equal(f["qkv"](x), torch.cat(parts, dim=-1))
    assert torch.equal(fp8_linears(blk, "blocks.0")["qkv"].weight.view(torch.uint8),
                       f["qkv"].weight.view(torch.uint8))
    r.close()


def test_the_shipped_tiny_wan_config_is_refused_by_name():
    with pytest.raises(ValueError) as exc:
        WanRollout(build_model("tiny"), gemm_dtype="fp8", **WAN_KW)
    assert str(exc.value).startswith("blocks.0.attn1.to_q/to_k/to_v: fp8 GEMMs need in and out "
                                     "features that are multiples of 16, got a [72, 24]")


# ----------------------------------------------------------------------------- serving
def test_the_scheduler_builds_its_rollout_with_fp8_gemms():
    from framekv.engine.serving import StreamScheduler

    sched = StreamScheduler("tiny", max_sessions=1, device="cpu", gemm_dtype="fp8")
    assert sched.runner.gemm_dtype == FP8
    sched.runner.close()
    with pytest.raises(ValueError, match="gemm_dtype is the preset's Rollout's"):
        StreamScheduler("tiny", device="cpu", gemm_dtype="fp8", runner_factory=lambda **kw: None)


# ----------------------------------------------------------------------------- commands
@pytest.mark.parametrize("argv", [["demo"], ["serve"],
                                  ["generate", "--prompt", "a", "--chunks", "1", "--out", "a.mp4"]])
def test_the_fp8_gemm_flag_parses_off_by_default(argv, tmp_path, monkeypatch):
    from framekv.tools.args import gemm_dtype_of

    monkeypatch.chdir(tmp_path)
    p = build_parser()
    assert gemm_dtype_of(p.parse_args(argv)) is None
    assert gemm_dtype_of(p.parse_args(argv + ["--fp8-gemm"])) == "fp8"


def test_demo_flag_reaches_every_rollout(tmp_path, monkeypatch, capsys):
    import framekv.tools.demo as demo

    built = []

    class Recording(Rollout):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.gemm_dtype)

    monkeypatch.setattr(demo, "Rollout", Recording)
    out = tmp_path / "demo.json"
    assert main(["demo", "tiny", "--fp8-gemm", "--chunks", "2", "--check-chunks", "1",
                 "--device", "cpu", "--no-progress", "--json", str(out)]) == 0
    assert len(built) == 3 and all(d == FP8 for d in built)   # the main rollout, the checks'
    report = json.loads(out.read_text())
    assert report["gemm_dtype"] == "float8_e4m3fn" and report["ok"]
    assert "GEMMs float8_e4m3fn" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "a cat", "--chunks", "1", "--device", "cpu", "--no-progress"],
    ["demo", "--model", "wan-diffusers", "--config", "tiny", "--chunks", "1", "--device", "cpu"]])
def test_wan_commands_pass_the_flag_to_the_rollout(argv, tmp_path, capsys):
    """The shipped tiny config cannot run fp8 GEMMs: the rollout's refusal, one line and
    status 2, shows the flag reached it."""
    if argv[0] == "generate":
        argv = argv + ["--out", str(tmp_path / "a.mp4")]
    assert main(argv + ["--fp8-gemm"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "blocks.0.attn1.to_q/to_k/to_v: fp8 GEMMs need" in err
    assert not (tmp_path / "a.mp4").exists()


def test_serve_passes_the_flag_to_either_model():
    from framekv.tools.serve import wan_factory
    from framekv.tools.serve.command import build_scheduler, checked_options

    args = build_parser().parse_args(["serve", "--fp8-gemm", "--device", "cpu",
                                      "--output", "latents", "--max-sessions", "1"])
    sched = build_scheduler(args, checked_options(args))
    assert sched.runner.gemm_dtype == FP8
    sched.runner.close()
    args = build_parser().parse_args(["serve", "--model", "wan-diffusers", "--config", "tiny",
                                      "--output", "latents", "--fp8-gemm", "--device", "cpu"])
    parts = wan_factory(args, decode=False)
    assert parts.gemm_dtype == "fp8"
    with pytest.raises(ValueError, match="blocks.0.attn1.to_q/to_k/to_v: fp8 GEMMs need"):
        parts(sequences=1, batch_sizes=(1,))


def test_the_pixels_bench_builds_its_rollout_with_fp8_gemms(monkeypatch):
    import framekv.engine
    from framekv.bench import pixels

    seen = {}

    class Stop(Exception):
        pass

    def recording(*args, **kwargs):
        seen.update(kwargs)
        raise Stop

    monkeypatch.setattr(framekv.engine, "WanRollout", recording)
    encoder = type("Encoder", (), {"max_tokens": 8})()
    model = type("Model", (), {"config": type("Config", (), {"in_channels": 4})()})()
    dec = type("Decoder", (), {"device": torch.device("cpu")})()
    with pytest.raises(Stop):
        pixels.measure_e2e(model, dec, encoder, latent_size=(8, 8), frames_per_chunk=2,
                           window_frames=2, chunks=2, gemm_dtype="fp8")
    assert seen["gemm_dtype"] == "fp8" and seen["kv_dtype"] is None
    assert "--fp8-gemm" in pixels.__doc__ and "GEMMs float8_e4m3fn" in pixels.format_pixels(
        {"gpu": "cpu", "latent_size": [8, 8], "frames_per_chunk": 2, "video_frames": 8,
         "kv_dtype": "float32", "gemm_dtype": "float8_e4m3fn", "decoders": {}})
