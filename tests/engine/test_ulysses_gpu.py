"""Ulysses sequence parallelism on two GPUs: NCCL and the cuDNN backend against one GPU.

The workers are those of `test_ulysses.py` (gloo on CPU there); here each rank runs on
cuda:rank with bf16 K/V, so outputs are compared within bf16 rounding while the cache
contents of the attention rollout stay bit for bit (they are copies of the same rows).
"""
from __future__ import annotations

import msgspec
import pytest
import torch

from test_rollout_gpu import WIDE as WIDE_ONE_GPU
from test_ulysses import attention_rollout_worker, model_rollout_worker, spawn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2,
                                 reason=f"needs 2 CUDA GPUs for NCCL, found "
                                        f"{torch.cuda.device_count()}")]

#: GQA 8/2 heads of 128 (4/1 per rank), 32-token pages, thousands of keys; the first
#: chunk carries 37 caller padding rows and an odd length (293: the sharder pads one).
ATTN_GPU = {"dist": "nccl", "device": "cuda", "backend": "cudnn", "dtype": "bfloat16",
            "geometry": (64, 1536, 256, (64, 256)), "tpp": 32, "chunk": 256, "frame": 64,
            "lengths": (293, 256, 257, 256, 256, 256, 256, 256), "H": 8, "Hkv": 2, "D": 128,
            "layers": 2, "tol": 1e-2}

#: test_rollout_gpu's WIDE with a 41-token prompt (split with a padding row).
WIDE = (WIDE_ONE_GPU[0], msgspec.structs.replace(WIDE_ONE_GPU[1], prompt_tokens=41))


def test_two_gpu_attention_rollout_equals_one_gpu():
    spawn(attention_rollout_worker, ATTN_GPU)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_two_gpu_model_rollout_tracks_one_gpu(graphs):
    # bf16 latents drift through the sampler (the per-token matmuls run on other row
    # counts), as between the demo's checks; K/V compared while they are still close.
    spawn(model_rollout_worker, {"dist": "nccl", "device": "cuda", "backend": "cudnn",
                                 "spec": WIDE, "chunks": 12, "graphs": graphs, "tol": 5e-2,
                                 "cache_tol": 3e-2, "cache_chunks": 1})
