"""Wan weights from local files, never fetched: a diffusers folder, or a generator
checkpoint of Self-Forcing / CausVid in the original Wan layout.

- `load_model`: a ``WanTransformer3DModel`` from a diffusers folder, or from a ``.pt`` /
  ``.pth`` (``torch.load`` with ``weights_only``) or ``.safetensors`` checkpoint: a bare
  state dict, or a dict holding one under ``generator_ema`` (preferred) or
  ``generator``, keys with or without a ``model.`` prefix, in the original layout
  (``blocks.N.self_attn.q.weight``, ``head.modulation``, ...). diffusers' own converter
  (``convert_wan_transformer_to_diffusers``) renames the keys; every key of the model
  must come from the file and every key of the file must land in the model, at the
  model's shape, else a ValueError listing the keys.
- `save_original_checkpoint`: the inverse, a model's weights in the original layout. The
  inverse names come from running diffusers' converter over the original model's
  parameter names (`original_names`), so the two directions cannot drift apart.
- `load_folder`: a diffusers folder's transformer, VAE and text encoder (`WanWeights`).

Dtypes: weights load as stored, then the model is cast to ``dtype`` (default bf16 on
CUDA, fp32 on CPU) except the modules diffusers keeps in fp32, which are fp32.
"""
from __future__ import annotations

import dataclasses
import os
import re

import torch

from ..files import written_whole
from .setup import CONFIGS, _cast, check_model

__all__ = ["WanWeights", "load_folder", "load_model", "original_names", "read_checkpoint",
           "save_original_checkpoint"]

#: Entries of a training checkpoint that hold a generator's state dict, the first found
#: is loaded (the EMA weights are the ones Self-Forcing and CausVid sample with).
GENERATOR_KEYS = ("generator_ema", "generator")

_ATTN = [f"{p}.{w}" for p in "qkvo" for w in ("weight", "bias")] + [
    "norm_q.weight", "norm_k.weight"]
#: The original Wan 2.1 ``WanModel``'s parameter names (one block's, and the rest): the
#: names diffusers' converter reads. Not every model has all (no ``norm3`` without
#: cross_attn_norm); `original_names` keeps the ones a model has.
_ORIGINAL_BLOCK = ([f"self_attn.{n}" for n in _ATTN] + [f"cross_attn.{n}" for n in _ATTN]
                   + ["norm3.weight", "norm3.bias", "ffn.0.weight", "ffn.0.bias",
                      "ffn.2.weight", "ffn.2.bias", "modulation"])
_ORIGINAL_TOP = [f"{m}.{w}" for m in ("patch_embedding", "text_embedding.0", "text_embedding.2",
                                      "time_embedding.0", "time_embedding.2",
                                      "time_projection.1", "head.head")
                 for w in ("weight", "bias")] + ["head.modulation"]
#: Modules diffusers adds when it fuses projections: copies of to_q/to_k/to_v, not saved.
_FUSED = ("to_qkv", "to_kv", "to_added_qkv")


@dataclasses.dataclass
class WanWeights:
    """The parts of a local diffusers Wan folder (`load_folder`); None where absent."""

    transformer: object
    vae: object | None
    text_encoder: object | None


def _default_dtype(device):
    from framekv.ops import resolve_device

    dev = resolve_device(device)
    return dev, (torch.bfloat16 if dev.type == "cuda" else torch.float32)


def load_model(path, *, dtype=None, device=None, config=None, key: str | None = None):
    """A ``WanTransformer3DModel`` from local weights (module doc): a diffusers folder
    (its ``transformer`` subfolder when there is one), or a generator checkpoint file
    with ``config`` its shape (a `CONFIGS` name, default "1.3b"; a config dict; or a
    local diffusers folder) and ``key`` the entry holding the state dict (default
    `GENERATOR_KEYS`, else the bare dict)."""
    from diffusers import WanTransformer3DModel

    dev, default = _default_dtype(device)
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ValueError(f"weights {path!r} do not exist (nothing is downloaded)")
    if os.path.isdir(path):
        sub = "transformer" if os.path.isdir(os.path.join(path, "transformer")) else None
        model = WanTransformer3DModel.from_pretrained(path, subfolder=sub, local_files_only=True)
    else:
        try:
            model = _from_checkpoint(path, "1.3b" if config is None else config, key)
        except ValueError as exc:
            if config is not None:
                raise
            raise ValueError(f"{exc}; a single-file checkpoint needs config=<one of "
                             f"{sorted(CONFIGS)}, a config dict or a local diffusers folder> "
                             "of its shape unless it is Wan 2.1 1.3B (the default)") from exc
    return _cast(model, dtype or default).to(dev).eval().requires_grad_(False)


