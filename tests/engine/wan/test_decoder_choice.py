"""``--decoder wan|tiny[:PATH]`` (`framekv.engine.wan.decoders`): choices parsed and
refused by name; a tiny decoder's checkpoint found in a diffusers folder; `WanPipeline`
building the decoder chosen (no Wan VAE loaded for a tiny one); `framekv generate`
writing the tiny decoder's frames (a checkpoint of the random tiny weights gives the
same frames, the Wan VAE other ones); a served session's frames equal to its latents
decoded offline by the tiny decoder; the encoder that follows each choice. The
commands' one-line refusals are in test_serve_defects.py.
"""
from __future__ import annotations

import argparse
import io

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from framekv.engine.serving import StreamScheduler, to_uint8  # noqa: E402
from framekv.engine.wan import StreamingVAEDecoder, TinyStreamingDecoder, WanPipeline  # noqa: E402
from framekv.engine.wan.decoders import check_decoder, parse_decoder  # noqa: E402
from framekv.tools.generate import generate  # noqa: E402
from framekv.tools.serve import wan_factory  # noqa: E402

TINY_CHANNELS = 4            # the tiny Wan config's latent channels


def write_tiny(path, seed=0):
    """A TAEHV checkpoint of `TinyStreamingDecoder.random`'s weights (``seed``)."""
    net = TinyStreamingDecoder.random(seed=seed, latent_channels=TINY_CHANNELS).net
    torch.save(net.taehv_state_dict(), path)
    return str(path)


def test_choices_parse(tmp_path):
    ckpt = write_tiny(tmp_path / "t.pth")
    assert parse_decoder("wan") == ("wan", None) and parse_decoder("tiny") == ("tiny", None)
    assert parse_decoder(f"tiny:{ckpt}") == ("tiny", ckpt)


@pytest.mark.parametrize("value, words", [
    ("vae", ["must be wan, tiny or tiny:PATH", "'vae'"]),
    ("WAN", ["'WAN'"]), ("", ["got ''"]), ("tiny:", ["'tiny:'"]), ("wan:x", ["'wan:x'"]),
    (None, ["got None"]), (3, ["got 3"]),
    ("tiny:{tmp}/none.pth", ["none.pth", "no such file"]),
    ("tiny:{tmp}/notes.txt", ["notes.txt", "not .pth / .pt / .safetensors"]),
])
def test_bad_choices_are_refused_by_name(tmp_path, value, words):
    (tmp_path / "notes.txt").write_text("x")
    value = value.format(tmp=tmp_path) if isinstance(value, str) else value
    for name in ("decoder", "--decoder"):
        with pytest.raises(ValueError) as exc:
            parse_decoder(value, name=name)
        msg = str(exc.value)
        assert msg.startswith(f"{name} ") and all(w in msg for w in words), msg


def test_tiny_takes_the_weights_folders_checkpoint(tmp_path):
    assert check_decoder("tiny") == ("tiny", None)                # random parts: random
    with pytest.raises(ValueError, match=r"--decoder tiny needs a TAEHV checkpoint.*'"):
        check_decoder("tiny", tmp_path, name="--decoder")
    pth = write_tiny(tmp_path / "taew2_1.pth")
    assert check_decoder("tiny", tmp_path) == ("tiny", pth)
    (tmp_path / "taew2_1.safetensors").write_bytes(b"")
    assert check_decoder("tiny", tmp_path) == ("tiny", str(tmp_path / "taew2_1.safetensors"))
    other = write_tiny(tmp_path / "other.pth")
    assert check_decoder(f"tiny:{other}", tmp_path) == ("tiny", other)
    assert check_decoder("wan", tmp_path) == ("wan", None)


def test_the_pipeline_builds_the_decoder_chosen(tmp_path):
    wan = WanPipeline.load("tiny", text_encoder=False, device="cpu")
    assert wan.vae is not None and type(wan.decoder()) is StreamingVAEDecoder
    tiny = WanPipeline.load("tiny", text_encoder=False, device="cpu", decoder="tiny")
    assert tiny.vae is None and tiny.decoder_choice == ("tiny", None)  # no Wan VAE loaded
    dec = tiny.decoder(2, use_graphs=False)
    assert isinstance(dec, TinyStreamingDecoder) and dec.sequences == 2
    assert dec.latent_channels == TINY_CHANNELS and dec.dtype == torch.float32
    with pytest.raises(ValueError, match="decoder must be wan, tiny or tiny:PATH"):
        WanPipeline.load("tiny", device="cpu", decoder="taehv")


