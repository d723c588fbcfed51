"""Wan weights from local files: Self-Forcing / CausVid generator checkpoints in the
original Wan layout (written by `save_original_checkpoint`, checked against the layout
by hand below) load back to the same model, every way such a file comes; what does not
fit is a ValueError naming it; a diffusers folder loads whole (`load_folder`) and rolls
out from a text prompt."""
from __future__ import annotations

import os

import pytest
import torch

from framekv.engine.wan import (CONFIGS, TextEncoder, WanRollout, build_model, load_folder,
                                load_model, save_original_checkpoint)
from framekv.engine.wan.weights import read_checkpoint
from wan_text_harness import save_text_parts

#: original Wan name -> the diffusers module path of the same tensor, written out by hand
#: from the two models' definitions (independent of diffusers' converter).
BY_HAND = {
    "patch_embedding.weight": "patch_embedding.weight",
    "text_embedding.2.bias": "condition_embedder.text_embedder.linear_2.bias",
    "time_embedding.0.weight": "condition_embedder.time_embedder.linear_1.weight",
    "time_projection.1.weight": "condition_embedder.time_proj.weight",
    "blocks.0.self_attn.q.weight": "blocks.0.attn1.to_q.weight",
    "blocks.1.self_attn.o.bias": "blocks.1.attn1.to_out.0.bias",
    "blocks.1.self_attn.norm_k.weight": "blocks.1.attn1.norm_k.weight",
    "blocks.0.cross_attn.v.weight": "blocks.0.attn2.to_v.weight",
    "blocks.0.norm3.weight": "blocks.0.norm2.weight",          # the cross-attention norm
    "blocks.1.ffn.0.weight": "blocks.1.ffn.net.0.proj.weight",
    "blocks.1.ffn.2.bias": "blocks.1.ffn.net.2.bias",
    "blocks.1.modulation": "blocks.1.scale_shift_table",
    "head.head.weight": "proj_out.weight",
    "head.modulation": "scale_shift_table",
}


def tensor_at(model, name):
    return model.get_parameter(name)


def same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.fixture(scope="module")
def model():
    # on the CPU wherever the tests run: a GPU test compares a load onto CUDA with it
    return build_model("tiny", seed=7, device="cpu")


def test_the_original_layout_and_back(model, tmp_path):
    path = tmp_path / "gen.pt"
    save_original_checkpoint(model, path)
    raw = torch.load(path, weights_only=True)
    assert list(raw) == ["generator_ema"]
    state = raw["generator_ema"]
    assert len(state) == len(model.state_dict()) and all(k.startswith("model.") for k in state)
    assert not any("attn1" in k or "condition_embedder" in k for k in state)
    for orig, ours in BY_HAND.items():
        assert torch.equal(state["model." + orig], tensor_at(model, ours)), orig
    loaded = load_model(path, config="tiny", device="cpu")
    same_weights(model, loaded)
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training


def test_a_checkpoint_that_fails_mid_write_leaves_the_old_one(model, tmp_path, monkeypatch):
    path = tmp_path / "gen.pt"
    save_original_checkpoint(model, path)
    raw = path.read_bytes()

    def half(obj, f):
        with open(f, "wb") as out:
            out.write(b"half a checkpoint")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", half)
    with pytest.raises(OSError, match="disk full"):
        save_original_checkpoint(build_model("tiny", seed=8, device="cpu"), path)
    assert path.read_bytes() == raw and sorted(tmp_path.iterdir()) == [path]


