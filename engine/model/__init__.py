"""The model wing: the reference causal video DiT (``dit.py``) and its blocks
(``blocks.py``: embeddings, 3-axis rotary positions, norms, the transformer block)."""
from .blocks import DiTBlock, Rope3D, apply_rope, rope_split, sinusoidal_embedding
from .dit import (CausalVideoDiT, Recorder, default_backend, model_dtype, patchify,
                  unpatchify)

__all__ = ["CausalVideoDiT", "DiTBlock", "Recorder", "Rope3D", "apply_rope", "default_backend",
           "model_dtype", "patchify", "rope_split", "sinusoidal_embedding", "unpatchify"]