def test_the_encoder_follows_the_decoder(tmp_path):
    """wan: the Wan VAE's encoder over the same vae; tiny:PATH: the encoder half of the
    checkpoint whose decoder half the decoder loads; tiny alone: random, seed 0."""
    from framekv.engine.wan import StreamingVAEEncoder, TinyStreamingEncoder, build_vae
    from framekv.engine.wan.decoders import build_decoder, build_encoder

    vae = build_vae("tiny")
    opts = dict(sequences=2, use_graphs=False, device="cpu", dtype=None,
                latent_channels=TINY_CHANNELS)
    wan = build_encoder("wan", None, vae=vae, **opts)
    assert type(wan) is StreamingVAEEncoder and wan.vae is vae and wan.sequences == 2
    enc = TinyStreamingEncoder.random(seed=3, latent_channels=TINY_CHANNELS)
    dec = TinyStreamingDecoder.random(seed=4, latent_channels=TINY_CHANNELS)
    path = tmp_path / "taew2_1.pth"
    torch.save({**dec.net.taehv_state_dict(), **enc.net.taehv_state_dict()}, path)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1, 3, 5, 16, 16, generator=g) * 2 - 1                # [B, 3, F, H, W]
    z = torch.randn(1, TINY_CHANNELS, 2, 2, 2, generator=g)              # [B, C, F, h, w]
    assert torch.equal(build_encoder("tiny", str(path), vae=None, **opts).encode(x, [1]),
                       enc.encode(x))
    assert torch.equal(build_decoder("tiny", str(path), vae=None, **opts).decode(z, [1]),
                       dec.decode(z))
    seed0 = TinyStreamingEncoder.random(seed=0, latent_channels=TINY_CHANNELS)
    assert torch.equal(build_encoder("tiny", None, vae=None, **opts).encode(x, [0]),
                       seed0.encode(x))


def run(out, **kwargs) -> list[torch.Tensor]:
    frames = []
    generate("a cat", chunks=2, out=out, device="cpu", progress=False, stream=io.StringIO(),
             on_frames=lambda i, f: frames.append(f.clone()), **kwargs)
    return frames


def test_generate_writes_the_tiny_decoders_frames(tmp_path):
    tiny = run(tmp_path / "tiny.mp4", decoder="tiny")
    stored = run(tmp_path / "file.mp4", decoder=f"tiny:{write_tiny(tmp_path / 't.pth')}")
    other = run(tmp_path / "seed1.mp4", decoder=f"tiny:{write_tiny(tmp_path / 's.pth', 1)}")
    wan = run(tmp_path / "wan.mp4")
    assert [f.shape for f in tiny] == [f.shape for f in wan]        # the same frame counts
    assert all(torch.equal(a, b) for a, b in zip(tiny, stored))    # random = seed 0's file
    assert not torch.equal(tiny[1], other[1]) and not torch.equal(tiny[1], wan[1])


def test_a_session_streams_the_tiny_decoders_frames():
    args = argparse.Namespace(config="tiny", preset=None, weights=None, device="cpu",
                              cache_dir=None, decoder="tiny")
    parts = wan_factory(args, use_graphs=False)
    sched = StreamScheduler(max_sessions=2, queue_chunks=3, runner_factory=parts,
                            decoder_factory=parts.decoder)
    try:
        assert isinstance(sched.decoder, TinyStreamingDecoder) and parts.vae is None
        sid = sched.open_session(seed=5, chunks=2).id
        while sched.step():
            pass
        chunks = [sched.next_chunk(sid, 0) for _ in range(2)]
    finally:
        sched.close()
    ref = TinyStreamingDecoder.random(latent_channels=TINY_CHANNELS, sequences=1)
    for c in chunks:
        want = to_uint8(ref.decode(c.latents[None]))[0]
        assert c.video.shape == want.shape and c.video.dtype == torch.uint8
        # a batched decode in the scheduler against one alone: rounding flips at most
        assert (c.video.int() - want.int()).abs().max() <= 1, c.index
