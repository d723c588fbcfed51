"""The Wan wing: diffusers' ``WanTransformer3DModel`` rolled out through framekv.

- `WanRollout` (``rollout.py``): the rollout (geometry, samplers, clean pass, graphs).
- ``processors.py``: what goes inside the model (self-attention over the K/V store,
  cross-attention over K/V projected once per prompt, absolute-frame rope).
- ``setup.py``: shapes, shipped configs (`CONFIGS`), random or local weights.

diffusers is imported on first use (``pip install 'framekv[wan]'``).
"""
from .rollout import CLEAN_BLOCKS, SAMPLERS, WanRollout
from .setup import CONFIGS, WanShape, build_model, load_model

__all__ = ["CLEAN_BLOCKS", "CONFIGS", "SAMPLERS", "WanRollout", "WanShape", "build_model",
           "load_model"]
