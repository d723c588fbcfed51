"""`framekv generate --video-in`: a video file in, restyled chunk by chunk, on the tiny
config (random weights). The input is a short lossless MP4 of frames stamped with their
own gray level (`test_video_in.stamped_video`), wider than the model's square video so
it is resized and cropped. Checked: the output's frame count, size and rate; the chunks'
input latents are the encoder's latents of the input's frames, fitted, in order;
strength 1 is the text-to-video video frame for frame; the same input, seed and
strength repeat; another input changes the video; on CUDA the graphed run matches the
eager one; every refusal is one line, exit 2, before any model is built, and an input
that breaks part way fails the run (exit 1) leaving nothing."""
from __future__ import annotations

import io
import os
import re

import numpy as np
import pytest
import torch

pytest.importorskip("av")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from framekv.tools.cli import main  # noqa: E402
from framekv.tools.generate import generate  # noqa: E402
from framekv.tools.video_in import chunk_frames, fit_frame  # noqa: E402
from test_generate import CAT, run_generate, tiny_sizes, video_frames  # noqa: E402
from test_video import mae, read_video  # noqa: E402
from test_video_in import level, stamped_video  # noqa: E402

#: the input: 48 x 80 (wider than the tiny preset's 64 x 64 video) at 12 fps
SIZE, FPS = (48, 80), 12


def frames_for(chunks: int, extra: int = 0) -> int:
    F = tiny_sizes()[0]
    return video_frames(F, chunks) + extra


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    """Two whole chunks of the tiny preset and three frames past them."""
    return stamped_video(tmp_path_factory.mktemp("in") / "in.mp4", frames_for(2, 3), SIZE, FPS)


def run_v2v(out, video, strength=0.5, **kwargs):
    return run_generate(out, video_in=video, strength=strength, chunks=None, **kwargs)


def test_the_command_writes_every_whole_chunk_of_the_input(clip, tmp_path, capsys):
    F, H, W = tiny_sizes()
    out = tmp_path / "o.mp4"
    assert main(["generate", "--prompt", CAT, "--video-in", clip, "--strength", "0.5",
                 "--decoder", "tiny", "--out", str(out), "--device", "cpu"]) == 0
    cap = capsys.readouterr()
    got, rate = read_video(out)
    assert got.shape == (video_frames(F, 2), 8 * H, 8 * W, 3) and rate == FPS
    assert f"framekv generate: {video_frames(F, 2)} frames of {8 * W}x{8 * H}" in cap.out
    assert f"at {FPS} fps" in cap.out
    assert "tiny encoder (random weights)" in cap.err and "strength 0.5 over euler" in cap.err
    bars = [line for line in cap.err.splitlines() if line.startswith("generate [")]
    assert len(bars) == 2 and "2/2" in bars[-1]                     # progress as t2v shows it
    # --chunks caps the chunks; the Wan VAE's encoder follows --decoder wan
    once = tmp_path / "one.mp4"
    assert main(["generate", "--prompt", CAT, "--video-in", clip, "--strength", "0.5",
                 "--chunks", "1", "--fps", "8", "--out", str(once), "--device", "cpu",
                 "--no-progress"]) == 0
    got, rate = read_video(once)
    assert got.shape == (video_frames(F, 1), 8 * H, 8 * W, 3) and rate == 8
    assert "Wan VAE encoder" in capsys.readouterr().err


