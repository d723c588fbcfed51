"""Prompts as text: `TextEncoder` against transformers' encoder and tokenizer run one
prompt at a time (`wan_text_harness.reference`), its cache, its random stand-in, and
`WanRollout` taking text as it takes the same embeddings."""
from __future__ import annotations

import pytest
import torch

from framekv.engine.wan import CONFIGS, TEXT_CONFIGS, TextEncoder, WanRollout, build_model
from framekv.engine.wan.text import ByteTokenizer, clean_prompt
from wan_text_harness import reference, save_text_parts

PROMPTS = ["a red fox runs", "the cat sleeps on the warm mat at dawn", "waves"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan_text")
    encoder, tokenizer = save_text_parts(root, seed=3)
    return root, encoder, tokenizer


def test_encode_equals_the_encoder_run_prompt_by_prompt(folder):
    root, encoder, tokenizer = folder
    enc = TextEncoder.from_pretrained(root, max_tokens=11, device="cpu")
    got = enc.encode(PROMPTS)
    want = reference(encoder, tokenizer, PROMPTS, 11)
    assert got.shape == (3, 11, 16) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    lengths = [len(p.split()) + 1 for p in PROMPTS]           # words + EOS
    for row, n in zip(got, lengths):
        assert bool((row[:n].abs().sum(-1) > 0).all()) and not row[n:].any()
    assert torch.equal(enc(PROMPTS[0]), got[:1])              # __call__, a str: the cached rows


def test_long_prompts_truncate_to_max_tokens(folder):
    root, encoder, tokenizer = folder
    enc = TextEncoder.from_pretrained(root, max_tokens=5, device="cpu")
    long = "a cat sleeps on the warm mat"                      # 7 words + EOS > 5
    got = enc.encode(long)
    ids = tokenizer([long], padding="max_length", max_length=5, truncation=True)["input_ids"][0]
    assert ids[-1] == tokenizer.eos_token_id                  # truncated, EOS kept
    assert bool((got[0].abs().sum(-1) > 0).all())             # every row a token
    torch.testing.assert_close(got, reference(encoder, tokenizer, [long], 5), atol=2e-6, rtol=0)
    # what is cut off does not reach the kept tokens (one prompt, the same 4 words)
    assert torch.equal(enc.encode(long + " the dog barks"), got)
    assert not torch.equal(enc.encode("a dog sleeps on the warm mat"), got)   # a kept word


def test_a_batch_equals_each_prompt_alone(folder):
    root, _, _ = folder
    enc = TextEncoder.from_pretrained(root, max_tokens=9, device="cpu", cache_size=0)
    batch = enc.encode(PROMPTS)
    for i, p in enumerate(PROMPTS):
        torch.testing.assert_close(enc.encode(p)[0], batch[i], atol=1e-6, rtol=0)


def test_prompts_are_cleaned_as_the_pipeline_cleans_them(folder):
    root, _, _ = folder
    enc = TextEncoder.from_pretrained(root, max_tokens=9, device="cpu", cache_size=0)
    assert clean_prompt("  a  red\n fox &amp;amp; the\tcat ") == "a red fox & the cat"
    assert torch.equal(enc.encode("  a  red\n fox   runs "), enc.encode("a red fox runs"))


def test_the_cache_encodes_a_text_once_and_stays_bounded(folder):
    root, _, _ = folder
    enc = TextEncoder.from_pretrained(root, max_tokens=7, device="cpu", cache_size=2)
    calls = []
    enc.encoder.register_forward_hook(lambda m, a, out: calls.append(a[0].shape[0]))
    first = enc.encode(["a red fox", "waves", "a red fox"])
    assert calls == [2] and torch.equal(first[0], first[2])   # one run of the 2 distinct texts
    first.zero_()                                             # the caller's copy, not the cache's
    again = enc.encode("a red fox")
    assert calls == [2] and again.abs().sum() > 0
    enc.encode("the dog")                                     # a third text: "waves" goes
    assert list(enc._cache) == ["a red fox", "the dog"]
    enc.encode("waves")
    assert calls == [2, 1, 1]
    enc.clear_cache()
    enc.encode("waves")
    assert calls == [2, 1, 1, 1]


def test_random_weights_and_the_byte_tokenizer():
    t = ByteTokenizer()(["hé"], max_length=6)
    assert t["input_ids"].tolist() == [[104 + 3, 0xC3 + 3, 0xA9 + 3, 1, 0, 0]]
    assert t["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0]]
    t = ByteTokenizer()(["abcdef"], max_length=4)
    assert t["input_ids"].tolist() == [[97 + 3, 98 + 3, 99 + 3, 1]]   # truncated, EOS kept
    a = TextEncoder.from_config("tiny", seed=1, max_tokens=7, device="cpu")
    b = TextEncoder.from_config("tiny", seed=1, max_tokens=7, device="cpu")
    c = TextEncoder.from_config("tiny", seed=2, max_tokens=7, device="cpu")
    x = a.encode(["a fox", "dawn"])
    assert x.shape == (2, 7, CONFIGS["tiny"]["text_dim"]) and not x[0, 6:].any()
    assert torch.equal(x, b.encode(["a fox", "dawn"]))
    assert not torch.equal(x, c.encode(["a fox", "dawn"]))
    assert TEXT_CONFIGS["1.3b"]["d_model"] == CONFIGS["1.3b"]["text_dim"]
    assert TEXT_CONFIGS["14b"]["d_model"] == CONFIGS["14b"]["text_dim"]
    assert a.encode("x").dtype == torch.float32
    assert TextEncoder.from_config("tiny", dtype=torch.bfloat16, device="cpu").encode("x").dtype \
        == torch.bfloat16


def test_argument_errors(folder, tmp_path):
    root, _, _ = folder
    with pytest.raises(ValueError, match="is not a local folder"):
        TextEncoder.from_pretrained(tmp_path / "missing")
    (tmp_path / "half" / "text_encoder").mkdir(parents=True)
    (tmp_path / "half" / "text_encoder" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"lacks tokenizer/"):
        TextEncoder.from_pretrained(tmp_path / "half")
    with pytest.raises(ValueError, match=r"lacks text_encoder/ .* and tokenizer/"):
        TextEncoder.from_pretrained(tmp_path)
    enc = TextEncoder.from_config("tiny", max_tokens=4, device="cpu")
    with pytest.raises(ValueError, match="prompts must be a str or a non-empty list of str"):
        enc.encode([])
    with pytest.raises(ValueError, match="prompts must be a str or a non-empty list of str"):
        enc.encode(["ok", 3])
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        TextEncoder(enc.encoder, enc.tokenizer, max_tokens=0)
    with pytest.raises(ValueError, match="config must be one of"):
        TextEncoder.from_config("huge")
    with pytest.raises(ValueError, match="vocab_size must hold ByteTokenizer's ids"):
        TextEncoder.from_config({**TEXT_CONFIGS["tiny"], "vocab_size": 100})
    with pytest.raises(ValueError, match="ByteTokenizer pads to max_length"):
        ByteTokenizer()(["a"], max_length=3, padding="longest")


# --- WanRollout with text -------------------------------------------------------------------

SIZES = dict(latent_size=(4, 6), frames_per_chunk=2, window_frames=2, timesteps=(1000, 500),
             use_graphs=False)


def _steps(r, chunks=2):
    gen = torch.Generator().manual_seed(4)
    return [r.step(torch.randn(1, 4, 2, 4, 6, generator=gen)) for _ in range(chunks)]


@pytest.mark.parametrize("guidance", [None, 3.0])
def test_a_text_prompt_is_its_embeddings(guidance):
    enc = TextEncoder.from_config("tiny", seed=5, max_tokens=6, device="cpu")
    by_text = WanRollout(build_model("tiny", seed=2), **SIZES, guidance_scale=guidance,
                         text_encoder=enc)
    by_embeds = WanRollout(build_model("tiny", seed=2), **SIZES, guidance_scale=guidance,
                           prompt_tokens=6)
    assert by_text.prompt_shape == (6, 16)                    # L from the encoder
    by_text.set_prompt("a red fox")
    negative = enc.encode("") if guidance else None           # the pipeline's default negative
    by_embeds.set_prompt(enc.encode("a red fox"), negative)
    for a, b in zip(_steps(by_text), _steps(by_embeds)):
        assert torch.equal(a, b)
    if guidance:
        by_text.set_prompt("a red fox", "blurry")
        by_embeds.set_prompt(enc.encode("a red fox"), enc.encode("blurry"))
        for a, b in zip(_steps(by_text), _steps(by_embeds)):
            assert torch.equal(a, b)
        # zeros (the embeddings' default negative) are not the encoded ""
        assert enc.encode("").abs().sum() > 0


def test_rollout_text_errors():
    m = build_model("tiny")
    r = WanRollout(m, **SIZES, prompt_tokens=6)
    with pytest.raises(ValueError, match="a text prompt needs a text encoder: pass text_encoder="):
        r.set_prompt("a red fox")
    enc = TextEncoder.from_config("tiny", max_tokens=8, device="cpu")
    with pytest.raises(ValueError, match=r"max_tokens \(8\) must equal prompt_tokens \(6\)"):
        WanRollout(m, **SIZES, prompt_tokens=6, text_encoder=enc)
    wide = TextEncoder.from_config({**TEXT_CONFIGS["tiny"], "d_model": 12}, device="cpu")
    with pytest.raises(ValueError, match=r"d_model \(12\) must equal the model's text_dim \(16\)"):
        WanRollout(m, **SIZES, text_encoder=wide)
    with pytest.raises(ValueError, match="text_encoder must be None or a TextEncoder"):
        WanRollout(m, **SIZES, text_encoder="random")
    with pytest.raises(ValueError, match="text_encoder must be None, a TextEncoder or 'random'"):
        WanRollout.from_config("tiny", text_encoder="umt5", use_graphs=False)
    r = WanRollout(build_model("tiny"), **SIZES, text_encoder=enc)
    with pytest.raises(ValueError, match="needs guidance_scale"):
        r.set_prompt("a red fox", "blurry")


def test_from_config_with_a_random_encoder():
    r = WanRollout.from_config("tiny", text_encoder="random", use_graphs=False, device="cpu")
    assert r.text_encoder.max_tokens == r.prompt_shape[0] == 6  # the tiny preset's L
    r.set_prompt("a red fox")
    x = r.step(torch.randn(1, *r.chunk_shape))
    assert torch.isfinite(x).all()


@pytest.mark.gpu
def test_text_prompts_on_the_gpu(folder):
    # One folder's weights on both devices: random weights are drawn on their device
    # (`TextEncoder.from_config`), so one seed is not one set of weights across devices.
    root = folder[0]
    cpu = TextEncoder.from_pretrained(root, max_tokens=6, device="cpu")
    gpu = TextEncoder.from_pretrained(root, max_tokens=6, device="cuda")
    x = gpu.encode(PROMPTS)
    assert x.dtype == torch.bfloat16 and x.device.type == "cuda"
    torch.testing.assert_close(x.float().cpu(), cpu.encode(PROMPTS), atol=0.1, rtol=0.05)
    r = WanRollout.from_config("tiny", text_encoder="random", device="cuda")
    r.set_prompt("a red fox")
    assert torch.isfinite(r.step(torch.randn(1, *r.chunk_shape, device="cuda")).float()).all()
    r.close()