def read_checkpoint(path, *, key: str | None = None) -> dict[str, torch.Tensor]:
    """The state dict of a checkpoint file in the original layout, its ``model.``
    prefixes stripped (``key``: the entry holding it; default `GENERATOR_KEYS`, else the
    file's dict itself). ValueError for a file it cannot read or a dict of no weights."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".pt", ".pth", ".safetensors"):
        raise ValueError(f"a checkpoint must be a .pt, .pth or .safetensors file, got {path!r}")
    try:
        if ext == ".safetensors":
            from safetensors.torch import load_file

            raw = load_file(path, device="cpu")
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch and safetensors raise many types for a bad file
        raise ValueError(f"cannot read checkpoint {path!r}: {_read_error(exc)}") from None
    state = _select(raw, key, path)
    # "model.diffusion_model." is diffusers' converter's own prefix: it strips it.
    return {(k[len("model."):] if k.startswith("model.") and not
             k.startswith("model.diffusion_model.") else k): v for k, v in state.items()}


def _read_error(exc: Exception) -> str:
    """Why a checkpoint could not be read, in one line, without torch's advice to load it
    with ``weights_only=False``: that runs whatever code the file holds."""
    text = str(exc)
    unpickler = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
    if unpickler is not None:
        why = unpickler.group(1).split(" Please use")[0].strip()
        return (f"it is not a checkpoint of plain tensors ({why[:200]}); only tensors are "
                "loaded from a file, never code: save its state dict as tensors (or "
                ".safetensors)")
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and "weights_only" not in ln and "trust" not in ln]
    return (" ".join(lines)[:300] or type(exc).__name__)


def _select(raw, key, path) -> dict:
    """The state dict in a loaded checkpoint (`read_checkpoint`)."""
    if not isinstance(raw, dict):
        raise ValueError(f"checkpoint {path!r} holds a {type(raw).__name__}, not a dict")
    if key is not None:
        if not isinstance(raw.get(key), dict):
            raise ValueError(f"key {key!r} is not a state dict entry of checkpoint {path!r}; "
                             f"its entries: {sorted(map(str, raw))[:10]}")
        raw = raw[key]
    else:
        raw = next((raw[k] for k in GENERATOR_KEYS if isinstance(raw.get(k), dict)), raw)
    bad = [k for k, v in raw.items() if not isinstance(v, torch.Tensor)]
    if bad or not raw:
        raise ValueError(f"checkpoint {path!r} holds no state dict (no tensors, or entries "
                         f"that are not: {sorted(map(str, bad))[:10]}); name its entry with "
                         f"key= (default {GENERATOR_KEYS})")
    return raw


def _to_diffusers(state: dict) -> tuple[dict, dict]:
    """(diffusers key -> tensor, diffusers key -> original key) of an original-layout
    state dict, renamed by diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    other = [k for k in state if "motion_encoder" in k or "face_adapter" in k]
    if other:
        raise ValueError(f"Wan-Animate weights are not supported (text-to-video only): {other[:5]}")
    # The converter only renames keys, so it runs on the names (values: the old names).
    names = convert_wan_transformer_to_diffusers({k: k for k in state})
    if len(names) != len(state):
        kept = set(names.values())
        raise ValueError(f"checkpoint keys that rename to a diffusers key another one also "
                         f"takes: {sorted(k for k in state if k not in kept)[:10]}")
    return {new: state[old] for new, old in names.items()}, names


