"""framekv.specs: validation, derived numbers, JSON/TOML round trips, preset loading."""
from __future__ import annotations

import importlib.resources
import re

import msgspec
import pytest

from framekv.specs import (DTYPES, Geometry, ModelSpec, Preset, RolloutSpec, WarmupOptions,
                           decode_json, decode_toml, encode_json, list_presets, load,
                           load_preset)

SHIPPED = ("seed-bench", "small-stream", "tiny", "wan-1.3b", "wan-14b")


def raises(*fragments: str):
    """pytest.raises(ValueError) matching every fragment literally, in order."""
    return pytest.raises(ValueError, match=".*".join(re.escape(f) for f in fragments))


# --- sample valid specs --------------------------------------------------------------

def geometry(**kw) -> Geometry:
    args = dict(pin_tokens=6, window_tokens=48, max_staged_tokens=32, causal_block_sizes=(32, 16))
    return Geometry(**{**args, **kw})


def model(**kw) -> ModelSpec:
    args = dict(name="m", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                head_dim=16, ffn_size=128, in_channels=4, patch_size=(1, 2, 2),
                latent_height=8, latent_width=8, text_dim=32, freq_dim=32,
                dtype="bfloat16", tokens_per_page=8, seed=0)
    return ModelSpec(**{**args, **kw})


def rollout(**kw) -> RolloutSpec:
    args = dict(tokens_per_frame=16, frames_per_chunk=2, window_frames=3, prompt_tokens=6,
                denoising_steps=2, chunks=6)
    return RolloutSpec(**{**args, **kw})


def preset(**kw) -> Preset:
    args = dict(name="p", model=model(), rollout=rollout())
    return Preset(**{**args, **kw})


SAMPLES = {
    "Geometry": geometry(),
    "ModelSpec": model(),
    "RolloutSpec": rollout(),
    "RolloutSpec-short-last": rollout(last_chunk_frames=1),
    "WarmupOptions": WarmupOptions(cache_dir="cache"),
    "Preset": preset(description="d", warmup=WarmupOptions(cache_dir="cache")),
}


# --- round trips -----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_json_round_trip(name):
    spec = SAMPLES[name]
    for indent in (0, 2):
        assert decode_json(encode_json(spec, indent=indent), type(spec)) == spec


@pytest.mark.parametrize("name", SHIPPED)
def test_preset_json_round_trip(name):
    p = load_preset(name)
    assert decode_json(encode_json(p), Preset) == p


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_frozen_and_hashable(name):
    spec = SAMPLES[name]
    field = spec.__struct_fields__[0]
    with pytest.raises(AttributeError):
        setattr(spec, field, getattr(spec, field))
    assert {spec: 1}[decode_json(encode_json(spec), type(spec))] == 1


# --- Geometry --------------------------------------------------------------------------

def test_geometry_normalises_block_sizes():
    g = Geometry(0, 10, 8, [8, 2, 8, 4])
    assert g.causal_block_sizes == (2, 4, 8)
    assert isinstance(g.causal_block_sizes, tuple)


def test_geometry_equality_and_hash():
    a = Geometry(4, 12, 8, (8, 2))
    b = Geometry(4, 12, 8, [2, 8, 2])
    assert a == b and hash(a) == hash(b)
    assert a != Geometry(4, 12, 8, (8,))
    assert len({a, b, Geometry(5, 12, 8, (8,))}) == 2


def test_geometry_frozen():
    g = geometry()
    with pytest.raises(AttributeError):
        g.pin_tokens = 1
    with pytest.raises(AttributeError):
        g.causal_block_sizes = (1,)


def test_geometry_max_visible_tokens():
    assert geometry().max_visible_tokens == 6 + 48 + 32


