"""`DecodeLane` (framekv.engine.decode_lane): chunks decoded in the order submitted,
equal to the decoder's own frames as uint8 (`to_uint8`), one after the other on a CPU
and on a CUDA stream of their own beside the caller's work (the same frames bit for
bit, for the Wan VAE and the tiny decoder, graphed); NaN frames refused; misuse named.
"""
from __future__ import annotations

import pytest
import torch

from framekv.engine.decode_lane import DecodeLane
from framekv.engine.serving import to_uint8
from framekv.engine.wan import TinyStreamingDecoder

C, F, H, W = 4, 2, 6, 5


def chunks(n, batch=1, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, C, F, H, W, generator=g).to(device) for _ in range(n)]


def tiny(device="cpu", **kw):
    return TinyStreamingDecoder.random(latent_channels=C, widths=(16, 8, 8, 8), device=device,
                                       **kw)


def test_without_overlap_each_chunk_is_decoded_at_once_in_order():
    lats = chunks(4, batch=2)
    ref = tiny(sequences=2)
    want = [to_uint8(ref.decode(z)) for z in lats]
    for overlap in (None, True, False):          # a CPU has no stream to overlap on
        lane = DecodeLane(tiny(sequences=2), overlap=overlap)
        assert not lane.overlap and lane.stream is None
        got = []
        for z in lats:
            lane.submit(z, rows=[0, 1])
            assert len(lane) == 1
            got.append(lane.take())
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert got[0].shape == (2, 4 * F - 3, 8 * H, 8 * W, 3) and got[0].dtype == torch.uint8


def test_drain_takes_every_chunk_oldest_first_and_misuse_is_named():
    lane = DecodeLane(tiny())
    lats = chunks(3)
    for z in lats:
        lane.submit(z)
    ref = tiny()
    assert [torch.equal(a, to_uint8(ref.decode(z))) for a, z in zip(lane.drain(), lats)] == [
        True] * 3
    with pytest.raises(IndexError, match="no chunk submitted"):
        lane.take()
    with pytest.raises(ValueError, match="overlap must be None, True or False, got 'yes'"):
        DecodeLane(tiny(), overlap="yes")
    with pytest.raises(ValueError, match="finite"):
        lane.submit(torch.full((1, C, F, H, W), float("nan")))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["tiny", "wan"])
def test_overlapped_frames_equal_sequential_ones_on_cuda(kind):
    from framekv.engine.wan import StreamingVAEDecoder, build_vae

    def make():                            # both of C latent channels, graphed
        if kind == "tiny":
            return TinyStreamingDecoder.random(latent_channels=C, device="cuda", sequences=2)
        return StreamingVAEDecoder(build_vae("tiny", device="cuda"), sequences=2)

    lats = chunks(5, batch=2, device="cuda")
    lapped, plain = DecodeLane(make()), DecodeLane(make(), overlap=False)
    assert lapped.overlap and lapped.stream is not None and not plain.overlap
    work = torch.randn(2048, 2048, device="cuda")
    got, want = [], []
    for z in lats:
        _ = work @ work                    # the caller's stream busy, as with a transformer
        lapped.submit(z.clone(), rows=[0, 1])
        plain.submit(z.clone(), rows=[0, 1])
        if len(lapped) > 1:
            got.append(lapped.take())
        want.append(plain.take())
    got += lapped.drain()
    assert len(got) == len(want) == 5
    assert all(torch.equal(a, b) for a, b in zip(got, want)), kind
    lapped.submit(torch.full_like(lats[0], float("nan")), rows=[0, 1])
    with pytest.raises(ValueError, match="finite"):
        lapped.take()


@pytest.mark.gpu
def test_on_cuda_submit_returns_while_the_callers_stream_still_runs():
    """`submit` waits for nothing on the device: with the caller's stream asleep for a
    second, it returns before that work is done (a host sync anywhere in the decode, a
    pageable copy of its rows for one, would make it wait the second out)."""
    lane = DecodeLane(tiny("cuda", sequences=2))
    for z in chunks(2, batch=2, device="cuda"):          # both stages captured beforehand
        lane.submit(z, rows=[1, 0])
        lane.take()
    z = chunks(1, batch=2, seed=1, device="cuda")[0]
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)                     # about a second of GPU cycles
    busy = torch.cuda.Event()
    busy.record()
    lane.submit(z, rows=[1, 0])
    assert not busy.query(), "submit waited for the caller's stream"
    assert lane.take().shape == (2, 4 * F, 8 * H, 8 * W, 3)