def test_the_chunks_start_from_the_input_frames_encoded_in_order(clip, tmp_path, monkeypatch):
    from framekv.engine.samplers import VideoToVideoSampler
    from framekv.engine.wan.coder_rows import EncoderRows

    encoded, sources = [], []
    real_encode, real_inputs = EncoderRows.encode, VideoToVideoSampler.row_inputs

    def encode(self, frames, rows=None):
        out = real_encode(self, frames, rows)
        encoded.append((frames.clone(), out.clone()))
        return out

    def row_inputs(self, seed, index, shape, sequence=0, source=None):
        sources.append((index, source.clone()))
        return real_inputs(self, seed, index, shape, sequence, source)
    monkeypatch.setattr(EncoderRows, "encode", encode)
    monkeypatch.setattr(VideoToVideoSampler, "row_inputs", row_inputs)
    run_v2v(tmp_path / "o.mp4", clip, decoder="tiny")
    F, H, W = tiny_sizes()
    assert [f.shape for f, _ in encoded] == [(1, 3, chunk_frames(i, F), 8 * H, 8 * W)
                                            for i in range(2)]
    # frame j of the video is flat gray level(j): each chunk holds its own frames in order
    seen = torch.cat([f[0] for f, _ in encoded], dim=1).mean(dim=(0, 2, 3))
    want = torch.tensor([level(j) / 255 * 2 - 1 for j in range(frames_for(2))])
    assert torch.allclose(seen, want, atol=2 / 255)
    # the frames are the file's, fitted to the model's size (resized to cover, cropped)
    stamp = torch.full((*SIZE, 3), level(0), dtype=torch.uint8)
    assert torch.allclose(encoded[0][0][0, :, 0], fit_frame(stamp, (8 * H, 8 * W)), atol=2 / 255)
    assert [i for i, _ in sources] == [0, 1]
    assert all(torch.equal(s, lat[0]) for (_, s), (_, lat) in zip(sources, encoded))


def test_strength_1_is_the_text_to_video_video(clip, tmp_path):
    full, r = run_v2v(tmp_path / "a.mp4", clip, strength=1.0, seed=3)
    t2v, _ = run_generate(tmp_path / "b.mp4", chunks=2, seed=3)
    assert r.frames == video_frames(tiny_sizes()[0], 2) and len(full) == len(t2v) == 2
    assert all(np.array_equal(a, b) for a, b in zip(full, t2v))        # bit for bit


def test_the_same_input_repeats_another_input_changes_the_video(clip, tmp_path):
    a, _ = run_v2v(tmp_path / "a.mp4", clip, decoder="tiny", seed=1)
    again, _ = run_v2v(tmp_path / "b.mp4", clip, decoder="tiny", seed=1)
    assert all(np.array_equal(x, y) for x, y in zip(a, again))
    # the same levels in reverse: only the input differs
    other = stamped_video(tmp_path / "rev.mp4", frames_for(2, 3), SIZE, FPS)
    reverse = np.stack(read_video(other)[0][::-1])
    from framekv.tools.video import MP4Writer

    with MP4Writer(tmp_path / "r.mp4", fps=FPS, width=SIZE[1], height=SIZE[0], crf=0) as w:
        w.write(reverse)
    b, _ = run_v2v(tmp_path / "c.mp4", tmp_path / "r.mp4", decoder="tiny", seed=1)
    assert len(b) == len(a) and all(not np.array_equal(x, y) for x, y in zip(a, b))
    t2v, _ = run_generate(tmp_path / "d.mp4", chunks=2, seed=1, decoder="tiny")
    assert not np.array_equal(a[0], t2v[0])                          # the input is used


@pytest.mark.gpu
def test_cuda_graphs_match_eager_for_a_video_input(clip, tmp_path):
    """On CUDA the encoder's two chunk graphs are captured up front beside the rollout's
    and the decoder's: the same frames as eager, for both coders (bf16 both ways)."""
    n = video_frames(tiny_sizes()[0], 2)
    for decoder in ("wan", "tiny"):
        graphs, r = run_v2v(tmp_path / f"g-{decoder}.mp4", clip, decoder=decoder, device="cuda")
        eager, _ = run_v2v(tmp_path / f"e-{decoder}.mp4", clip, decoder=decoder,
                           device="cuda", use_graphs=False)
        assert r.frames == n and len(graphs) == len(eager) == 2
        assert all(mae(g, e) < 1.0 for g, e in zip(graphs, eager)), decoder


# ---------------------------------------------------------------- refusals
@pytest.fixture
def no_model(monkeypatch):
    """Building the model fails the test: a refusal must come before it."""
    from framekv.engine.models.wan import WanFamily

    def load(*args, **kwargs):
        raise AssertionError("a model was built")
    monkeypatch.setattr(WanFamily, "load", load)