@pytest.mark.parametrize("field, value, fragments", [
    ("pin_tokens", -1, ("Geometry.pin_tokens", ">= 0", "-1")),
    ("pin_tokens", "3", ("Geometry.pin_tokens", "integer", "'3'")),
    ("pin_tokens", 1.5, ("Geometry.pin_tokens", "integer", "1.5")),
    ("pin_tokens", True, ("Geometry.pin_tokens", "integer", "True")),
    ("window_tokens", -4, ("Geometry.window_tokens", ">= 0", "-4")),
    ("window_tokens", None, ("Geometry.window_tokens", "integer", "None")),
    ("max_staged_tokens", 0, ("Geometry.max_staged_tokens", ">= 1", "0")),
    ("causal_block_sizes", (), ("Geometry.causal_block_sizes", "at least one", "()")),
    ("causal_block_sizes", 4, ("Geometry.causal_block_sizes", "sequence", "4")),
    ("causal_block_sizes", "16", ("Geometry.causal_block_sizes", "sequence", "'16'")),
    ("causal_block_sizes", (16, 0), ("Geometry.causal_block_sizes[1]", ">= 1", "0")),
    ("causal_block_sizes", (16, 2.0), ("Geometry.causal_block_sizes[1]", "integer", "2.0")),
    ("causal_block_sizes", (33,), ("Geometry.causal_block_sizes[0]", "<= max_staged_tokens",
                                   "(32)", "33")),
])
def test_geometry_invalid(field, value, fragments):
    with raises(*fragments):
        geometry(**{field: value})


# --- dtypes, head sizes and pages (ModelSpec's rules) ----------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_model_torch_dtype(dtype):
    torch = pytest.importorskip("torch")
    assert model(dtype=dtype).torch_dtype is getattr(torch, dtype)


@pytest.mark.parametrize("tpp", [1, 2, 64, 1024])
def test_model_tokens_per_page_valid(tpp):
    assert model(tokens_per_page=tpp).tokens_per_page == tpp


@pytest.mark.parametrize("field, value, fragments", [
    ("head_dim", 12, ("ModelSpec.head_dim", "multiple of 8", "12")),
    ("dtype", "int8", ("ModelSpec.dtype", "one of 'bfloat16', 'float16', 'float32'", "'int8'")),
    ("dtype", 16, ("ModelSpec.dtype", "one of", "16")),
    ("tokens_per_page", 48, ("ModelSpec.tokens_per_page", "power of two", "48")),
    ("tokens_per_page", 0, ("ModelSpec.tokens_per_page", ">= 1", "0")),
    ("tokens_per_page", 2048, ("ModelSpec.tokens_per_page", "<= 1024", "2048")),
    ("tokens_per_page", True, ("ModelSpec.tokens_per_page", "integer", "True")),
])
def test_model_cache_fields_invalid(field, value, fragments):
    with raises(*fragments):
        model(**{field: value})


def test_decode_runs_validation():
    data = encode_json(model(), indent=0).replace(b'"tokens_per_page":8', b'"tokens_per_page":48')
    with pytest.raises(msgspec.ValidationError, match="ModelSpec.tokens_per_page must be a "
                                                      "power of two, got 48"):
        decode_json(data, ModelSpec)


# --- ModelSpec -------------------------------------------------------------------------

def test_model_derived():
    m = model(latent_height=6, latent_width=10)
    assert m.tokens_per_frame == 3 * 5
    assert m.patch_dim == 4 * 1 * 2 * 2


