"""The model seam (`framekv.engine.models`): the registry's rules, the one check of model
options against a family (`check_model`, the command line's flags through
`framekv.tools.model_flags`), what each built-in family has of decoders and encoders,
and a family registered here, in this file, served by `framekv serve`'s own code over a
real socket with no change anywhere else: its chunks are its model's, its flags checked
as the built-in families' are."""
from __future__ import annotations

import json

import msgspec
import pytest

from framekv.engine.models import (DEFAULT_MODEL, TEXT_MODEL, LoadedModel, ModelFamily,
                                   ModelOptions, check_model, get_model, model_configs, models,
                                   register_model, unregister_model)
from framekv.engine.rollout import Rollout, resolve_device
from framekv.engine.serving import LatentPreview
from framekv.engine.step import chunk_noise
from framekv.specs import load_preset
from framekv.tools import model_flags
from framekv.tools.cli import build_parser, main
from framekv.tools.conventions import CONFIG_NAMES, MODEL_NAMES

TINY = load_preset("tiny")


class ToyFamily(ModelFamily):
    """The reference DiT's blocks at the tiny preset's sizes, as a family of its own: two
    configs ("solo": one layer, "duo": two), weights drawn from seed 7, ``steps``."""

    title = "a toy DiT of one or two layers"
    configs = ("solo", "duo")
    default_config = "solo"
    options = frozenset({"config", "steps"})

    def load(self, options, *, device=None, text_encoder=None, decode=True):
        if text_encoder is True:
            raise ValueError("the toy family has no text encoder")
        self.check(options)
        layers = self.configs.index(options.config or self.default_config) + 1
        model = msgspec.structs.replace(TINY.model, name="toy", num_layers=layers, seed=7)
        return ToyModel(self, options, (model, TINY.rollout), device=resolve_device(device))


class ToyModel(LoadedModel):
    def __init__(self, family, options, spec, *, device):
        super().__init__(family, options, device=device)
        self.spec = spec

    def rollout(self, **kwargs):
        return Rollout(self.spec, self.device, **{"steps": self.options.steps, **kwargs})


@pytest.fixture
def toy():
    register_model("toy", ToyFamily())
    yield get_model("toy")
    unregister_model("toy")


# ----------------------------------------------------------------------------- the registry
def test_the_built_in_families_and_the_parsers_copies():
    from framekv.engine.wan.pipeline import SELF_FORCING_SHIFT

    assert models()[:2] == (DEFAULT_MODEL, TEXT_MODEL) == ("reference", "wan-diffusers")
    assert (model_flags.DEFAULT_MODEL, model_flags.TEXT_MODEL) == (DEFAULT_MODEL, TEXT_MODEL)
    assert model_flags.SELF_FORCING_SHIFT == SELF_FORCING_SHIFT
    assert tuple(MODEL_NAMES) == models() and tuple(CONFIG_NAMES) == model_configs()
    assert get_model(TEXT_MODEL).configs == model_configs() == ("tiny", "1.3b")


@pytest.mark.parametrize("name, family, match", [
    ("Toy", None, "lower case letters"),
    ("toy:1", None, "lower case letters"),
    ("", None, "lower case letters"),
    (3, None, "lower case letters"),
    ("reference", None, "'reference' is registered already"),
    ("toy", object(), "family must be a ModelFamily, got object"),
])
def test_register_model_refuses_a_bad_name_or_family(name, family, match):
    with pytest.raises(ValueError, match=match):
        register_model(name, ToyFamily() if family is None else family)
    assert "toy" not in models()


def test_a_family_is_registered_once_and_the_built_ins_stay(toy):
    with pytest.raises(ValueError, match="family is registered already as 'toy', got 'toy2'"):
        register_model("toy2", toy)
    for name, match in (("reference", "must not be a built-in"), ("nope", "'nope'")):
        with pytest.raises(ValueError, match=match):
            unregister_model(name)
    with pytest.raises(ValueError, match=r"model must be one of 'reference', "
                                         r"'wan-diffusers', 'toy', got 'nope'"):
        get_model("nope")
    assert models()[-1] == "toy" and model_configs()[-2:] == ("solo", "duo")


