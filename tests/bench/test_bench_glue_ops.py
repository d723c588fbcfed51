"""The glue-op bench on the CPU: its byte counts, its argument checks, and the variants'
wiring (each bound op against its torch reference, the staged pools written)."""
from __future__ import annotations

import pytest
import torch

from framekv.bench import glue_ops


def test_op_bytes_count_each_tensor_read_and_written_once():
    S, N, H, Hkv, D = 10, 6, 3, 1, 4
    b = glue_ops.op_bytes(S, N, H, Hkv, D)
    row = S * N * 2
    assert b["adaln_"] == 2 * row                       # x read, out written
    assert b["adaln_ + gated residual"] == 4 * row      # x, residual read; x, out written
    assert b["gated_residual_"] == 3 * row              # x, y read; x written
    assert b["qk_norm_rope in place"] == 2 * S * (H + Hkv) * D * 2
    assert b["qk_norm_rope staging"] == 2 * S * (H + 2 * Hkv) * D * 2  # q, k, v once each way
    assert b["copy_ of x"] == b["adaln_"]


@pytest.mark.parametrize("argv, message", [(["--rounds", "3"], "--rounds: expected at least 5"),
                                           (["--launches", "0"], "--launches: expected")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        glue_ops.main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_variants_on_cpu_match_their_references_and_stage_into_the_pools():
    gen = torch.Generator().manual_seed(3)
    a = glue_ops._setup("tiny", gen, device="cpu")
    variants = {**glue_ops._adaln_variants(a), **glue_ops._qk_variants(a)}
    assert set(variants) | {"copy_ of x", "copy_ of qkv"} == set(
        glue_ops.op_bytes(1, 1, 1, 1, 1))
    before = a["qkv"].clone()
    for name, (call, got, want) in variants.items():
        call()
        out = got() if callable(got) else got
        assert glue_ops._check(name, out, want) == 0.0, name  # CPU: the reference itself
    assert torch.equal(a["qkv"], before)  # every variant works on its own copy
    staged = a["pools"][0][a["dst"]]      # [S, Hkv, D]: every entry's K row landed
    assert staged.abs().sum(dim=(1, 2)).min() > 0
    assert torch.equal(a["pools"][1][a["dst"]], before[0, :, a["H"] + a["Hkv"]:])  # raw V


def test_check_stops_on_a_wrong_result():
    want = torch.ones(8, dtype=torch.bfloat16)
    with pytest.raises(SystemExit, match="differs from the torch reference"):
        glue_ops._check("x", want + 0.25, want)
