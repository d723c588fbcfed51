"""Whether a rollout fits its device, checked from the specs before anything is built.

A preset whose sizes the machine cannot hold should fail at once with what it would
need, not after minutes of building modules or with an allocator's traceback. The need
is counted from the shapes alone::

    weights      ModelSpec.parameter_count() x the compute dtype's bytes, and one byte
                 per block GEMM weight for their fp8 copies (fp8 GEMMs)
    K/V cache    CausalKVCache.pool_bytes_for(geometry, ...)  (exact)
    activations  one forward's largest tensors over a chunk, x 4 for what the graph
                 pool and the allocator keep alive (an estimate, said so)

and compared with the device's free memory (CUDA: the driver's count; CPU: the
kernel's MemAvailable). Where free memory cannot be read, nothing is refused.
"""
from __future__ import annotations

import torch

from framekv.specs import ModelSpec, RolloutSpec

from .cache import CausalKVCache

__all__ = ["check_fits", "free_bytes", "host_room", "rollout_bytes"]

_GIB = 2**30
#: Live copies of one forward's activations: the forward itself, the graph pool that
#: keeps a captured chunk's, and allocator slack.
_ACTIVATION_COPIES = 4
#: Query rows per fp32 score tile of the reference attention (`attend_fp32`).
_QUERY_TILE = 256


def rollout_bytes(model: ModelSpec, rollout: RolloutSpec, dtype: torch.dtype, *,
                  weights: bool = True, paged_cache: bool = True,
                  reference_attention: bool = False, sequences: int = 1,
                  kv_dtype: torch.dtype | None = None,
                  fp8_weights: bool = False) -> dict[str, int]:
    """Bytes a rollout of these specs needs on its device, by part (see module doc);
    ``sequences`` sequences batched: B pools' worth of cache, B x the activations.
    ``dtype`` is the compute dtype, ``kv_dtype`` the pool's (default ``dtype``; an fp8
    pool is half a bf16 one); ``fp8_weights``: the blocks' fp8 GEMM weights too
    (``fp8_weights`` in the result, kept beside the model's own)."""
    size = torch.empty((), dtype=dtype).element_size()
    T, hid = sequences * rollout.chunk_tokens, model.hidden_size
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    act = T * (6 * hid + 2 * qkv + 2 * model.ffn_size) * size + T * model.head_dim * 8
    if reference_attention:  # fp32 scores of one query tile over every key, and softmax
        act += 2 * model.num_heads * _QUERY_TILE * rollout.keys_per_forward * 4
    out = {"weights": model.parameter_count() * size if weights else 0,
           "fp8_weights": model.num_layers * hid * (qkv + hid + 2 * model.ffn_size)
           if fp8_weights else 0,
           "kv_cache": 0, "activations": _ACTIVATION_COPIES * act}
    if paged_cache:
        out["kv_cache"] = CausalKVCache.pool_bytes_for(
            rollout.geometry(), num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim, dtype=dtype if kv_dtype is None else kv_dtype,
            tokens_per_page=model.tokens_per_page,
            num_sequences=sequences)
    return out


def free_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` in bytes, or None where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_room() -> int | None:
    """Bytes this process may still take on the host: the kernel's MemAvailable, or less
    where an address-space limit (RLIMIT_AS, ``ulimit -v``) leaves less; None where
    neither can be read."""
    import resource

    room = free_bytes(torch.device("cpu"))
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        used = 0
        try:
            with open("/proc/self/status") as f:
                used = next((int(line.split()[1]) * 1024 for line in f
                             if line.startswith("VmSize:")), 0)
        except OSError:
            pass
        room = max(0, limit - used) if room is None else min(room, max(0, limit - used))
    return room


def check_fits(name: str, need: dict[str, int], device: torch.device) -> None:
    """ValueError saying what ``name`` needs (by part) and what ``device`` has free,
    when the total does not fit."""
    free = free_bytes(device)
    total = sum(need.values())
    if free is None or total <= free:
        return
    parts = ", ".join(f"{k.replace('_', ' ')} {v / _GIB:.2f} GiB" for k, v in need.items() if v)
    raise ValueError(f"{name} needs about {total / _GIB:.2f} GiB on {device} ({parts}; "
                     f"activations estimated), and {device} has {free / _GIB:.2f} GiB free: "
                     "use a smaller preset (fewer layers, a shorter window or chunk) or a "
                     "larger device")
