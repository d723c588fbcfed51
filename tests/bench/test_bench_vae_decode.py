"""`framekv.bench.vae_decode` on the CPU at the tiny config (eager, fp32): both programs
measured against the fp32 modules (the modules equal themselves, the fused program within
fp32 rounding), the table; the GPU numbers are the bench's to take on a GPU."""
from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from framekv.bench import vae_decode  # noqa: E402


def test_both_programs_against_the_fp32_modules_at_the_tiny_config():
    res = vae_decode.measure(config="tiny", device="cpu", latent_size=(5, 6), frames=2,
                             check_chunks=2, progress=lambda m: None)
    assert res["gpu"] == "cpu" and set(res["programs"]) == set(vae_decode.PROGRAMS)
    assert res["programs"]["modules"]["max_abs_err"] == 0.0          # the reference itself
    assert 0 < res["programs"]["fused"]["max_abs_err"] < 1e-5
    table = vae_decode.format_result(res)
    assert "Wan VAE decode on cpu: 40x48, 2-frame latent chunks, float32" in table
    assert "fused" in table and "modules" in table