@pytest.mark.parametrize("args, match", [
    (["--video-in", "{tmp}/missing.mp4", "--strength", "0.5"],
     r"video-in must be a video file, got '.*missing.mp4' \(no such file\)"),
    (["--video-in", "{tmp}/text.mp4", "--strength", "0.5"],
     r"video-in '.*text.mp4' cannot be read as a video"),
    (["--video-in", "{tmp}/short.mp4", "--strength", "0.5"],
     r"video-in '.*short.mp4' holds 3 frames; one chunk needs 5"),
    (["--video-in", "{clip}", "--strength", "0"], r"--strength: must be a number in \(0, 1\], got 0"),
    (["--video-in", "{clip}", "--strength", "1.5"], r"--strength: must be a number in \(0, 1\]"),
    (["--video-in", "{clip}", "--strength", "nan"], r"--strength: must be a number in \(0, 1\]"),
    (["--video-in", "{clip}", "--strength", "0.1"],
     r"strength 0.1 runs none of the steps \[1000.0, 500.0\]: it must be at least 0.5"),
    (["--strength", "0.5", "--chunks", "1"], "--strength without --video-in"),
    (["--video-in", "{clip}"], "--video-in without --strength"),
    (["--sampler", "v2v", "--chunks", "1"], r"--sampler: invalid choice: 'v2v'"),
    (["--video-in", "{clip}", "--strength", "0.5", "--sampler", "v2v"],
     r"--sampler: invalid choice: 'v2v' \(choose from 'euler', 'self_forcing'\)"),
    (["--out", "{tmp}/x.mp4"], "--chunks N is needed"),
])
def test_each_refusal_is_one_line_before_any_model_is_built(args, match, clip, tmp_path, capsys,
                                                            no_model):
    (tmp_path / "text.mp4").write_text("not a video\n")
    stamped_video(tmp_path / "short.mp4", 3, SIZE, FPS)
    args = [a.format(tmp=tmp_path, clip=clip) for a in args]
    argv = ["generate", "--prompt", CAT, "--device", "cpu", "--no-progress", *args]
    if "--out" not in args:
        argv += ["--out", str(tmp_path / "x.mp4")]
    try:
        status = main(argv)
    except SystemExit as exc:                                       # argparse's own refusals
        status = exc.code
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1 and re.search(match, err), err
    assert sorted(os.listdir(tmp_path)) == ["short.mp4", "text.mp4"]


@pytest.mark.parametrize("kwargs, match", [
    (dict(video_in="{clip}", strength=0.0), r"strength must be a number in \(0, 1\]"),
    (dict(video_in="{clip}", strength=True), r"strength must be a number in \(0, 1\]"),
    (dict(chunks=1, strength=0.5), "strength needs video_in"),
    (dict(chunks=1, sampler="v2v"), "sampler 'v2v' is chosen by video_in and strength"),
    (dict(video_in="{clip}", strength=0.5, chunks=0), "chunks must be an integer >= 1, got 0"),
    (dict(video_in="{tmp}/none.mp4", strength=0.5), "video-in must be a video file"),
])
def test_generate_refuses_a_bad_video_input_before_any_model_is_built(kwargs, match, clip,
                                                                      tmp_path, no_model):
    kwargs = {k: v.format(clip=clip, tmp=tmp_path) if isinstance(v, str) else v
              for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        generate(CAT, out=tmp_path / "x.mp4", stream=io.StringIO(), **kwargs)
    assert os.listdir(tmp_path) == []


def test_an_input_that_breaks_part_way_fails_the_run_and_leaves_nothing(clip, tmp_path,
                                                                        monkeypatch, capsys):
    from framekv.tools.video_in import VideoInput

    real = VideoInput.read

    def read(self, chunks=None):                     # the file ends after its first chunk
        yield next(real(self, chunks))
        raise ValueError(f"video-in {self.path!r} ended after 1 of {chunks} chunks")
    monkeypatch.setattr(VideoInput, "read", read)
    out = tmp_path / "o.mp4"
    assert main(["generate", "--prompt", CAT, "--video-in", clip, "--strength", "0.5",
                 "--decoder", "tiny", "--out", str(out), "--device", "cpu",
                 "--no-progress"]) == 1                                   # the run failed
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("framekv generate: error: ") and "ended after 1 of 2" in err[-1]
    assert os.listdir(tmp_path) == []