def test_the_loaded_model_computes_the_same(model, tmp_path):
    save_original_checkpoint(model, tmp_path / "gen.pt")
    loaded = load_model(tmp_path / "gen.pt", config="tiny", device="cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 4, 3, 4, 6, generator=g)                 # [B, C, F, H, W], odd F
    text = torch.randn(1, 5, 16, generator=g)
    t = torch.tensor([637.0])
    with torch.no_grad():
        want = model(x, t, text, return_dict=False)[0]
        got = loaded(x, t, text, return_dict=False)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("form", ["generator", "bare", "safetensors", "ema-preferred"])
def test_every_form_of_checkpoint_loads(model, tmp_path, form):
    other = build_model("tiny", seed=8)
    if form == "generator":
        path = tmp_path / "gen.pth"
        save_original_checkpoint(model, path, key="generator")
    elif form == "bare":
        path = tmp_path / "bare.pt"
        save_original_checkpoint(model, path, key=None, prefix="")
        assert "blocks.0.self_attn.q.weight" in torch.load(path, weights_only=True)
    elif form == "safetensors":
        path = tmp_path / "gen.safetensors"
        save_original_checkpoint(model, path)
        assert "head.head.weight" in read_checkpoint(path)    # "model." stripped
    else:
        save_original_checkpoint(model, tmp_path / "a.pt", key=None)
        save_original_checkpoint(other, tmp_path / "b.pt", key=None)
        path = tmp_path / "both.pt"
        torch.save({"generator": torch.load(tmp_path / "b.pt", weights_only=True),
                    "generator_ema": torch.load(tmp_path / "a.pt", weights_only=True),
                    "step": torch.tensor(3)}, path)
        same_weights(other, load_model(path, config="tiny", key="generator", device="cpu"))
    same_weights(model, load_model(path, config="tiny", device="cpu"))


def test_safetensors_keys_are_the_original_layout(model, tmp_path):
    from safetensors.torch import load_file

    save_original_checkpoint(model, tmp_path / "gen.safetensors", prefix="model.")
    state = load_file(tmp_path / "gen.safetensors")
    for orig, ours in BY_HAND.items():
        assert torch.equal(state["model." + orig], tensor_at(model, ours)), orig


def test_config_as_a_dict_or_a_folder_and_the_dtypes(model, tmp_path):
    save_original_checkpoint(model, tmp_path / "gen.pt")
    model.save_pretrained(tmp_path / "folder" / "transformer")
    same_weights(model, load_model(tmp_path / "gen.pt", config=dict(CONFIGS["tiny"]), device="cpu"))
    same_weights(model, load_model(tmp_path / "gen.pt", config=tmp_path / "folder", device="cpu"))
    # a bf16 file: the modules diffusers keeps in fp32 come back fp32, the rest in dtype
    raw = torch.load(tmp_path / "gen.pt", weights_only=True)["generator_ema"]
    torch.save({"generator_ema": {k: v.bfloat16() for k, v in raw.items()}}, tmp_path / "bf.pt")
    m = load_model(tmp_path / "bf.pt", config="tiny", dtype=torch.bfloat16, device="cpu")
    assert m.scale_shift_table.dtype == m.blocks[0].norm2.weight.dtype == torch.float32
    assert m.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    assert m.blocks[0].attn1.to_q.weight.dtype == m.proj_out.weight.dtype == torch.bfloat16
    torch.testing.assert_close(m.blocks[0].attn1.to_q.weight,
                               model.blocks[0].attn1.to_q.weight.bfloat16(), atol=0, rtol=0)


def test_packed_or_fused_projections_save_the_plain_weights(tmp_path):
    m = build_model("tiny", seed=9)
    WanRollout(m, latent_size=(4, 4), frames_per_chunk=2, window_frames=2, use_graphs=False)
    m.fuse_qkv_projections()                                  # adds to_qkv copies
    save_original_checkpoint(m, tmp_path / "gen.safetensors")  # shared storage: copied out
    loaded = load_model(tmp_path / "gen.safetensors", config="tiny", device="cpu")
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, m.state_dict()[k]), k


def test_what_does_not_fit_is_named(model, tmp_path):
    save_original_checkpoint(model, tmp_path / "gen.pt")
    state = torch.load(tmp_path / "gen.pt", weights_only=True)["generator_ema"]
    broken = dict(state)
    del broken["model.blocks.1.ffn.0.bias"]
    broken["model.blocks.0.extra.weight"] = torch.zeros(3)
    torch.save({"generator_ema": broken}, tmp_path / "broken.pt")
    with pytest.raises(ValueError, match=r"1 missing keys \['blocks\.1\.ffn\.0\.bias'\], 1 "
                                         r"unexpected keys \['blocks\.0\.extra\.weight'\]"):
        load_model(tmp_path / "broken.pt", config="tiny")
    bad = dict(state, **{"model.blocks.0.self_attn.q.weight": torch.zeros(24, 23)})
    torch.save(bad, tmp_path / "shape.pt")
    with pytest.raises(ValueError, match=r"blocks\.0\.self_attn\.q\.weight \(blocks\.0\.attn1\."
                                         r"to_q\.weight\) has shape \[24, 23\], the model's "
                                         r"is \[24, 24\]"):
        load_model(tmp_path / "shape.pt", config="tiny")
    with pytest.raises(ValueError, match=r"missing keys \['blocks\.2\.modulation'.*needs config="):
        load_model(tmp_path / "gen.pt")                        # the default config is 1.3b