@pytest.mark.parametrize("field, value, fragments", [
    ("name", "", ("ModelSpec.name", "not be empty", "''")),
    ("name", 3, ("ModelSpec.name", "string", "3")),
    ("num_layers", 0, ("ModelSpec.num_layers", ">= 1", "0")),
    ("num_heads", 0, ("ModelSpec.num_heads", ">= 1", "0")),
    ("num_kv_heads", 0, ("ModelSpec.num_kv_heads", ">= 1", "0")),
    ("num_kv_heads", 3, ("ModelSpec.num_kv_heads", "divide num_heads (4)", "3")),
    ("hidden_size", 0, ("ModelSpec.hidden_size", ">= 1", "0")),
    ("hidden_size", 48, ("ModelSpec.hidden_size", "num_heads * head_dim", "4 * 16 = 64",
                         "48")),
    ("head_dim", 20, ("ModelSpec.head_dim", "multiple of 8", "20")),
    ("head_dim", -8, ("ModelSpec.head_dim", ">= 1", "-8")),
    ("ffn_size", 0, ("ModelSpec.ffn_size", ">= 1", "0")),
    ("in_channels", 0, ("ModelSpec.in_channels", ">= 1", "0")),
    ("text_dim", 0, ("ModelSpec.text_dim", ">= 1", "0")),
    ("freq_dim", 0, ("ModelSpec.freq_dim", ">= 1", "0")),
    ("freq_dim", 31, ("ModelSpec.freq_dim", "even", "31")),
    ("patch_size", (1, 2), ("ModelSpec.patch_size", "3 entries", "(1, 2)")),
    ("patch_size", 2, ("ModelSpec.patch_size", "sequence", "2")),
    ("patch_size", (1, 0, 2), ("ModelSpec.patch_size[1]", ">= 1", "0")),
    ("patch_size", (2, 2, 2), ("ModelSpec.patch_size[0]", "must be 1", "2")),
    ("latent_height", 7, ("ModelSpec.latent_height", "multiple of the patch size (2)", "7")),
    ("latent_height", 0, ("ModelSpec.latent_height", ">= 1", "0")),
    ("latent_width", 9, ("ModelSpec.latent_width", "multiple of the patch size (2)", "9")),
    ("dtype", "fp8", ("ModelSpec.dtype", "one of", "'fp8'")),
    ("tokens_per_page", 12, ("ModelSpec.tokens_per_page", "power of two", "12")),
    ("seed", -1, ("ModelSpec.seed", ">= 0", "-1")),
])
def test_model_invalid(field, value, fragments):
    with raises(*fragments):
        model(**{field: value})


def test_model_patch_size_list_becomes_tuple():
    assert model(patch_size=[1, 2, 2]).patch_size == (1, 2, 2)


# --- RolloutSpec -----------------------------------------------------------------------

def test_rollout_derived():
    r = rollout()
    assert (r.chunk_tokens, r.window_tokens, r.keys_per_forward) == (32, 48, 6 + 48 + 32)
    assert (r.total_frames, r.total_tokens, r.last_chunk_tokens) == (12, 192, 32)
    assert r.chunk_token_counts() == (32,)
    assert r.geometry() == Geometry(6, 48, 32, (32, 16))


def test_rollout_short_last_chunk():
    r = rollout(frames_per_chunk=3, last_chunk_frames=2, chunks=4)
    assert (r.total_frames, r.last_chunk_tokens) == (11, 32)
    assert r.chunk_token_counts() == (48, 32)
    assert r.geometry() == Geometry(6, 48, 48, (16, 32, 48))


@pytest.mark.parametrize("field, value, fragments", [
    ("tokens_per_frame", 0, ("RolloutSpec.tokens_per_frame", ">= 1", "0")),
    ("frames_per_chunk", 0, ("RolloutSpec.frames_per_chunk", ">= 1", "0")),
    ("window_frames", -1, ("RolloutSpec.window_frames", ">= 0", "-1")),
    ("prompt_tokens", -1, ("RolloutSpec.prompt_tokens", ">= 0", "-1")),
    ("prompt_tokens", "8", ("RolloutSpec.prompt_tokens", "integer", "'8'")),
    ("denoising_steps", 0, ("RolloutSpec.denoising_steps", ">= 1", "0")),
    ("chunks", 0, ("RolloutSpec.chunks", ">= 1", "0")),
    ("last_chunk_frames", -1, ("RolloutSpec.last_chunk_frames", ">= 0", "-1")),
    ("last_chunk_frames", 2, ("RolloutSpec.last_chunk_frames", "<= 1", "2")),
])
def test_rollout_invalid(field, value, fragments):
    with raises(*fragments):
        rollout(**{field: value})


