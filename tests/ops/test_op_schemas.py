"""Every `framekv` custom op's schema: no argument the op writes has a default value.

Why: a Python kernel receives its arguments back from the dispatcher with trailing
arguments that equal their defaults left out, and the autograd layer of some torch
releases bumps the version of each written argument by its position in what it
received (`torch._library.custom_ops`, ADInplaceOrView), so a written argument with a
default (an fp8 scale output left None) is out of range there and the op raises
IndexError on every call, eager or under capture. Without defaults nothing written is
ever left out."""
from __future__ import annotations

import torch

import framekv.ops  # noqa: F401  (registers the ops)


def _ops():
    for name in dir(torch.ops.framekv):
        packet = getattr(torch.ops.framekv, name)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            yield name, packet.default


def test_no_written_argument_of_a_framekv_op_has_a_default():
    written, bad = [], []
    for name, op in _ops():
        for arg in op._schema.arguments:
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.append(f"{name}.{arg.name}")
                if arg.has_default_value():
                    bad.append(f"{name}.{arg.name} = {arg.default_value}")
    assert len(written) >= 20 and "adaln_.out_scale" in written      # the ops are registered
    assert bad == [], f"written arguments with defaults: {bad}"
