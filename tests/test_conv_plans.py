"""`framekv.engine.wan.conv_plans` on the CPU: the channels-last strides it declares are
torch's, output sizes, and which tensors go through it (CUDA bf16 / fp16 only; the
graphs themselves are tested in ``test_conv_plans_gpu.py``)."""
from __future__ import annotations

import torch

from framekv.engine.wan.conv_plans import ConvKey, channels_last_strides, supported


def test_strides_are_torchs_channels_last():
    x = torch.empty(2, 96, 5, 7, 9).contiguous(memory_format=torch.channels_last_3d)
    assert channels_last_strides(list(x.shape)) == list(x.stride())
    y = torch.empty(3, 8, 6, 4).contiguous(memory_format=torch.channels_last)
    assert channels_last_strides(list(y.shape)) == list(y.stride())
    w = torch.empty(16, 96, 3, 3, 3).contiguous(memory_format=torch.channels_last_3d)
    assert channels_last_strides(list(w.shape)) == list(w.stride())


def test_output_dims_and_what_is_supported():
    key = ConvKey(device=0, dtype="torch.bfloat16", x=(1, 96, 14, 60, 104), x_strides=(),
                  w=(96, 96, 3, 3, 3), pad=(0, 1, 1), residual=True)
    assert key.out == [1, 96, 12, 60, 104]
    key2 = ConvKey(device=0, dtype="torch.bfloat16", x=(4, 8, 9, 5), x_strides=(),
                   w=(3, 8, 3, 3), pad=(1, 1), residual=False)
    assert key2.out == [4, 3, 9, 5]
    assert not supported(torch.zeros(1, dtype=torch.bfloat16))          # a CPU tensor