# ----------------------------------------------------------------------------- the checks
def test_an_option_a_family_does_not_take_names_those_that_take_it(toy):
    flags = model_flags.FLAGS
    with pytest.raises(ValueError) as exc:
        check_model("reference", ModelOptions(config="solo", steps=1), names=flags)
    assert str(exc.value) == ("--config: only with --model wan-diffusers or toy (the "
                              "reference model family takes --steps, --kv-dtype, "
                              "--fp8-gemm), got --model reference")
    with pytest.raises(ValueError, match=r"^weights, kv_dtype: only with model "
                                         r"wan-diffusers \(the toy model family takes "
                                         r"config, steps\), got model toy$"):
        check_model("toy", ModelOptions(weights="w", kv_dtype="fp8"))
    with pytest.raises(ValueError, match=r"--config must be one of \['solo', 'duo'\], "
                                         r"got '1.3b'"):
        check_model("toy", ModelOptions(config="1.3b"), names=flags)
    with pytest.raises(ValueError, match=r"--steps must be an integer in \[1, 2\]"):
        check_model("reference", ModelOptions(steps=3), names=flags)
    assert check_model("toy", ModelOptions(config="duo", steps=2)) is toy


def test_the_reference_family_previews_its_latents_and_has_no_encoder():
    family = get_model("reference")
    model = family.load(ModelOptions(preset="small-stream"), device="cpu")
    assert family.label(model.options) == "reference:small-stream"
    assert model.title == "preset small-stream" and model.text_encoder is None
    preview = model.decoder(3)
    assert isinstance(preview, LatentPreview) and preview.sequences == 3
    with pytest.raises(ValueError, match="the reference model family has no encoder"):
        model.encoder()
    with pytest.raises(ValueError, match="has no text encoder"):
        family.load(ModelOptions(), text_encoder=True)
    with pytest.raises(ValueError, match=r"decoder must be one of \['preview'\]"):
        family.decoder("wan", model=model)


def test_the_wan_family_encoder_follows_its_decoder_choice():
    pytest.importorskip("diffusers")
    from framekv.engine.wan import (StreamingVAEDecoder, StreamingVAEEncoder,
                                    TinyStreamingDecoder, TinyStreamingEncoder)

    family = get_model(TEXT_MODEL)
    model = family.load(ModelOptions(), device="cpu", text_encoder=False)
    got = (model.decoder(2), model.encoder(2),      # its choice, wan: the VAE's
           family.decoder("tiny", model=model, sequences=2),
           family.encoder("tiny", model=model, sequences=2))
    assert tuple(map(type, got)) == (StreamingVAEDecoder, StreamingVAEEncoder,
                                      TinyStreamingDecoder, TinyStreamingEncoder)
    assert all(c.sequences == 2 for c in got)
    with pytest.raises(ValueError, match=r"encoder must be one of \['wan', 'tiny'\]"):
        family.encoder("preview", model=model)
    assert family.label(ModelOptions(weights="/m/wan-1.3b/", checkpoint="/c/gen.pt")) == \
        "wan-diffusers:wan-1.3b+gen.pt"


def test_a_video_input_is_checked_against_the_family_before_anything_is_built(monkeypatch):
    with pytest.raises(ValueError, match="a video input needs a model family with an encoder"):
        get_model("reference").video_chunks(ModelOptions())
    pytest.importorskip("diffusers")
    from framekv.engine.models.wan import WanFamily

    monkeypatch.setattr(WanFamily, "load", lambda *a, **k: pytest.fail("a model was built"))
    family = get_model(TEXT_MODEL)
    assert family.video_chunks(ModelOptions(config="tiny")) == (2, (64, 64))
    assert family.video_chunks(ModelOptions(config="1.3b")) == (3, (480, 832))
    got = family.video_options(ModelOptions(config="1.3b", steps=4), 0.75)
    assert (got.sampler, got.sampler_options, got.steps) == \
        ("v2v", {"base": "euler", "strength": 0.75}, 4)
    assert family.video_options(ModelOptions(sampler="self_forcing"), 1).sampler_options == \
        {"base": "self_forcing", "strength": 1.0}
    for options, strength, match in [
            (ModelOptions(), 0.0, r"strength must be a number in \(0, 1\]"),
            (ModelOptions(), 0.4, r"strength 0.4 runs none of the steps \[1000.0, 500.0\]"),
            (ModelOptions(config="1.3b", steps=2), 0.4, "it must be at least 0.5"),
            (ModelOptions(sampler="v2v"), 0.5, "a video input samples with v2v over the sampler"),
            (ModelOptions(sampler_options={"eta": 1}), 0.5, "with no options")]:
        with pytest.raises(ValueError, match=match):
            family.video_options(options, strength)
    assert family.encoder_title("tiny", "/w/taew2_1.pth") == "tiny encoder (/w/taew2_1.pth)"