def test_argument_errors(model, tmp_path):
    save_original_checkpoint(model, tmp_path / "gen.pt")
    with pytest.raises(ValueError, match="config must be one of .*, got 'huge'"):
        load_model(tmp_path / "gen.pt", config="huge")
    with pytest.raises(ValueError, match="key 'critic' is not a state dict entry"):
        load_model(tmp_path / "gen.pt", config="tiny", key="critic")
    torch.save({"step": 3}, tmp_path / "nothing.pt")
    with pytest.raises(ValueError, match="holds no state dict"):
        load_model(tmp_path / "nothing.pt", config="tiny")
    (tmp_path / "gen.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match=r"must be a \.pt, \.pth or \.safetensors file"):
        load_model(tmp_path / "gen.bin", config="tiny")
    (tmp_path / "torn.pt").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="cannot read checkpoint"):
        load_model(tmp_path / "torn.pt", config="tiny")
    with pytest.raises(ValueError, match=r"path must end in \.pt, \.pth or \.safetensors"):
        save_original_checkpoint(model, tmp_path / "out.ckpt")
    with pytest.raises(ValueError, match="must be a diffusers WanTransformer3DModel"):
        save_original_checkpoint(torch.nn.Linear(2, 2), tmp_path / "out.pt")


def test_a_failed_save_leaves_nothing(model, tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError, match="disk full"):
        save_original_checkpoint(model, tmp_path / "gen.pt")
    assert os.listdir(tmp_path) == []


# --- a diffusers folder ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def folder(tmp_path_factory, model):
    from framekv.engine.wan.vae import build_vae

    root = tmp_path_factory.mktemp("wan_folder")
    model.save_pretrained(root / "transformer")
    vae = build_vae("tiny", device="cpu", seed=1)
    vae.save_pretrained(root / "vae")
    encoder, tokenizer = save_text_parts(root, seed=2)
    return root, vae, encoder, tokenizer


def test_load_folder(folder, model, tmp_path):
    root, vae, encoder, _ = folder
    parts = load_folder(root, device="cpu", max_tokens=6)
    same_weights(model, parts.transformer)
    for (na, a), (nb, b) in zip(vae.state_dict().items(), parts.vae.state_dict().items()):
        assert na == nb and torch.equal(a, b), na
    assert isinstance(parts.text_encoder, TextEncoder) and parts.text_encoder.max_tokens == 6
    for (na, a), (nb, b) in zip(encoder.state_dict().items(),
                                parts.text_encoder.encoder.state_dict().items()):
        assert na == nb and torch.equal(a, b), na
    (tmp_path / "only" / "transformer").mkdir(parents=True)
    model.save_pretrained(tmp_path / "only" / "transformer")
    bare = load_folder(tmp_path / "only", device="cpu")
    assert bare.vae is None and bare.text_encoder is None
    (tmp_path / "novae" / "vae").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"lacks transformer/, text_encoder/, tokenizer/"):
        load_folder(tmp_path / "novae")


def test_a_folder_rolls_out_from_text(folder, model, tmp_path):
    root = folder[0]
    kw = dict(latent_size=(4, 6), frames_per_chunk=2, window_frames=2, prompt_tokens=6,
              use_graphs=False, device="cpu")
    r = WanRollout.from_pretrained(root, **kw)
    assert r.text_encoder.max_tokens == 6
    r.set_prompt("a cat")
    noise = torch.randn(1, 4, 2, 4, 6, generator=torch.Generator().manual_seed(3))
    x = r.step(noise)
    want = WanRollout(load_model(root, device="cpu"), **kw)
    want.set_prompt(r.text_encoder.encode("a cat"))
    assert torch.equal(x, want.step(noise))
    # a checkpoint with the folder as its config takes the folder's text encoder too (its
    # tensors sit at other addresses than the folder's memory-mapped ones: the CPU GEMMs
    # may round differently, hence a tolerance)
    save_original_checkpoint(model, tmp_path / "gen.pt")
    r = WanRollout.from_pretrained(tmp_path / "gen.pt", config=root, **kw)
    r.set_prompt("a cat")
    torch.testing.assert_close(r.step(noise), x, atol=1e-5, rtol=0)
    assert WanRollout.from_pretrained(root, text_encoder=False, **kw).text_encoder is None


@pytest.mark.gpu
def test_a_checkpoint_onto_the_gpu(model, tmp_path):
    save_original_checkpoint(model, tmp_path / "gen.pt")
    m = load_model(tmp_path / "gen.pt", config="tiny", device="cuda")
    assert m.proj_out.weight.device.type == "cuda" and m.proj_out.weight.dtype == torch.bfloat16
    assert m.scale_shift_table.dtype == torch.float32
    torch.testing.assert_close(m.proj_out.weight.float().cpu(), model.proj_out.weight,
                               atol=1e-2, rtol=1e-2)
