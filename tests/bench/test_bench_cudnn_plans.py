"""The cuDNN plan bench's pieces on CPU: `CudnnPlan.launch` is exactly the launch `run`
makes (over the stand-in for cuDNN, `cudnn_fake`), and the table reports every plan,
built or not."""
from __future__ import annotations

import pytest
import torch

from attention_harness import make
from cudnn_fake import FakeCudnnBackend
from framekv.bench.cudnn_plans import format_plans
from framekv.engine.attention.cudnn_graph import UID
from framekv.specs import Geometry as G


@pytest.mark.parametrize("split,pack,b", [(1, False, 6), (1, True, 3), (3, True, 3), (2, False, 6)])
def test_launch_is_the_launch_run_makes(split, pack, b):
    geometry = G(5, 13, 6, (3, 6))
    backend = FakeCudnnBackend(split=split, pack=pack)
    cache, (mod,) = make(geometry, 4, layers=1, H=4, Hkv=2, D=8, dtype=torch.bfloat16,
                         device="cpu", backend=backend)
    gen = torch.Generator().manual_seed(split * 10 + b)
    qkv = torch.randn(1, 6, 8, 8, generator=gen).to(torch.bfloat16)  # the merge takes bf16
    want = mod(qkv, kv_cache=cache, seq_len=6, causal_block_size=b)[0]   # stages K/V too
    plan = mod.plan_for(cache, 6, b)
    plan.prepare(None)
    (exe, pack_), out = plan.launch(qkv[0, :, :4], 0, torch.zeros(6, 4, 8, dtype=torch.bfloat16)), None
    assert exe.key.splits == plan.splits == split and exe.key.query_group == plan.group
    assert exe is backend.executable(exe.key)                   # the graph run() executes
    launches = exe.graph.launches
    exe.graph.execute(pack_, exe.workspace)
    assert exe.graph.launches == launches + 1
    if plan.split is None and plan.pack is None:               # cuDNN writes the output itself
        out = pack_[UID["o"]]
    elif plan.split is None:                                   # packed: copied back by run
        out = torch.zeros(6, 4, 8, dtype=torch.bfloat16)
        plan.pack.unpack(out)
    if out is not None:
        got = out if out.dim() == 3 else out.permute(0, 2, 1, 3).reshape(6, 4, 8)
        assert torch.equal(got, want)
    else:                                                      # split: the partials run merges
        assert pack_[UID["o"]].data_ptr() == plan.split.partial.data_ptr()
        assert UID["stats"] in pack_
    cache.shutdown()


def test_format_reports_built_and_unbuilt_plans():
    res = {"preset": "p", "matmul_tflops": 800.0, "forwards": [
        {"forward": "denoise", "layout": "auto", "splits": 5, "packed": True, "plans": {
            "backend": {"workspace": 256, "us": {"median": 1800.0}, "tflops": 560.0,
                        "fraction_of_ceiling": 0.7},
            "plan 0": {"cudnn_name": "eng9_k24=7", "workspace": 256, "us": {"median": 1790.0},
                       "tflops": 563.0, "fraction_of_ceiling": 0.704},
            "plan 1": {"cudnn_name": "eng8_k24=3", "error": "not supported"}}}]}
    text = format_plans(res)
    assert "eng9_k24=7" in text and "1790.0" in text and "0.70" in text
    assert "not built: not supported" in text and "5/p" in text