def original_names(model) -> dict[str, str]:
    """diffusers key -> original-layout key of every parameter of ``model`` (a
    ``WanTransformer3DModel``), from diffusers' converter run over the original names;
    ValueError naming a key with no original name (fused projections are skipped)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    names = list(_ORIGINAL_TOP) + [f"blocks.{i}.{n}" for i in range(len(model.blocks))
                                   for n in _ORIGINAL_BLOCK]
    forward = convert_wan_transformer_to_diffusers({n: n for n in names})  # new -> original
    keys = [k for k in model.state_dict() if not set(k.split(".")) & set(_FUSED)]
    missing = [k for k in keys if k not in forward]
    if missing:
        raise ValueError(f"model keys with no original Wan name: {missing[:10]} "
                         f"({len(missing)} in all)")
    return {k: forward[k] for k in keys}


def _model_config(config) -> dict:
    """A transformer config dict of a `CONFIGS` name, a dict or a local diffusers folder."""
    from diffusers import WanTransformer3DModel

    if isinstance(config, str) and config in CONFIGS:
        return dict(CONFIGS[config])
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, (str, os.PathLike)) and os.path.isdir(config):
        sub = "transformer" if os.path.isdir(os.path.join(config, "transformer")) else None
        return dict(WanTransformer3DModel.load_config(os.fspath(config), subfolder=sub,
                                                      local_files_only=True))
    raise ValueError(f"config must be one of {sorted(CONFIGS)}, a config dict or a local "
                     f"diffusers folder, got {config!r}")


def _empty_model(cfg: dict):
    """The model of ``cfg`` with its parameters on the meta device where accelerate is
    installed (they are assigned from the checkpoint), else initialised on the CPU."""
    from diffusers import WanTransformer3DModel

    try:
        from accelerate import init_empty_weights
    except ImportError:
        return WanTransformer3DModel.from_config(cfg), False
    with init_empty_weights():  # buffers (the rope tables) stay real
        return WanTransformer3DModel.from_config(cfg), True


def _from_checkpoint(path: str, config, key):
    """`load_model` of a checkpoint file: read, renamed, checked, loaded."""
    state, names = _to_diffusers(read_checkpoint(path, key=key))
    model, empty = _empty_model(_model_config(config))
    want = model.state_dict()
    inverse = original_names(model) if set(want) - set(state) else {}
    missing = [inverse.get(k, k) for k in want if k not in state]
    unexpected = [names[k] for k in state if k not in want]
    if missing or unexpected:
        raise ValueError(f"checkpoint {path!r} does not fit the model: {len(missing)} missing "
                         f"keys {missing[:10]}, {len(unexpected)} unexpected keys "
                         f"{unexpected[:10]} (original layout, 'model.' stripped)")
    for k, v in state.items():
        if v.shape != want[k].shape:
            raise ValueError(f"checkpoint {path!r}: {names[k]} ({k}) has shape "
                             f"{list(v.shape)}, the model's is {list(want[k].shape)}")
    model.load_state_dict(state, strict=False, assign=empty)
    return model


def save_original_checkpoint(model, path, *, key: str | None = "generator_ema",
                             prefix: str = "model.") -> None:
    """Write ``model``'s weights (a ``WanTransformer3DModel``) in the original Wan /
    Self-Forcing layout to ``path``: a ``.pt`` / ``.pth`` file holding ``{key: state}``
    (``key`` None: the bare state dict), or a ``.safetensors`` file (always the bare
    state dict: it holds no nesting), every key ``prefix`` + its original name. The file
    appears whole or not at all (`framekv.engine.files.written_whole`)."""
    check_model(model)
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".pt", ".pth", ".safetensors"):
        raise ValueError(f"path must end in .pt, .pth or .safetensors, got {path!r}")
    names, state = original_names(model), model.state_dict()
    out = {prefix + orig: _owned(state[k]) for k, orig in names.items()}
    with written_whole(path) as tmp:
        if ext == ".safetensors":
            from safetensors.torch import save_file

            save_file(out, tmp)
        else:
            torch.save(out if key is None else {key: out}, tmp)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU in a storage of its own (a packed projection's row block is a
    view of the packed weight; safetensors refuses shared storage)."""
    t = t.detach().to("cpu")
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def load_folder(path, *, dtype=None, device=None, max_tokens: int = 512) -> WanWeights:
    """The transformer, VAE and text encoder of a local diffusers folder (``transformer/``,
    ``vae/``, ``text_encoder/`` + ``tokenizer/``); the VAE and text encoder are None
    where their subfolders are absent. ValueError listing what is missing when there is
    no transformer. ``max_tokens``: the text encoder's (`TextEncoder`)."""
    from .text import TextEncoder, has_text_encoder

    root = os.fspath(path)
    parts = ("transformer", "vae", "text_encoder", "tokenizer")
    if not os.path.isdir(os.path.join(root, "transformer")):
        missing = [p for p in parts if not os.path.isdir(os.path.join(root, p))]
        raise ValueError(f"{root!r} is not a diffusers Wan folder with a transformer: it "
                         f"lacks {', '.join(p + '/' for p in missing)}")
    transformer = load_model(root, dtype=dtype, device=device)
    vae = None
    if os.path.isdir(os.path.join(root, "vae")):
        from .vae import load_vae

        vae = load_vae(os.path.join(root, "vae"), dtype=dtype, device=device)
    text = (TextEncoder.from_pretrained(root, max_tokens=max_tokens, dtype=dtype, device=device)
            if has_text_encoder(root) else None)
    return WanWeights(transformer=transformer, vae=vae, text_encoder=text)
