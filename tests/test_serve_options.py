"""`framekv serve`'s options where a hostile run found them checked late or too quietly,
on the CPU, in this process (nothing is served).

The command warns once when bound beyond loopback without a token, and reads a
``--decoder tiny:PATH`` file before any model is built, never passing on torch's advice
to load it with ``weights_only=False``; a ``--video-strength`` it cannot take (no
encoder, latents out, a strength that runs no step or is out of range) is one line,
exit 2, before any model is built.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("fastapi")

from framekv.tools.cli import main  # noqa: E402
from test_serve_defects import _Built, built  # noqa: E402,F401  (the fixture)


@pytest.mark.parametrize("host, token, warned", [
    ("0.0.0.0", None, True), ("::", None, True), ("example.org", None, True),
    ("0.0.0.0", "tok", False), ("127.0.0.1", None, False), ("localhost", None, False),
    ("::1", None, False)])
def test_serving_beyond_loopback_without_a_token_warns_once(built, capsys, monkeypatch,
                                                            host, token, warned):
    if token is not None:
        monkeypatch.setenv("FRAMEKV_TOKEN", token)
    # the warning is the subject: the bind check (which would resolve and refuse a name
    # not of this machine) is a test of its own
    monkeypatch.setattr("framekv.tools.serve.command.check_address", lambda host, port: None)
    with pytest.raises(_Built):
        main(["serve", "--device", "cpu", "--host", host])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == int(warned), err
    if warned:
        assert err[0].startswith(f"framekv serve: warning: --host {host} is not a loopback "
                                 "address and no token is set"), err


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


@pytest.mark.parametrize("argv, words", [
    (["--video-strength", "0.5"], "--video-strength 0.5: a video input needs a model "
                                  "family with an encoder"),
    (["--model", "wan-diffusers", "--video-strength", "0.5", "--output", "latents"],
     "--video-strength needs --output frames"),
    (["--model", "wan-diffusers", "--video-strength", "0.01"],
     "--video-strength 0.01: strength 0.01 runs none of the steps"),
    (["--model", "wan-diffusers", "--video-strength", "1.5"],
     "--video-strength: must be a number in (0, 1], got 1.5")])
def test_a_video_strength_a_server_cannot_take_is_refused_before_any_model_is_built(
        monkeypatch, capsys, argv, words):
    pytest.importorskip("diffusers")

    def built_(*a, **k):
        raise AssertionError("a model was built before --video-strength was checked")

    for name in ("build_model", "load_model"):
        monkeypatch.setattr(f"framekv.engine.wan.pipeline.{name}", built_)
    monkeypatch.delenv("FRAMEKV_TOKEN", raising=False)
    with pytest.raises(SystemExit) if "1.5" in argv else contextlib.nullcontext():
        status = main(["serve", "--device", "cpu", *argv])
        assert status == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err
