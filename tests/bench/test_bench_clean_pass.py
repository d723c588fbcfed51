"""The clean-pass A/B bench: its record arithmetic and its arguments (the GPU run
itself is docs/benchmarks.md's)."""
from __future__ import annotations

import pytest

from framekv.bench.clean_pass import _record, format_clean_pass, main


def test_record_reports_medians_the_saving_and_the_skipped_work():
    times = {"trimmed": [400.0e3, 402.0e3, 399.0e3], "whole": [403.0e3, 405.0e3, 404.0e3]}
    r = _record(times, {"gemm": 2e12, "attention": 3e12}, 500.0)
    assert r["chunk_us"]["trimmed"] == {"median": 400.0e3, "n": 3}
    assert r["saved_us"] == pytest.approx(4.0e3)
    assert r["saved_fraction"] == pytest.approx(1 - 400 / 404)
    assert r["skipped_at_ceiling_us"] == pytest.approx(10_000.0)  # 5 TFLOP at 500 TFLOP/s
    text = format_clean_pass([{"model": "m", **r}])
    assert "trimmed 400.0, whole 404.0: saves 4.00 ms (0.99%)" in text


@pytest.mark.parametrize("argv, message", [(["--models", "dense"], "--models"),
                                           (["--models", ","], "--models"),
                                           (["--rounds", "2"], "--rounds")])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
