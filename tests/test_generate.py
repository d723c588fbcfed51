"""`framekv generate`: the whole prompt-to-MP4 path on the tiny config (random weights),
as a subprocess and in-process, its streaming, checkpoints, a diffusers folder, and its
errors.

The video is read back with PyAV and compared with the frames the pipeline decoded
(handed out by `generate`'s ``on_frames``), within what H.264 at the default quality
loses.
"""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("av")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from framekv.tools.cli import main  # noqa: E402
from framekv.tools.generate import generate  # noqa: E402
from framekv.engine.serving import to_uint8  # noqa: E402
from test_video import mae, read_video  # noqa: E402

CAT = "a cat"
#: RGB mean abs error (of 255) allowed between the MP4 and the frames the pipeline
#: decoded. Random weights decode to noise-like texture (a pixel's std ~30 levels, ~25
#: from frame to frame) and yuv420p keeps chroma at half resolution, which alone costs
#: such frames ~5-9 levels; crf 18 adds little. A different seed's video is ~15-20 away.
RGB_BOUND = 12.0
#: The same on luma (BT.601 Y), which yuv420p keeps at full resolution: what remains is
#: H.264's quantisation at crf 18.
LUMA_BOUND = 5.0


def luma(frames) -> np.ndarray:
    f = np.asarray(frames, np.float64)
    return f[..., 0] * 0.299 + f[..., 1] * 0.587 + f[..., 2] * 0.114


def tiny_sizes() -> tuple[int, int, int]:
    """(F, H, W): latent frames per chunk and the latent size of the tiny config's preset."""
    from framekv.engine.wan import PRESETS, preset_sizes

    kw = preset_sizes(PRESETS["tiny"])
    return kw["frames_per_chunk"], *kw["latent_size"]


def video_frames(F: int, chunks: int) -> int:
    return 1 + 4 * (F - 1) + 4 * F * (chunks - 1)


def run_generate(out, prompt=CAT, **kwargs) -> tuple[list[np.ndarray], object]:
    """`generate` in-process, quiet; (each chunk's frames as handed out, the result)."""
    chunks = []
    kwargs = {"chunks": 1, "device": "cpu", "progress": False, "stream": io.StringIO(),
              **kwargs}
    result = generate(prompt, out=out, on_frames=lambda i, f: chunks.append(f.numpy().copy()),
                      **kwargs)
    return chunks, result


@pytest.fixture(scope="module")
def cat(tmp_path_factory):
    """The command run as a subprocess (3 chunks of "a cat" into x.mp4), and the same
    video generated in this process (its frames as the pipeline decoded them)."""
    root = tmp_path_factory.mktemp("cat")
    cmd = [sys.executable, "-m", "framekv.tools.cli", "generate", "--config", "tiny",
           "--prompt", CAT, "--chunks", "3", "--out", "x.mp4", "--device", "cpu"]
    # The subprocess runs while this process generates its own copy.
    proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    chunks, result = run_generate(root / "y.mp4", chunks=3)
    out, err = proc.communicate(timeout=600)
    return {"root": root, "rc": proc.returncode, "stdout": out, "stderr": err,
            "chunks": chunks, "result": result}


def test_the_command_writes_the_video(cat):
    F, H, W = tiny_sizes()
    n = video_frames(F, 3)
    assert cat["rc"] == 0, cat["stderr"]
    path = cat["root"] / "x.mp4"
    assert (f"framekv generate: {n} frames of {8 * W}x{8 * H}" in cat["stdout"]
            and str(path) in cat["stdout"] and "video frames/s" in cat["stdout"])
    # stderr is a pipe: the progress bar is one plain line per chunk
    bars = [line for line in cat["stderr"].splitlines() if line.startswith("generate [")]
    assert len(bars) == 3 and "3/3" in bars[-1] and f"{n} frames" in bars[-1]
    assert sorted(os.listdir(cat["root"])) == ["x.mp4", "y.mp4"]        # no temp file left
    got, rate = read_video(path)
    assert got.shape == (n, 8 * H, 8 * W, 3) and rate == 16