# ----------------------------------------------------------------------------- a new family
def serve_args(*argv):
    return build_parser().parse_args(["serve", "--device", "cpu", *argv])


def test_a_family_registered_here_is_served(toy):
    """``framekv serve --model toy``'s own checks and scheduler, served over a real
    socket: /v1/info names the toy, and a session's chunks are the toy model's, stepped
    alone with the session's noise."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from serve_harness import create, serving
    from test_samplers import read_latents

    from framekv.tools.serve.command import build_scheduler, checked_options, model_name

    args = serve_args("--model", "toy", "--config", "duo", "--steps", "1", "--output",
                      "latents", "--max-sessions", "2")
    options = checked_options(args)
    sched = build_scheduler(args, options)
    assert sched.runner.model.spec.num_layers == 2 and len(sched.runner.sigmas) == 2
    with serving(sched, output="latents", model=model_name(args)) as (_, port):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            assert http.get("/v1/info").json()["model"] == "toy:duo"
            ids = {create(http, seed=seed, chunks=2): seed for seed in (3, 4)}
        got = {seed: read_latents(port, sid) for sid, seed in ids.items()}
    alone = toy.load(options["model"], device="cpu").rollout(use_graphs=False)
    for seed, chunks in got.items():
        alone.reset()
        alone.set_prompt(alone.default_prompt())
        assert len(chunks) == 2
        for i, lat in enumerate(chunks):
            want = alone.step(chunk_noise(seed, i, alone.chunk_shape)[None])[0]
            assert float((lat - want).abs().max()) <= 1e-5, (seed, i)
    alone.close()


def test_a_family_registered_here_takes_its_flags_and_refuses_others(toy, capsys, tmp_path,
                                                                    monkeypatch):
    from test_cli_conventions import help_text

    from framekv.tools.serve.command import checked_options

    line = next(ln for ln in help_text("serve", capsys, monkeypatch).splitlines()
                if ln.lstrip().startswith("--model"))
    assert "one of reference, wan-diffusers, toy (default reference)" in line
    for argv, words in ((["--weights", "w"], "--weights: only with --model wan-diffusers "
                                             "(the toy model family takes --config, "
                                             "--steps), got --model toy"),
                        (["--config", "tiny"], "--config must be one of ['solo', 'duo'], "
                                               "got 'tiny'"),
                        (["--kv-dtype", "fp8"], "--kv-dtype: only with --model "
                                                "reference or wan-diffusers")):
        with pytest.raises(ValueError) as exc:
            checked_options(serve_args("--model", "toy", *argv))
        assert words in str(exc.value)
    assert main(["generate", "--model", "toy", "--prompt", "a", "--chunks", "1", "--out",
                 str(tmp_path / "v.mp4"), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("framekv generate: error: the toy family has no text "
                                       "encoder\n")
    assert list(tmp_path.iterdir()) == []
    unregister_model("toy")
    try:
        with pytest.raises(SystemExit) as exc:
            main(["serve", "--model", "toy"])
        assert exc.value.code == 2 and "invalid choice: 'toy'" in capsys.readouterr().err
    finally:
        register_model("toy", toy)


def test_demo_and_warmup_run_a_family_registered_here(toy, tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--model", "toy", "--chunks", "2", "--check-chunks", "1",
                 "--device", "cpu", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["ok"] and report["model"] == "toy" and report["label"] == "toy:solo"
    assert [c["check"] for c in report["checks"]] == ["graphs vs eager",
                                                      "reference vs reference backend"]
    assert "framekv demo: toy:solo, 1 layers, device cpu" in capsys.readouterr().out
    assert main(["warmup", "tiny", "--model", "toy", "--config", "duo", "--no-progress"]) == 0
    assert capsys.readouterr().out.startswith(
        "warm-up of tiny: 1 chunk graph(s) of 2 denoising forwards + clean pass + commit; "
        "2 layers, 4/2 heads of 16")


# ----------------------------------------------------------------------------- no branches
def test_no_module_but_the_models_names_a_family():
    from test_samplers import ROOT, sampler_names_in

    # "reference" is also an attention backend's name: the rule reads the others
    hits = sampler_names_in(ROOT, set(models()) - {"reference"})
    own = ("engine/models/", "tools/model_flags.py:")    # the parser's copies of the names
    assert [h for h in hits if not h.startswith(own)] == []
    # the rule sees a family's name where one is written
    assert any(h.startswith("tools/model_flags.py:") and h.endswith(" 'wan-diffusers'")
               for h in hits)
