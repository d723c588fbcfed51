"""Prompts as text: `TextEncoder`, a UMT5 encoder and its tokenizer, encoding text the
way diffusers' ``WanPipeline`` does::

    text -> cleaned (ftfy where installed, HTML unescaped twice, runs of whitespace one
            space) -> token ids padded to max_tokens (truncated, the EOS kept) and the
            attention mask -> UMT5 encoder -> last hidden states
         -> [B, max_tokens, d_model] in the encoder's dtype: each prompt's first
            mask.sum() vectors, zeros after them

``max_tokens`` is the L of a rollout's prompts (``prompt_tokens``). The same text is
encoded once: a bounded cache keyed by the text (least recently used out first) holds
the [L, d_model] rows. Weights come from a local diffusers folder (``text_encoder/`` and
``tokenizer/``), never fetched, or are random from a config (`TEXT_CONFIGS`); random
weights come with `ByteTokenizer`, a stand-in tokenizer for random weights only.
transformers is imported on first use (``pip install 'framekv[wan]'``).
"""
from __future__ import annotations

import collections
import html
import os
import re

import torch

__all__ = ["TEXT_CONFIGS", "ByteTokenizer", "TextEncoder", "clean_prompt"]

#: transformers ``UMT5Config`` keyword arguments by name. "1.3b" is google/umt5-xxl, the
#: text encoder of Wan 2.1 (d_model 4096: the 1.3B transformer's text_dim); "tiny" has
#: the tiny transformer's text_dim (16) and a vocabulary that holds `ByteTokenizer`'s ids.
TEXT_CONFIGS = {
    "tiny": dict(vocab_size=384, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                 relative_attention_num_buckets=8, relative_attention_max_distance=16,
                 feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6, dropout_rate=0.0),
    "1.3b": dict(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                 num_decoder_layers=24, num_heads=64, relative_attention_num_buckets=32,
                 relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                 layer_norm_epsilon=1e-6, dropout_rate=0.1, tie_word_embeddings=False),
}
#: Wan 2.1 T2V 14B reads the same encoder (its text_dim is 4096 too).
TEXT_CONFIGS["14b"] = TEXT_CONFIGS["1.3b"]

#: Files of which one marks a folder as holding a tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "spiece.model")


def clean_prompt(text: str) -> str:
    """``text`` as ``WanPipeline`` cleans a prompt before tokenising it: ftfy's fixes
    (where ftfy is installed), HTML entities unescaped twice, whitespace runs one space,
    the ends stripped."""
    try:
        import ftfy
    except ImportError:
        ftfy = None
    if ftfy is not None:
        text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip()


