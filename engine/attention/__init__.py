"""The attention wing: one layer's attention over the cache, and its backends.

- `CachedAttention` (``module.py``): the layer module, plain or over a `CausalKVCache`.
- `AttentionBackend` / `AttentionPlan` (``backend.py``): plan once per forward, run per
  layer; the fp32 reference and plain torch SDPA backends; `get_backend` by name.
- `CudnnBackend` (``cudnn.py``, ``cudnn_graph.py``, ``split_kv.py``): cudnn-frontend
  paged SDPA with split-KV and plan files (imported on first use: a GPU extra).
- `UlyssesAttention` (``ulysses.py``) and `UlyssesKV` (``ulysses_kv.py``): one layer,
  and a whole model's K/V, across the ranks of a process group.
"""
from .backend import AttentionBackend, AttentionPlan, ReferenceBackend, TorchSDPABackend, attend_fp32
from .module import CachedAttention
from .registry import BACKENDS, cudnn_frontend_available, default_backend, get_backend

__all__ = ["AttentionBackend", "AttentionPlan", "BACKENDS", "CachedAttention",
           "ReferenceBackend", "TorchSDPABackend", "attend_fp32", "cudnn_frontend_available",
           "default_backend", "get_backend"]
