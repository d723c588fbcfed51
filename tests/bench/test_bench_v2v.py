"""`framekv.bench.v2v` on the CPU at the tiny config (eager, fp32): every encoder run
against its eager twin (equal) and the Wan VAE's programs against the fp32 modules (the
modules equal themselves, the fused program within fp32 rounding), the table; a bad
--parts, --encoders or --iters is refused before anything is built. The GPU numbers are
the bench's to take on a GPU."""
from __future__ import annotations

import pytest

pytest.importorskip("diffusers")

from framekv.bench import v2v  # noqa: E402


def test_every_encoder_against_eager_and_the_fp32_modules_at_the_tiny_config():
    res = v2v.measure_encoders(config="tiny", device="cpu", frame_size=(16, 24),
                               latent_frames=2, check_chunks=2, progress=lambda m: None)
    assert res["gpu"] == "cpu" and set(res["encoders"]) == set(v2v.ENCODERS)
    assert res["frames_per_chunk"] == 8 and res["dtype"] == "float32"
    enc = res["encoders"]
    assert all(r["max_abs_diff_eager_graphed"] == 0.0 for r in enc.values())
    assert enc["wan-modules"]["max_abs_err"] == 0.0                   # the reference itself
    assert 0 < enc["wan"]["max_abs_err"] < 1e-5
    assert "max_abs_err" not in enc["tiny"]                           # another network
    table = v2v.format_encoders(res)
    assert "streaming encoders on cpu: 16x24 frames, 8-frame chunks (2 latent frames)" in table
    assert all(name in table for name in v2v.ENCODERS)


@pytest.mark.parametrize("argv, words", [
    (["--parts", "e2e"], ["--parts must be a comma-separated list of encoders", "'e2e'"]),
    (["--encoders", "wan,big"], ["--encoders must be", "wan, wan-modules, tiny", "'wan,big'"]),
    (["--iters", "0"], ["--iters must be at least 1, got 0"]),
])
def test_bad_arguments_are_refused_in_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as exc:
        v2v.main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and all(w in err for w in words), err
    assert "needs a CUDA GPU" not in err                              # checked before CUDA
