"""The Wan wing: diffusers' ``WanTransformer3DModel`` rolled out through framekv.

- `WanRollout` (``rollout.py``): the model's `ChunkRunner` (geometry, prompts, graphs).
- `WanChunks` (``model.py``): the model as a `ChunkModel` (its forward with framekv's
  context, rope and prompt K/V); ``blocks.py`` its blocks, ``attention.py`` its
  self-attention over the K/V store and cross-attention over the prompt's K/V.
- ``setup.py``: shapes, shipped configs (`CONFIGS`), random or local weights.

diffusers is imported on first use (``pip install 'framekv[wan]'``).
"""
from .model import WanChunks
from .rollout import CLEAN_BLOCKS, SAMPLERS, WanRollout
from .setup import CONFIGS, PRESETS, WanShape, build_model, load_model, preset_sizes

__all__ = ["CLEAN_BLOCKS", "CONFIGS", "PRESETS", "SAMPLERS", "WanChunks", "WanRollout",
           "WanShape", "build_model", "load_model", "preset_sizes"]