def test_the_video_holds_the_decoded_frames(cat, tmp_path):
    got, _ = read_video(cat["root"] / "x.mp4")
    want = np.concatenate(cat["chunks"])                                 # [n, 8H, 8W, 3]
    assert got.shape == want.shape
    picks = [0, 1, len(want) // 2, len(want) - 1]
    assert max(mae(got[i], want[i]) for i in picks) < RGB_BOUND
    assert max(mae(luma(got[i]), luma(want[i])) for i in picks) < LUMA_BOUND
    # another seed's frames are far outside both bounds: the check can fail
    other, _ = run_generate(tmp_path / "s1.mp4", seed=1)
    k = len(other[0])
    assert mae(got[:k], other[0]) > RGB_BOUND and mae(luma(got[:k]), luma(other[0])) > LUMA_BOUND


def test_streaming_chunks_and_the_result(cat):
    F, H, W = tiny_sizes()
    r = cat["result"]
    assert [len(c) for c in cat["chunks"]] == [video_frames(F, 1)] + [4 * F] * 2
    assert all(c.shape[1:] == (8 * H, 8 * W, 3) and c.dtype == np.uint8 for c in cat["chunks"])
    assert (r.frames, r.width, r.height) == (video_frames(F, 3), 8 * W, 8 * H)
    assert r.path == str(cat["root"] / "y.mp4") and r.size == os.path.getsize(r.path) > 0
    assert r.seconds > 0 and r.frames_per_second == r.frames / r.seconds


def test_same_seed_and_prompt_reproduce_other_prompts_differ(cat, tmp_path):
    again, _ = run_generate(tmp_path / "a.mp4")           # the first chunk of the same video
    assert np.array_equal(again[0], cat["chunks"][0])
    dog, _ = run_generate(tmp_path / "b.mp4", prompt="a dog")
    # the tiny random text encoder moves the video a little, but surely (0 when equal)
    assert mae(dog[0], cat["chunks"][0]) > 1.0


def test_a_checkpoint_replaces_the_transformer(cat, tmp_path):
    from framekv.engine.wan import build_model, save_original_checkpoint

    save_original_checkpoint(build_model("tiny", device="cpu"), tmp_path / "same.pt")
    same, _ = run_generate(tmp_path / "a.mp4", checkpoint=tmp_path / "same.pt", chunks=2)
    # A checkpoint samples as Self-Forcing does by default: the config's own weights run
    # that way give the same video, up to the CPU GEMMs' rounding at other addresses.
    sf, _ = run_generate(tmp_path / "b.mp4", sampler="self_forcing", shift=5.0, chunks=2)
    for a, b in zip(same, sf):
        assert np.abs(a.astype(int) - b).max() <= 1
    assert mae(sf[0], cat["chunks"][0]) > 1.0                  # not the Euler sampler's video
    save_original_checkpoint(build_model("tiny", device="cpu", seed=3), tmp_path / "other.pt")
    other, _ = run_generate(tmp_path / "c.mp4", checkpoint=tmp_path / "other.pt")
    assert mae(other[0], sf[0][:len(other[0])]) > RGB_BOUND


def test_the_timesteps_follow_the_sampler(tmp_path):
    from framekv.engine.wan.pipeline import sampling

    sizes = {"timesteps": (1000.0, 750.0, 500.0, 250.0)}
    sf = sampling(sizes["timesteps"], checkpoint=True)
    # Self-Forcing's warp, shift 5: t = 1000 * 5 s / (1 + 4 s) at s = 1, .75, .5, .25
    assert sf["sampler"] == "self_forcing"
    np.testing.assert_allclose(sf["timesteps"], [1000.0, 937.5, 2500 / 3, 625.0])
    plain = sampling(sizes["timesteps"], checkpoint=False)
    assert plain["sampler"] == "euler" and plain["timesteps"] == sizes["timesteps"]


def test_a_diffusers_folder(tmp_path):
    from framekv.engine.step import chunk_noise
    from framekv.engine.wan import PRESETS, TextEncoder, WanRollout, build_model, preset_sizes
    from framekv.engine.wan.vae import StreamingVAEDecoder, build_vae
    from wan_text_harness import save_text_parts

    root = tmp_path / "wan"
    model, vae = build_model("tiny", device="cpu", seed=4), build_vae("tiny", device="cpu", seed=5)
    model.save_pretrained(root / "transformer")
    vae.save_pretrained(root / "vae")
    save_text_parts(root, seed=6)
    got, result = run_generate(tmp_path / "w.mp4", prompt="a cat sleeps", weights=root)
    # The same parts by hand: the folder's encoder at the tiny preset's prompt length.
    kw = preset_sizes(PRESETS["tiny"])
    text = TextEncoder.from_pretrained(root, max_tokens=kw["prompt_tokens"]).encode("a cat sleeps")
    r = WanRollout(model, use_graphs=False, **kw)
    r.set_prompt(text)
    latents = r.step(chunk_noise(0, 0, r.chunk_shape)[None])
    want = to_uint8(StreamingVAEDecoder(vae).decode(latents))[0].numpy()
    assert np.abs(got[0].astype(int) - want).max() <= 1 and result.frames == len(want)


# ---------------------------------------------------------------- errors
def cli(tmp_path, *args) -> list[str]:
    return ["generate", "--prompt", CAT, "--device", "cpu", "--no-progress", *args]


@pytest.mark.parametrize("args, match", [
    (["--chunks", "1", "--out", "{tmp}/x.avi"], r"--out: must be a file ending in \.mp4"),
    (["--chunks", "0", "--out", "{tmp}/x.mp4"], r"--chunks: must be an integer >= 1, got 0"),
    (["--chunks", "1", "--out", "{tmp}/no/x.mp4"], "does not exist"),
    (["--chunks", "1", "--out", "{tmp}/x.mp4", "--fps", "0"], "--fps: must be an integer >= 1"),
    (["--chunks", "1", "--out", "{tmp}/x.mp4", "--config", "huge"], "invalid choice: 'huge'"),
    (["--chunks", "1", "--out", "{tmp}/x.mp4", "--config", "tiny", "--weights", "{tmp}"],
     "not allowed with argument"),
    (["--chunks", "1", "--out", "{tmp}/x.mp4", "--prompt", ""],
     "--prompt: must hold at least one word .*, got ''"),
    (["--chunks", "1", "--out", "{tmp}/x.mp4", "--prompt", " \t "],
     r"--prompt: must hold at least one word .*, got ' \\t '"),
    (["--chunks", "1", "--out", "{tmp}/x.mp4", "--chunk", "2"],
     "unrecognized arguments: --chunk$"),
])
def test_bad_arguments_exit_2_at_parse_time(tmp_path, capsys, args, match):
    with pytest.raises(SystemExit) as exc:
        main(cli(tmp_path, *[a.format(tmp=tmp_path) for a in args]))
    assert exc.value.code == 2
    assert re.search(match, capsys.readouterr().err.strip())
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, match", [
    (["--weights", "{tmp}/missing"], r"weights must be a local diffusers folder, got '.*missing'"),
    (["--weights", "{tmp}/empty"], r"lacks transformer/, vae/, text_encoder/ \+ tokenizer/"),
    (["--checkpoint", "{tmp}/missing.pt"], "checkpoint must be a generator checkpoint file"),
    (["--negative-prompt", "blurry"], "negative_prompt needs guidance_scale"),
    (["--preset", "nope"], "nope"),
    (["--device", "tpu"], "tpu"),
])
def test_bad_weights_and_options_exit_2_with_nothing_written(tmp_path, capsys, args, match):
    (tmp_path / "empty").mkdir()
    out = tmp_path / "x.mp4"
    argv = cli(tmp_path, "--chunks", "1", "--out", str(out), *[a.format(tmp=tmp_path) for a in args])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("framekv generate: error: ") and re.search(match, err), err
    assert sorted(os.listdir(tmp_path)) == ["empty"]


