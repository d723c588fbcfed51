"""A real (tiny) tokenizer and UMT5 encoder built locally, and the encoding they give as
an independent reference: one prompt at a time, straight from transformers."""
from __future__ import annotations

import torch

SENTENCES = ["a red fox runs through fresh snow", "a cat sleeps on the warm mat",
             "the dog barks at the moon", "waves crash on a rocky shore at dawn"]
D_MODEL = 16  # the tiny transformer's text_dim


def make_tokenizer():
    """A ``PreTrainedTokenizerFast`` over a word-level vocabulary of `SENTENCES`, T5's
    special ids (pad 0, EOS 1, unknown 2) and an EOS after every text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(
        special_tokens=["<pad>", "</s>", "<unk>"]))
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", special_tokens=[("</s>", tok.token_to_id("</s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>")


def make_encoder(vocab_size: int, seed: int = 0):
    """A random ``UMT5EncoderModel`` of width `D_MODEL` (odd sizes elsewhere: 3 heads of
    5, a 24-wide MLP)."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    cfg = UMT5Config(vocab_size=vocab_size, d_model=D_MODEL, d_kv=5, d_ff=24, num_layers=2,
                     num_heads=3, relative_attention_num_buckets=8,
                     relative_attention_max_distance=16, dropout_rate=0.0)
    return UMT5EncoderModel(cfg).eval()


def save_text_parts(root, seed: int = 0):
    """``root/text_encoder`` and ``root/tokenizer`` as a diffusers folder holds them;
    returns (encoder, tokenizer)."""
    tokenizer = make_tokenizer()
    encoder = make_encoder(len(tokenizer), seed)
    tokenizer.save_pretrained(str(root / "tokenizer"))
    encoder.save_pretrained(str(root / "text_encoder"))
    return encoder, tokenizer


@torch.no_grad()
def reference(encoder, tokenizer, prompts, L: int) -> torch.Tensor:
    """[B, L, D] fp32: each prompt alone through the tokenizer and encoder, its first
    (attention mask sum) rows kept, the rest zero."""
    out = torch.zeros(len(prompts), L, encoder.config.d_model)
    for b, text in enumerate(prompts):
        t = tokenizer([text], padding="max_length", max_length=L, truncation=True,
                      return_tensors="pt")
        n = int(t["attention_mask"].sum())
        hidden = encoder(input_ids=t["input_ids"], attention_mask=t["attention_mask"])
        out[b, :n] = hidden.last_hidden_state[0, :n].float()
    return out