def test_rollout_short_lone_chunk_invalid():
    with raises("RolloutSpec.last_chunk_frames", "0 when chunks is 1", "got 1"):
        rollout(chunks=1, last_chunk_frames=1)


# --- WarmupOptions ----------------------------------------------------------------------

@pytest.mark.parametrize("value, fragments", [
    ("", ("WarmupOptions.cache_dir", "not be empty", "''")),
    (5, ("WarmupOptions.cache_dir", "string", "5")),
])
def test_warmup_options_invalid(value, fragments):
    with raises(*fragments):
        WarmupOptions(cache_dir=value)


# --- Preset ----------------------------------------------------------------------------

def test_preset_derived():
    p = preset(warmup=WarmupOptions(cache_dir="c"))
    assert p.geometry() == rollout().geometry()
    assert p.warmup.cache_dir == "c" and p.description == ""
    assert preset().warmup == WarmupOptions()


@pytest.mark.parametrize("field, value, fragments", [
    ("name", "", ("Preset.name", "not be empty", "''")),
    ("model", rollout(), ("Preset.model", "must be a ModelSpec", "RolloutSpec")),
    ("rollout", None, ("Preset.rollout", "must be a RolloutSpec", "NoneType")),
    ("rollout", rollout(tokens_per_frame=12),
     ("Preset.rollout.tokens_per_frame", "equal Preset.model.tokens_per_frame (16)", "12")),
    ("description", 1, ("Preset.description", "string", "1")),
    ("warmup", None, ("Preset.warmup", "must be a WarmupOptions", "NoneType")),
])
def test_preset_invalid(field, value, fragments):
    with raises(*fragments):
        preset(**{field: value})


# --- shipped presets -------------------------------------------------------------------

def test_list_presets():
    assert list_presets() == list(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_preset_is_named_after_its_file(name):
    p = load_preset(name)
    model = {"small-stream": "wan-1.3b"}.get(name, name)  # the 1.3B model at a small latent
    assert p.name == name and p.model.name == model and p.description
    text = importlib.resources.files("framekv.specs").joinpath(f"presets/{name}.toml").read_text()
    assert text.startswith("# "), "each preset file opens with a comment saying what it is for"


def test_preset_seed_bench():
    p = load_preset("seed-bench")
    m, r = p.model, p.rollout
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size) == (
        36, 32, 8, 128, 4096)
    assert m.tokens_per_frame == 394 and m.dtype == "bfloat16"
    assert r.chunk_tokens == 1576
    assert r.window_tokens == 37824
    assert r.keys_per_forward == 39912
    assert p.geometry() == Geometry(512, 37824, 1576, (1576, 394))
    assert m.tokens_per_page == 32
    assert r.denoising_steps == 4


def test_preset_wan():
    p = load_preset("wan-1.3b")
    m, r = p.model, p.rollout
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size) == (
        30, 12, 12, 128, 1536)
    assert m.tokens_per_frame == 1560
    assert (r.chunk_tokens, r.window_tokens, r.keys_per_forward) == (4680, 28080, 33272)
    assert p.geometry() == Geometry(512, 28080, 4680, (4680, 1560))
    assert m.tokens_per_page == 32


def test_preset_wan_14b():
    p = load_preset("wan-14b")
    m, r = p.model, p.rollout
    assert (m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.hidden_size,
            m.ffn_size) == (40, 40, 40, 128, 5120, 13824)
    assert (m.text_dim, m.freq_dim, m.in_channels, m.patch_size) == (4096, 256, 16, (1, 2, 2))
    assert m.tokens_per_frame == 1560
    # The rollout is wan-1.3b's: only the model differs.
    assert r == load_preset("wan-1.3b").rollout