def test_an_unwritable_folder_exits_2(tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    if os.access(locked, os.W_OK):  # root writes anywhere: deny the folder as a user's would be
        real = os.access
        monkeypatch.setattr(os, "access", lambda p, mode, **k: (
            False if os.path.abspath(p) == str(locked) and mode & os.W_OK else real(p, mode, **k)))
    with pytest.raises(SystemExit) as exc:
        main(cli(tmp_path, "--chunks", "1", "--out", str(locked / "x.mp4")))
    assert exc.value.code == 2 and "permission denied" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is not writable"):
        generate(CAT, chunks=1, out=locked / "x.mp4")
    assert os.listdir(locked) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(chunks=0), "chunks must be an integer >= 1, got 0"),
    (dict(chunks=1, seed=-1), "seed must be an integer >= 0, got -1"),
    (dict(chunks=1, out="x.avi"), r"out must be a file ending in \.mp4, got 'x.avi'"),
    (dict(chunks=1, config="huge"), r"config must be one of \['tiny', '1.3b'\], got 'huge'"),
    (dict(chunks=1, guidance_scale=0.0), "guidance_scale must be a number > 0, got 0.0"),
    (dict(chunks=1, sampler="ddim"), r"sampler must be one of \['euler', 'self_forcing', 'v2v'\]"),
    (dict(chunks=1, shift=-1.0), "shift must be a number > 0, got -1.0"),
])
def test_generate_refuses_arguments(tmp_path, kwargs, match):
    kwargs = {"out": tmp_path / "x.mp4", **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(CAT, **kwargs)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_a_prompt_without_a_word_is_refused_before_anything_loads(tmp_path, prompt):
    with pytest.raises(ValueError, match=f"prompt must hold at least one word .*"
                                         f"{re.escape(repr(prompt))}"):
        generate(prompt, chunks=1, out=tmp_path / "x.mp4")
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("fps", [8, 16, 30])
def test_a_20_chunk_video_reads_back_frame_for_frame(tmp_path, fps):
    """20 chunks of the tiny config (157 frames: past the encoder's lookahead, whose
    delayed packets once broke the file) at 8, 16 and 30 fps; the default 16 as the
    command writes it, the others in-process, each frame read back against the one the
    pipeline decoded."""
    F, H, W = tiny_sizes()
    n, path = video_frames(F, 20), tmp_path / "long.mp4"
    assert n >= 150
    if fps == 16:
        out = subprocess.run([sys.executable, "-m", "framekv.tools.cli", "generate",
                              "--config", "tiny", "--prompt", CAT, "--chunks", "20", "--out",
                              str(path), "--no-progress"], capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stderr
        want = None
    else:
        chunks, _ = run_generate(path, chunks=20, fps=fps)
        want = np.concatenate(chunks)                                     # [n, 8H, 8W, 3]
    got, rate = read_video(path)
    assert got.shape == (n, 8 * H, 8 * W, 3) and rate == fps
    import av

    with av.open(str(path)) as c:
        stream = c.streams.video[0]
        assert stream.frames == n
        assert float(stream.duration * stream.time_base) == pytest.approx(n / fps, abs=1e-3)
    if want is not None:
        assert max(mae(luma(g), luma(w)) for g, w in zip(got, want)) < LUMA_BOUND


def test_a_failure_mid_run_leaves_nothing(tmp_path):
    def fail(index, frames):
        if index == 1:
            raise RuntimeError("consumer failed")

    with pytest.raises(RuntimeError, match="consumer failed"):
        generate(CAT, chunks=3, out=tmp_path / "x.mp4", device="cpu", progress=False,
                 stream=io.StringIO(), on_frames=fail)
    assert os.listdir(tmp_path) == []


def test_guidance_with_a_negative_prompt_runs(tmp_path, capsys):
    out = tmp_path / "g.mp4"
    assert main(cli(tmp_path, "--chunks", "2", "--out", str(out), "--guidance-scale", "3",
                    "--negative-prompt", "blurry", "--fps", "8", "--seed", "2")) == 0
    F, H, W = tiny_sizes()
    got, rate = read_video(out)
    assert got.shape == (video_frames(F, 2), 8 * H, 8 * W, 3) and rate == 8
    assert "generate [" not in capsys.readouterr().err                     # --no-progress


@pytest.mark.gpu
def test_cuda_graphs_match_eager(tmp_path):
    graphs, r = run_generate(tmp_path / "g.mp4", chunks=3, device="cuda")
    eager, _ = run_generate(tmp_path / "e.mp4", chunks=3, device="cuda", use_graphs=False)
    F, H, W = tiny_sizes()
    assert r.frames == video_frames(F, 3) and (r.width, r.height) == (8 * W, 8 * H)
    for g, e in zip(graphs, eager):  # bf16 both ways: the same math, replayed
        assert mae(g, e) < 1.0


@pytest.mark.gpu
def test_overlapped_decode_writes_the_same_frames(tmp_path):
    """Each chunk decoded on the lane's stream beside the next one's transformer, or
    after it: the same frames, bit for bit, for both decoders."""
    for decoder in ("wan", "tiny"):
        lapped, r = run_generate(tmp_path / f"o-{decoder}.mp4", chunks=4, device="cuda",
                                 decoder=decoder)
        plain, _ = run_generate(tmp_path / f"p-{decoder}.mp4", chunks=4, device="cuda",
                                decoder=decoder, overlap=False)
        assert len(lapped) == len(plain) == 4 and r.frames == sum(len(f) for f in plain)
        assert all(np.array_equal(a, b) for a, b in zip(lapped, plain)), decoder
