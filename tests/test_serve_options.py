"""`framekv serve`'s options where a hostile run found them checked late or too quietly,
on the CPU, in this process (nothing is served).

The command reads a ``--decoder tiny:PATH`` file before any model is built, never
passing on torch's advice to load it with ``weights_only=False``.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("fastapi")

from framekv.tools.cli import main  # noqa: E402


def test_a_bad_decoder_file_is_refused_before_any_model_is_built(tmp_path, monkeypatch,
                                                                 capsys):
    pytest.importorskip("diffusers")

    def built_(*a, **k):
        raise AssertionError("a model was built before the decoder file was read")

    for name in ("build_model", "load_model"):
        monkeypatch.setattr(f"framekv.engine.wan.pipeline.{name}", built_)
    monkeypatch.setattr("framekv.engine.serving.StreamScheduler", built_)
    monkeypatch.delenv("FRAMEKV_TOKEN", raising=False)
    bad = tmp_path / "taew2_1.pth"
    torch.save({"decoder.1.weight": torch.zeros(1), "hook": _Unpicklable()}, bad)
    status = main(["serve", "--device", "cpu", "--model", "wan-diffusers", "--decoder",
                   f"tiny:{bad}"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1, err
    assert "cannot read checkpoint" in err and str(bad) in err and "never code" in err
    assert "weights_only" not in err and "trust" not in err, err


class _Unpicklable:
    """An object torch's weights-only loader refuses (a class of this module)."""