class ByteTokenizer:
    """For random weights only: a deterministic tokenizer with no vocabulary file. A
    text's UTF-8 bytes are its tokens (id = byte + 3, after pad 0, EOS 1 and unknown 2),
    then the EOS; called like a transformers tokenizer (padding to ``max_length``,
    truncation keeping the EOS, the attention mask, torch tensors)."""

    pad_token_id, eos_token_id, unk_token_id = 0, 1, 2
    offset = 3
    vocab_size = 256 + offset

    def __call__(self, texts, *, padding="max_length", max_length: int, truncation: bool = True,
                 add_special_tokens: bool = True, return_attention_mask: bool = True,
                 return_tensors="pt") -> dict:
        """{"input_ids", "attention_mask"}: int64 [B, max_length] of ``texts``."""
        if padding != "max_length" or return_tensors != "pt" or not truncation:
            raise ValueError("ByteTokenizer pads to max_length, truncates and returns torch "
                             f"tensors; got padding={padding!r}, truncation={truncation!r}, "
                             f"return_tensors={return_tensors!r}")
        texts = [texts] if isinstance(texts, str) else list(texts)
        ids = torch.full((len(texts), max_length), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for row, text in enumerate(texts):
            tokens = [b + self.offset for b in text.encode("utf-8")]
            keep = max_length - 1 if add_special_tokens else max_length
            tokens = tokens[:keep] + ([self.eos_token_id] if add_special_tokens else [])
            ids[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
            mask[row, :len(tokens)] = 1
        return {"input_ids": ids, "attention_mask": mask}


class TextEncoder:
    """A UMT5 encoder and its tokenizer: text to prompt embeddings (module doc).

    Args:
        encoder: a transformers ``UMT5EncoderModel`` (any module called as
            ``encoder(input_ids, attention_mask)`` returning ``last_hidden_state``,
            with a ``config.d_model``).
        tokenizer: a transformers tokenizer (or `ByteTokenizer`).
        max_tokens: L, the tokens of every encoded prompt.
        cache_size: prompts whose embeddings are kept (0: none).

    Attributes:
        encoder, tokenizer, max_tokens, cache_size.
    """

    def __init__(self, encoder, tokenizer, *, max_tokens: int = 512, cache_size: int = 64):
        for name, v, low in (("max_tokens", max_tokens, 1), ("cache_size", cache_size, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")
        self.encoder = encoder.eval().requires_grad_(False)
        self.tokenizer, self.max_tokens, self.cache_size = tokenizer, max_tokens, cache_size
        self._cache: collections.OrderedDict[str, torch.Tensor] = collections.OrderedDict()

    @property
    def d_model(self) -> int:
        """The width of an embedding (a transformer's ``text_dim``)."""
        return self.encoder.config.d_model

    @property
    def dtype(self) -> torch.dtype:
        return next(self.encoder.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.encoder.parameters()).device

    @classmethod
    def from_pretrained(cls, path, *, max_tokens: int = 512, dtype=None, device=None,
                        cache_size: int = 64) -> "TextEncoder":
        """The encoder and tokenizer of a local folder, never fetched: a diffusers folder
        with ``text_encoder/`` and ``tokenizer/`` subfolders, or one folder holding both.
        ``dtype``: default bf16 on CUDA, fp32 on CPU. ValueError naming what is missing."""
        import transformers

        from framekv.ops import resolve_device

        enc_dir, tok_dir = _text_folders(path)
        dev = resolve_device(device)
        dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        # transformers 5 names the load dtype ``dtype``, 4.x ``torch_dtype``.
        dkey = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
        encoder = transformers.UMT5EncoderModel.from_pretrained(
            enc_dir, local_files_only=True, **{dkey: dtype})
        tokenizer = transformers.AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        return cls(encoder.to(dev), tokenizer, max_tokens=max_tokens, cache_size=cache_size)

    @classmethod
    def from_config(cls, config="tiny", *, seed: int = 0, max_tokens: int = 512, dtype=None,
                    device=None, cache_size: int = 64) -> "TextEncoder":
        """A randomly initialised UMT5 encoder of a `TEXT_CONFIGS` name or a ``UMT5Config``
        keyword dict, with `ByteTokenizer` (random weights have no tokenizer of their
        own). ``dtype``: default bf16 on CUDA, fp32 on CPU. The weights are drawn on
        ``device`` by its own generator: one ``seed`` gives one set of weights per device
        kind (save them, or use `from_pretrained`, for the same weights on another)."""
        from transformers import UMT5Config, UMT5EncoderModel

        from framekv.ops import resolve_device

        cfg = TEXT_CONFIGS.get(config) if isinstance(config, str) else (
            dict(config) if isinstance(config, dict) else None)
        if cfg is None:
            raise ValueError(f"config must be one of {sorted(TEXT_CONFIGS)} or a UMT5Config "
                             f"keyword dict, got {config!r}")
        if cfg.get("vocab_size", 0) < ByteTokenizer.vocab_size:
            raise ValueError(f"config's vocab_size must hold ByteTokenizer's ids "
                             f"(>= {ByteTokenizer.vocab_size}), got {cfg.get('vocab_size')!r}")
        dev = resolve_device(device)
        dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
        torch.manual_seed(seed)
        with torch.device(dev):
            encoder = UMT5EncoderModel(UMT5Config(**cfg))
        return cls(encoder.to(dtype), ByteTokenizer(), max_tokens=max_tokens,
                   cache_size=cache_size)

    @torch.no_grad()
    def encode(self, prompts) -> torch.Tensor:
        """[B, max_tokens, d_model] embeddings of ``prompts`` (a str, or a list of B),
        in the encoder's dtype and on its device (module doc)."""
        texts = [prompts] if isinstance(prompts, str) else prompts
        if (not isinstance(texts, (list, tuple)) or not texts
                or not all(isinstance(t, str) for t in texts)):
            raise ValueError(f"prompts must be a str or a non-empty list of str, got {prompts!r}")
        if self.cache_size == 0:
            return self._run(list(texts))
        todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
        if todo:
            for text, rows in zip(todo, self._run(todo)):
                self._cache[text] = rows
        for text in texts:
            self._cache.move_to_end(text)
        out = torch.stack([self._cache[t] for t in texts])                  # [B, L, D]
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return out

    __call__ = encode

    def clear_cache(self) -> None:
        """Forget every cached prompt."""
        self._cache.clear()

    def _run(self, texts: list[str]) -> torch.Tensor:
        """The encoder over ``texts``: [B, L, D], each prompt's rows past its tokens zero."""
        L = self.max_tokens
        tokens = self.tokenizer([clean_prompt(t) for t in texts], padding="max_length",
                                max_length=L, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        ids, mask = tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
        hidden = self.encoder(ids, mask).last_hidden_state                   # [B, L, D]
        lengths = mask.gt(0).sum(dim=1)                                      # [B]
        keep = torch.arange(L, device=hidden.device)[None] < lengths[:, None]  # [B, L]
        return torch.where(keep[..., None], hidden, hidden.new_zeros(())).to(self.dtype)


def has_text_encoder(path) -> bool:
    """Whether a local folder holds a text encoder or a tokenizer (as `_text_folders`
    looks for them)."""
    root = os.fspath(path)
    return os.path.isdir(root) and any(os.path.isdir(os.path.join(root, s))
                                       for s in ("text_encoder", "tokenizer"))


def _text_folders(path) -> tuple[str, str]:
    """(encoder folder, tokenizer folder) of a local folder (`TextEncoder.from_pretrained`);
    ValueError naming what is missing."""
    root = os.fspath(path)
    if not os.path.isdir(root):
        raise ValueError(f"text encoder path {root!r} is not a local folder (nothing is "
                         "downloaded)")
    enc = os.path.join(root, "text_encoder")
    enc = enc if os.path.isdir(enc) else root
    tok = os.path.join(root, "tokenizer")
    tok = tok if os.path.isdir(tok) else root
    missing = []
    if not os.path.isfile(os.path.join(enc, "config.json")):
        missing.append("text_encoder/ (a UMT5 encoder's config.json and weights)")
    if not any(os.path.isfile(os.path.join(tok, f)) for f in _TOKENIZER_FILES):
        missing.append(f"tokenizer/ (one of {', '.join(_TOKENIZER_FILES)})")
    if missing:
        raise ValueError(f"text encoder path {root!r} lacks {' and '.join(missing)}")
    return enc, tok