def test_preset_tiny():
    p = load_preset("tiny")
    m, r = p.model, p.rollout
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads) == (2, 64, 4, 2)
    assert m.tokens_per_frame == 16 and r.chunk_tokens == 32
    tpp = m.tokens_per_page
    # Blocks and windows start mid-page, so the partly visible page paths are exercised.
    assert r.prompt_tokens % tpp and (r.prompt_tokens + r.window_tokens) % tpp
    assert r.chunk_token_counts() == (32,) and p.geometry().causal_block_sizes == (16, 32)


# --- loading files ---------------------------------------------------------------------

def tiny_toml() -> bytes:
    return importlib.resources.files("framekv.specs").joinpath("presets/tiny.toml").read_bytes()


def test_load_preset_by_toml_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_bytes(tiny_toml())
    assert load_preset(path) == load_preset("tiny")
    assert load_preset(str(path)) == load_preset("tiny")


def test_load_preset_by_json_path(tmp_path):
    path = tmp_path / "mine.json"
    path.write_bytes(encode_json(load_preset("wan-1.3b")))
    assert load_preset(str(path)) == load_preset("wan-1.3b")


def test_load_generic(tmp_path):
    path = tmp_path / "model.json"
    path.write_bytes(encode_json(model()))
    assert load(path, type=ModelSpec) == model()
    toml = tmp_path / "geometry.toml"
    toml.write_text("pin_tokens = 6\nwindow_tokens = 48\nmax_staged_tokens = 32\n"
                    "causal_block_sizes = [32, 16, 16]\n")
    assert load(toml, type=Geometry) == geometry()


def test_decode_toml():
    assert decode_toml(tiny_toml(), Preset) == load_preset("tiny")


def test_unknown_preset_lists_available():
    with raises("unknown preset 'nope'",
                "available: seed-bench, small-stream, tiny, wan-1.3b, wan-14b"):
        load_preset("nope")


def test_missing_file_names_path(tmp_path):
    missing = tmp_path / "absent.toml"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_preset(missing)
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load(str(missing), type=ModelSpec)


def test_bad_suffix_names_path(tmp_path):
    path = tmp_path / "preset.yaml"
    path.write_text("name: x\n")
    with raises(str(path), ".toml or .json", "'.yaml'"):
        load(path, type=Preset)


@pytest.mark.parametrize("suffix, text, fragments", [
    (".toml", "name = \n", ()),
    (".json", "{\"name\": ", ()),
    (".toml", tiny_toml().decode().replace("tokens_per_page = 8", "tokens_per_page = 48"),
     ("ModelSpec.tokens_per_page must be a power of two, got 48", "$.model")),
    (".toml", tiny_toml().decode().replace("prompt_tokens = 6", "prompt_tokens = -6"),
     ("RolloutSpec.prompt_tokens must be >= 0, got -6", "$.rollout")),
    (".toml", tiny_toml().decode().replace("chunks = 6", "chunks = 6\nspeed = 2"),
     ("unknown field `speed`", "$.rollout")),
    (".toml", tiny_toml().decode().replace("num_layers = 2", "num_layers = \"two\""),
     ("Expected `int`, got `str`", "$.model.num_layers")),
    (".toml", tiny_toml().decode().replace("latent_width = 8", "latent_width = 6"),
     ("Preset.rollout.tokens_per_frame must equal Preset.model.tokens_per_frame (12), got 16",)),
    (".json", '{"name": "x", "model": {}}', ("missing required field", "$.model")),
    (".toml", tiny_toml().decode() + "\n[bench]\niterations = 3\n", ("unknown field `bench`",)),
])
def test_malformed_file_names_file_and_field(tmp_path, suffix, text, fragments):
    path = tmp_path / f"broken{suffix}"
    path.write_text(text)
    with raises(str(path), *fragments) as info:
        load_preset(path)
    assert isinstance(info.value.__cause__, msgspec.MsgspecError)
