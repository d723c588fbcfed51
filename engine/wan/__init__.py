"""The Wan wing: diffusers' Wan 2.1 models rolled out through framekv, prompt to pixels.

- `WanRollout` (``rollout.py``): the model's `ChunkRunner` (geometry, prompts, graphs).
- `WanChunks` (``model.py``): the model as a `ChunkModel` (its forward with framekv's
  context, rope and prompt K/V); ``blocks.py`` its blocks, ``attention.py`` its
  self-attention over the K/V store and cross-attention over the prompt's K/V.
- ``setup.py``: shapes, shipped configs (`CONFIGS`), random weights.
- ``weights.py``: local weights — a diffusers folder (`load_folder`) or a generator
  checkpoint in the original Wan layout (`load_model`), keys checked both ways.
- ``text.py``: `TextEncoder`, UMT5 from a local folder or random, prompts to embeddings.
- ``vae.py``: the Wan VAE and `StreamingVAEDecoder`, a rollout's latents to frames chunk
  by chunk with the causal cache in an arena; ``vae_graph.py`` its CUDA graphs.
- ``vae_encoder.py``: `StreamingVAEEncoder`, the decoder's mirror: a video's frames to
  latents chunk by chunk, the causal cache in an arena; ``vae_encoder_fused.py`` its
  channels-last program. ``coder_rows.py`` the rows both directions share,
  ``vae_cache.py`` the cache, ``vae_blocks.py`` the fused programs' blocks.
- ``tiny_decoder.py``: `TinyStreamingDecoder`, a small per-frame decoder of the TAEHV
  ``taew2_1`` layout with `StreamingVAEDecoder`'s interface, frame counts and range;
  ``tiny_net.py`` its network and weight layout; ``tiny_encoder.py`` +
  ``tiny_encoder_net.py``: `TinyStreamingEncoder`, the same checkpoint's encoder with
  `StreamingVAEEncoder`'s interface; ``tiny_blocks.py`` what the two share;
  ``decoders.py`` which decoder a pipeline builds (``--decoder wan|tiny[:PATH]``) and
  the encoder that follows it.
- ``pipeline.py``: `WanPipeline`, the one loader the commands share: a config, a
  diffusers folder or an original-layout checkpoint to transformer, text encoder,
  decoder, sizes and sampling.

diffusers and transformers are imported on first use (``pip install 'framekv[wan]'``).
"""
from .model import WanChunks
from .pipeline import WanPipeline
from .rollout import CLEAN_BLOCKS, WanRollout
from .setup import CONFIGS, PRESETS, WanShape, build_model, preset_sizes
from .text import TEXT_CONFIGS, TextEncoder
from .tiny_decoder import TinyStreamingDecoder
from .tiny_encoder import TinyStreamingEncoder
from .vae import VAE_CONFIGS, StreamingVAEDecoder, build_vae, load_vae
from .vae_encoder import StreamingVAEEncoder
from .weights import WanWeights, load_folder, load_model, save_original_checkpoint

__all__ = ["CLEAN_BLOCKS", "CONFIGS", "PRESETS", "TEXT_CONFIGS", "VAE_CONFIGS",
           "StreamingVAEDecoder", "StreamingVAEEncoder", "TextEncoder", "TinyStreamingDecoder",
           "TinyStreamingEncoder", "WanChunks", "WanPipeline", "WanRollout", "WanShape",
           "WanWeights", "build_model", "build_vae", "load_folder", "load_model", "load_vae",
           "preset_sizes", "save_original_checkpoint"]
