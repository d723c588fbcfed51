"""`framekv.engine.wan.pipeline`: one loader for serve, generate and the demo. A config,
a diffusers folder and an original-layout checkpoint each give the parts they name (the
same weights as building or loading them by hand), at the sizes and with the sampling
the contract says; every bad argument is a ValueError naming it before anything is
built; ``framekv serve --checkpoint`` serves a checkpoint and refuses a bad one in one
line, exit 2, before any model is built. CPU, the tiny config, fp32."""
from __future__ import annotations

import math
import re

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from framekv.engine.wan import (CONFIGS, PRESETS, TextEncoder, WanRollout,  # noqa: E402
                                build_model, preset_sizes, save_original_checkpoint)
from framekv.engine.wan import pipeline as pl  # noqa: E402
from framekv.engine.wan.pipeline import WanPipeline, sampling, shipped_config  # noqa: E402
from framekv.engine.wan.vae import build_vae  # noqa: E402
from wan_text_harness import save_text_parts  # noqa: E402

TINY = preset_sizes(PRESETS["tiny"])


def same_weights(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A diffusers folder of the tiny config: transformer (seed 4), VAE (seed 5), text
    encoder and tokenizer (seed 6)."""
    root = tmp_path_factory.mktemp("wan")
    model, vae = build_model("tiny", device="cpu", seed=4), build_vae("tiny", device="cpu", seed=5)
    model.save_pretrained(root / "transformer")
    vae.save_pretrained(root / "vae")
    save_text_parts(root, seed=6)
    return root, model, vae


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """An original-layout generator checkpoint of the tiny config (seed 3)."""
    path = tmp_path_factory.mktemp("ckpt") / "gen.pt"
    model = build_model("tiny", device="cpu", seed=3)
    save_original_checkpoint(model, path)
    return path, model


def chunk(pipe, prompt="a cat"):
    """The first chunk of ``pipe``'s rollout under ``prompt`` (fixed noise)."""
    r = pipe.rollout(use_graphs=False)
    r.set_prompt(prompt)
    noise = torch.randn(1, *r.chunk_shape, generator=torch.Generator().manual_seed(1))
    return r.step(noise)


# ----------------------------------------------------------------------------- a config
def test_a_config_is_every_part_random_at_its_presets_sizes():
    pipe = WanPipeline.load("tiny", device="cpu")
    same_weights(pipe.transformer, build_model("tiny", device="cpu"))
    same_weights(pipe.vae, build_vae("tiny", device="cpu"))
    want = TextEncoder.from_config("tiny", max_tokens=TINY["prompt_tokens"], device="cpu")
    same_weights(pipe.text_encoder.encoder, want.encoder)
    assert pipe.text_encoder.max_tokens == TINY["prompt_tokens"]
    assert (pipe.sizes, pipe.sampler, pipe.timesteps) == (TINY, "euler", TINY["timesteps"])
    assert pipe.config_name == "tiny" and pipe.device == torch.device("cpu")
    assert pipe.rollout_kwargs() == {**TINY, "sampler": "euler"}
    # the default source is the tiny config; a dict of its values is the same config
    assert WanPipeline.load(device="cpu", vae=False).config_name == "tiny"
    as_dict = WanPipeline.load(dict(CONFIGS["tiny"]), device="cpu", preset="small-stream")
    assert as_dict.config_name == "tiny" and as_dict.sizes == preset_sizes("small-stream")


def test_a_config_rolls_out_from_text_and_decodes():
    pipe = WanPipeline.load("tiny", device="cpu")
    got = chunk(pipe)
    r = WanRollout(build_model("tiny", device="cpu"), use_graphs=False, **TINY)
    r.set_prompt(pipe.text_encoder.encode("a cat"))
    noise = torch.randn(1, *r.chunk_shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(got, r.step(noise))
    frames = pipe.decoder().decode(got)                       # [1, 3, F', 8H, 8W]
    assert frames.shape[-2:] == tuple(8 * s for s in TINY["latent_size"])


def test_a_config_of_no_shipped_shape_has_no_random_text_encoder_or_vae():
    cfg = {**CONFIGS["tiny"], "num_layers": 1}
    pipe = WanPipeline.load(cfg, preset="tiny", device="cpu", text_encoder=None, vae=None)
    assert len(pipe.transformer.blocks) == 1 and pipe.config_name is None
    assert pipe.text_encoder is None and pipe.vae is None
    with pytest.raises(ValueError, match="decoder\\(\\) needs the VAE"):
        pipe.decoder()
    none = WanPipeline.load("tiny", device="cpu", text_encoder=False, vae=False)
    assert none.text_encoder is None and none.vae is None


# ----------------------------------------------------------------------------- a folder
def test_a_folder_is_its_parts(folder):
    root, model, vae = folder
    pipe = WanPipeline.load(weights=root, device="cpu")
    same_weights(pipe.transformer, model)
    same_weights(pipe.vae, vae)
    want = TextEncoder.from_pretrained(root, max_tokens=TINY["prompt_tokens"])
    same_weights(pipe.text_encoder.encoder, want.encoder)
    # the sizes are those of the shipped config the folder's transformer matches
    assert pipe.config_name == "tiny" and pipe.sizes == TINY and pipe.sampler == "euler"
    r = WanRollout(model, use_graphs=False, **TINY)
    r.set_prompt(want.encode("a cat"))
    noise = torch.randn(1, *r.chunk_shape, generator=torch.Generator().manual_seed(1))
    # the folder's tensors sit at other addresses than the saved model's: the CPU GEMMs
    # may round differently
    torch.testing.assert_close(chunk(pipe), r.step(noise), atol=1e-5, rtol=0)


def test_a_folder_without_a_text_encoder_or_vae(folder, tmp_path):
    root, model, _ = folder
    model.save_pretrained(tmp_path / "bare" / "transformer")
    pipe = WanPipeline.load(weights=tmp_path / "bare", device="cpu", text_encoder=None,
                            vae=None)
    assert pipe.text_encoder is None and pipe.vae is None
    with pytest.raises(ValueError, match=r"it lacks vae/, text_encoder/ \+ tokenizer/"):
        WanPipeline.load(weights=tmp_path / "bare", device="cpu")


# ----------------------------------------------------------------------------- a checkpoint
def test_a_checkpoint_replaces_the_transformer_and_samples_as_self_forcing(checkpoint):
    path, model = checkpoint
    pipe = WanPipeline.load("tiny", checkpoint=path, device="cpu")
    same_weights(pipe.transformer, model)
    same_weights(pipe.vae, build_vae("tiny", device="cpu"))            # the config's, random
    assert pipe.config_name == "tiny" and pipe.sizes == TINY
    want = sampling(TINY["timesteps"], checkpoint=True)
    assert (pipe.sampler, pipe.timesteps) == (want["sampler"], want["timesteps"])
    assert pipe.sampler == "self_forcing" and pipe.timesteps != TINY["timesteps"]
    r = pipe.rollout(use_graphs=False)
    assert r.sampler == "self_forcing" and r.text_encoder is pipe.text_encoder
    over = WanPipeline.load("tiny", checkpoint=path, device="cpu", sampler="euler", shift=1.0,
                            text_encoder=False, vae=False)
    assert (over.sampler, over.timesteps) == ("euler", TINY["timesteps"])


def test_a_checkpoint_over_a_folder_takes_its_shape_text_encoder_and_vae(checkpoint, folder):
    path, model = checkpoint
    root, _, vae = folder
    pipe = WanPipeline.load(weights=root, checkpoint=path, device="cpu")
    same_weights(pipe.transformer, model)
    same_weights(pipe.vae, vae)
    want = TextEncoder.from_pretrained(root, max_tokens=TINY["prompt_tokens"])
    same_weights(pipe.text_encoder.encoder, want.encoder)
    assert pipe.sampler == "self_forcing"


def test_a_checkpoint_beside_a_folder_without_a_transformer_is_wan_1_3b(checkpoint, tmp_path):
    pytest.importorskip("accelerate")      # the 1.3B model is built on the meta device
    path, _ = checkpoint
    (tmp_path / "vae").mkdir()
    with pytest.raises(ValueError, match="does not fit the model"):
        WanPipeline.load(weights=tmp_path, checkpoint=path, device="cpu", text_encoder=False)


# ----------------------------------------------------------------------------- sampling
def test_sampling_warps_the_steps_by_the_shift():
    steps = (1000.0, 750.0, 500.0, 250.0)
    sf = sampling(steps, checkpoint=True)
    assert sf["sampler"] == "self_forcing"
    # t = 1000 * 5 s / (1 + 4 s) at s = 1, .75, .5, .25
    assert all(math.isclose(a, b) for a, b in zip(sf["timesteps"], (1000, 937.5, 2500 / 3, 625)))
    assert sampling(steps) == {"sampler": "euler", "timesteps": steps}
    two = sampling(steps, sampler="euler", shift=2.0)
    assert two["sampler"] == "euler" and math.isclose(two["timesteps"][3], 400.0)


def test_shipped_config_matches_every_value():
    assert shipped_config(CONFIGS["1.3b"]) == "1.3b"
    assert shipped_config({**CONFIGS["tiny"], "patch_size": [1, 2, 2]}) == "tiny"
    assert shipped_config({**CONFIGS["tiny"], "ffn_dim": 64}) is None


def test_the_parsers_copies_are_the_engines():
    from framekv.engine.samplers import named_samplers
    from framekv.tools import generate
    from framekv.tools.conventions import SAMPLER_NAMES

    # --sampler's choices are read from the registry, the shift is a copy
    assert tuple(SAMPLER_NAMES) == named_samplers()
    assert generate.SELF_FORCING_SHIFT == pl.SELF_FORCING_SHIFT


# ----------------------------------------------------------------------------- errors
@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if any part is built or loaded."""
    def built(*a, **k):
        raise AssertionError("a part was built before the arguments were checked")

    for name in ("build_model", "load_model", "build_vae", "load_vae"):
        monkeypatch.setattr(pl, name, built)


@pytest.mark.parametrize("kwargs, match", [
    (dict(config="huge"), r"config must be one of \['1.3b', '14b', 'tiny'\] or a "
                          r"transformer config dict, got 'huge'"),
    (dict(config=3), "config must be one of .* got 3"),
    (dict(config="tiny", weights="{tmp}"), "config and weights both give the transformer"),
    (dict(weights="{tmp}/missing"), r"weights must be a local diffusers folder, got "
                                    r"'.*missing' \(not a folder"),
    (dict(weights="{tmp}"), r"holding transformer/, vae/, text_encoder/ \+ tokenizer/; it "
                            r"lacks transformer/, vae/, text_encoder/ \+ tokenizer/"),
    (dict(weights="{tmp}", checkpoint="{tmp}/x.pt", text_encoder=None),
     "holding vae/; it lacks vae/"),
    (dict(checkpoint="{tmp}/missing.pt"), r"checkpoint must be a generator checkpoint file "
                                          r"\(.pt, .pth, .safetensors\), got .* \(no such file\)"),
    (dict(checkpoint="{tmp}/x.bin"), r"checkpoint must be .*x.bin' \(not one of those\)"),
    (dict(sampler="ddim"), r"sampler must be one of \['euler', 'self_forcing', 'v2v'\], got 'ddim'"),
    (dict(shift=-1.0), "shift must be a number > 0, got -1.0"),
    (dict(shift=math.inf), "shift must be a number > 0, got inf"),
    (dict(shift=True), "shift must be a number > 0, got True"),
    (dict(text_encoder="yes"), "text_encoder must be True, None or False, got 'yes'"),
    (dict(vae=1.0), "vae must be True, None or False, got 1.0"),
    (dict(preset="nope"), "unknown preset 'nope'"),
    (dict(config={**CONFIGS["tiny"], "num_layers": 1}, vae=None, text_encoder=None),
     r"preset must be given: the transformer's config matches no shipped config"),
    (dict(config={**CONFIGS["tiny"], "num_layers": 1}, preset="tiny"),
     r"text_encoder=True needs a shipped config"),
    (dict(config={**CONFIGS["tiny"], "num_layers": 1}, preset="tiny", text_encoder=None),
     r"vae=True needs a shipped config"),
])
def test_bad_arguments_are_named_before_anything_is_built(tmp_path, nothing_built, kwargs,
                                                          match):
    (tmp_path / "x.pt").write_bytes(b"")
    (tmp_path / "x.bin").write_bytes(b"")
    kwargs = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        WanPipeline.load(device="cpu", **kwargs)


def test_a_checkpoint_that_does_not_fit_is_named(checkpoint, tmp_path):
    torch.save({"generator_ema": {"nothing.weight": torch.zeros(1)}}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="does not fit the model"):
        WanPipeline.load("tiny", checkpoint=tmp_path / "bad.pt", device="cpu")


# ----------------------------------------------------------------------------- serve
def serve_args(*argv):
    from framekv.tools.cli import build_parser

    return build_parser().parse_args(["serve", "--model", "wan-diffusers", "--device", "cpu",
                                      *map(str, argv)])


def test_serve_checkpoint_serves_its_weights_as_self_forcing(checkpoint):
    from framekv.tools.serve import model_name, wan_factory

    path, model = checkpoint
    args = serve_args("--checkpoint", path, "--output", "latents")
    assert args.checkpoint == str(path) and args.sampler is None and args.shift is None
    parts = wan_factory(args, use_graphs=False, decode=False)
    same_weights(parts.model, model)
    assert parts.vae is None and isinstance(parts.text_encoder, TextEncoder)
    runner = parts(sequences=1, batch_sizes=(1,))
    try:
        want = sampling(TINY["timesteps"], checkpoint=True)
        assert runner.sampler == "self_forcing" and runner.model is parts.model
        assert runner.sigmas == [t / 1000.0 for t in want["timesteps"]] + [0.0]
    finally:
        runner.close()
    assert model_name(args) == "wan-diffusers:tiny+gen.pt"
    plain = wan_factory(serve_args("--sampler", "self_forcing", "--shift", "2"), decode=False)
    assert plain.pipeline.sampler == "self_forcing" and plain.pipeline.timesteps[-1] != 500.0


@pytest.fixture
def no_server(monkeypatch):
    """Fail the test if the scheduler or any model is built."""
    def built(*a, **k):
        raise AssertionError("built before the options were checked")

    monkeypatch.setattr("framekv.engine.serving.StreamScheduler", built)
    for name in ("build_model", "load_model", "build_vae", "load_vae"):
        monkeypatch.setattr(pl, name, built)


@pytest.mark.parametrize("argv, match", [
    (["--model", "wan-diffusers", "--checkpoint", "{tmp}/missing.pt"],
     r"checkpoint must be a generator checkpoint file .* \(no such file\)"),
    (["--model", "wan-diffusers", "--checkpoint", "{tmp}/x.bin"], r"\(not one of those\)"),
    (["--model", "wan-diffusers", "--checkpoint", "{tmp}/x.pt", "--weights", "{tmp}"],
     "it lacks vae/"),
    (["--checkpoint", "{tmp}/x.pt"], "--checkpoint: only with --model wan-diffusers"),
    (["--sampler", "self_forcing", "--shift", "3"],
     "--sampler, --shift: only with --model wan-diffusers .* got --model reference"),
])
def test_serve_refuses_a_bad_checkpoint_in_one_line(tmp_path, capsys, no_server, argv, match):
    from framekv.tools.cli import main

    (tmp_path / "x.pt").write_bytes(b"")
    (tmp_path / "x.bin").write_bytes(b"")
    assert main(["serve", "--device", "cpu", *[a.format(tmp=tmp_path) for a in argv]]) == 2
    err = capsys.readouterr().err
    assert err.startswith("framekv serve: error: ") and err.count("\n") == 1, err
    assert re.search(match, err), err


@pytest.mark.parametrize("argv, words", [
    (["serve", "--steps", "3"], "framekv serve: error: --steps must be an integer in [1, 2] "
                                "(how many of the preset's 2 denoising steps run), got 3"),
    (["serve", "--model", "wan-diffusers", "--steps", "5"],
     "framekv serve: error: steps must be an integer in [1, 2] (how many of the preset's 2 "
     "denoising steps run), got 5"),
    (["generate", "--prompt", "a cat", "--chunks", "1", "--out", "{tmp}/v.mp4", "--steps", "5"],
     "framekv generate: error: steps must be an integer in [1, 2]"),
])
def test_steps_beyond_the_preset_is_one_line_and_exit_2(argv, words, tmp_path, capsys,
                                                         no_server):
    from framekv.tools.cli import main

    assert main([*[a.format(tmp=tmp_path) for a in argv], "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(words) and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, match", [
    (["--shift", "0"], "--shift: must be a finite number > 0, got 0"),
    (["--sampler", "ddim"], "invalid choice: 'ddim'"),
])
def test_serve_refuses_bad_sampling_at_parse_time(capsys, argv, match):
    from framekv.tools.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--model", "wan-diffusers", *argv])
    assert exc.value.code == 2 and match in capsys.readouterr().err
