"""The model wing: the reference causal video DiT (``dit.py``, with `DiTChunks`, its
runner adapter) and its blocks (``blocks.py``: embeddings, the 3-axis rotary positions
both models use, norms, the transformer block)."""
from .blocks import DiTBlock, Rope3D, apply_rope, rope_split, sinusoidal_embedding
from .dit import CausalVideoDiT, DiTChunks, default_backend, model_dtype, patchify, unpatchify

__all__ = ["CausalVideoDiT", "DiTBlock", "DiTChunks", "Rope3D", "apply_rope", "default_backend",
           "model_dtype", "patchify", "rope_split", "sinusoidal_embedding", "unpatchify"]
