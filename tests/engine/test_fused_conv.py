"""`fused_conv.conv_add`: conv(x) + bias + residual. On the CPU torch's conv then add; on
a GPU each geometry's chosen way, and every candidate way, checked against an fp64
reference for 2-D and 3-D convs (the folded, downsampling and time-strided kinds the
Wan VAE runs), each of bias and residual on or off; strided inputs, a CUDA graph's
replay with new data, a key first met inside a capture, and the choice files (read,
written, a bad entry chosen again)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from framekv.engine import fused_conv
from framekv.engine.fused_conv import (ConvKey, _channels_last, _out_shape, choice, conv_add,
                                        conv_add_reference)

CL = {2: torch.channels_last, 3: torch.channels_last_3d}


def _case(n, N, C, K, S, k, stride, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, C, *S, generator=g).to(device, dtype).contiguous(memory_format=CL[n])
    w = (torch.randn(K, C, *k, generator=g) / (C * 9) ** 0.5).to(device, dtype)
    b = torch.randn(K, generator=g).to(device, dtype)
    # time is padded by the cached steps; a 4x4 downsample by 1 (a 3x3 and its pad folded)
    pad = tuple(0 if (n == 3 and i == 0) else min(kk // 2, 1) for i, kk in enumerate(k))
    shape = _out_shape(x.shape, w.shape, pad, stride)
    # the residual stamped per channel and position, so a transposed read shows
    r = (torch.arange(shape[1]).view(1, -1, *[1] * n) * 0.5
         + torch.linspace(-1, 1, int(torch.tensor(shape[2:]).prod())).view(1, 1, *shape[2:]))
    r = r.expand(shape).to(device, dtype).contiguous(memory_format=CL[n])
    return x, w.contiguous(memory_format=CL[n]), b, r, pad


def _fp32(x, w, b, r, pad, stride):
    f = F.conv3d if x.dim() == 5 else F.conv2d
    y = f(x.double(), w.double(), None if b is None else b.double(), padding=pad, stride=stride)
    return y if r is None else y + r.double()


def _close(y, x, w, b, r, pad, stride):
    """|y - fp64| within two bf16 roundings of the conv's and the residual's size (torch's
    way rounds the conv, then the sum) and an accumulation floor; returns the worst error."""
    conv = _fp32(x, w, b, None, pad, stride)
    want = conv if r is None else conv + r.double()
    size = conv.abs() if r is None else conv.abs() + r.double().abs()
    err = (y.double() - want).abs()
    assert bool((err <= 0.02 + 0.008 * size).all()), float(err.max())
    return float(err.max())


def test_out_shape_and_channels_last_strides():
    assert _out_shape(torch.Size([2, 8, 5, 6, 7]), torch.Size([4, 8, 3, 3, 3]), (0, 1, 1),
                      (1, 2, 2)) == [2, 4, 3, 3, 4]
    for shape in ([2, 8, 5, 6, 7], [3, 4, 9, 11]):
        want = torch.empty(shape, memory_format=CL[len(shape) - 2]).stride()
        assert _channels_last(shape) == list(want)


@pytest.mark.parametrize("bias,res", [(False, False), (True, False), (False, True), (True, True)])
def test_cpu_is_torchs_conv_then_add(bias, res):
    x, w, b, r, pad = _case(2, 2, 8, 6, (7, 9), (3, 3), (1, 1))
    y = conv_add(x, w, b if bias else None, r.clone() if res else None, pad, 1)
    want = F.conv2d(x, w, b if bias else None, padding=pad)
    assert torch.equal(y, want + r if res else want)
    assert torch.allclose(y.double(), _fp32(x, w, b if bias else None, r if res else None,
                                            pad, 1), atol=1e-4)


def test_reference_takes_ints_or_tuples():
    x, w, b, r, pad = _case(3, 1, 4, 4, (4, 5, 6), (3, 3, 3), (1, 2, 2))
    a = conv_add_reference(x, w, b, None, pad, (1, 2, 2))
    assert torch.equal(a, F.conv3d(x, w, b, padding=pad, stride=(1, 2, 2)))
    x2, w2, _, _, _ = _case(2, 1, 4, 4, (6, 6), (3, 3), (1, 1))
    assert torch.equal(conv_add_reference(x2, w2, None, None, 1, 2),
                       F.conv2d(x2, w2, padding=(1, 1), stride=(2, 2)))


# --------------------------------------------------------------------------- GPU

GEOMETRIES = [  # (spatial dims, N, C_in, C_out, S, k, stride): the VAE's kinds, small
    (2, 6, 96, 32, (24, 40), (3, 3), (1, 1)),        # a folded causal conv (taps on C)
    (2, 4, 64, 64, (16, 26), (4, 4), (2, 2)),        # the encoder's 4x4 downsample
    (3, 1, 64, 48, (7, 12, 20), (3, 3, 3), (1, 1, 1)),
    (3, 1, 32, 32, (6, 10, 14), (3, 1, 1), (2, 1, 1)),   # a time downsample
]


@pytest.mark.gpu
@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: f"{g[0]}d-{g[2]}-{g[3]}")
@pytest.mark.parametrize("bias,res", [(False, False), (True, False), (False, True), (True, True)])
def test_gpu_matches_fp32(geom, bias, res):
    n, N, C, K, S, k, stride = geom
    x, w, b, r, pad = _case(n, N, C, K, S, k, stride, torch.bfloat16, "cuda")
    bb, rr = b if bias else None, r if res else None
    y = conv_add(x, w, bb, rr, pad, stride)
    assert y.shape == _fp32(x, w, bb, rr, pad, stride).shape and y.dtype == torch.bfloat16
    assert y.is_contiguous(memory_format=CL[n])
    _close(y, x, w, bb, rr, pad, stride)


@pytest.mark.gpu
def test_gpu_reads_a_strided_input_and_residual():
    x, w, b, r, pad = _case(2, 4, 96, 32, (10, 12), (3, 3), (1, 1), torch.bfloat16, "cuda")
    buf = torch.zeros(4, 10, 12, 160, dtype=torch.bfloat16, device="cuda")
    buf[..., 16:112].copy_(x.permute(0, 2, 3, 1))
    xs = buf[..., 16:112].permute(0, 3, 1, 2)          # channels of a wider buffer
    rbuf = torch.zeros(4, 10, 12, 48, dtype=torch.bfloat16, device="cuda")
    rbuf[..., 8:40].copy_(r.permute(0, 2, 3, 1))
    rs = rbuf[..., 8:40].permute(0, 3, 1, 2)
    y = conv_add(xs, w, b, rs, pad, 1)               # its own key: the strides differ
    _close(y, x, w, b, r, pad, 1)
    assert not buf[..., :16].any() and not buf[..., 112:].any()


@pytest.mark.gpu
def test_gpu_graph_replay_reads_new_data():
    x, w, b, r, pad = _case(3, 1, 64, 64, (5, 8, 12), (3, 3, 3), (1, 1, 1), torch.bfloat16, "cuda")
    conv_add(x, w, b, r, pad, 1)                      # built outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = conv_add(x, w, b, r, pad, 1)
    x2, _, _, r2, _ = _case(3, 1, 64, 64, (5, 8, 12), (3, 3, 3), (1, 1, 1), torch.bfloat16,
                            "cuda", seed=5)
    x.copy_(x2)
    r.copy_(r2)
    g.replay()
    assert torch.equal(y, conv_add(x2, w, b, r2, pad, 1))


def _key_of(x, w, b, r, pad, stride):
    return ConvKey(x.device.index or 0, x.dtype, (tuple(x.shape), x.stride()),
                   (tuple(w.shape), w.stride()), None if b is None else b.dtype,
                   None if r is None else (tuple(r.shape), r.stride()), pad, stride)


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No choice made yet in this process; a choice folder of the test's own."""
    monkeypatch.setattr(fused_conv, "_RUNS", {})
    monkeypatch.setattr(fused_conv, "_FILE_CACHE", {})
    fused_conv.use_choice_dir(tmp_path / "choices")
    yield tmp_path / "choices"
    fused_conv.use_choice_dir(None)


@pytest.mark.gpu
@pytest.mark.parametrize("geom", GEOMETRIES, ids=lambda g: f"{g[0]}d-{g[2]}-{g[3]}")
def test_gpu_every_candidate_matches_fp32(geom, fresh):
    n, N, C, K, S, k, stride = geom
    x, w, b, r, pad = _case(n, N, C, K, S, k, stride, torch.bfloat16, "cuda")
    key = _key_of(x, w, b, r, pad, stride)
    runs = fused_conv._candidates(key)
    kinds = {run.choice if run.choice == "torch" else run.choice[0] for run in runs}
    assert "torch" in kinds and len(kinds) >= 2, kinds    # cuDNN proposes some plan
    for run in runs:
        try:
            _close(run(x, w, b, r), x, w, b, r, pad, stride)
        except AssertionError as e:
            raise AssertionError(f"{run.choice}: {e}") from None


@pytest.mark.gpu
def test_gpu_a_choice_is_saved_and_the_next_process_takes_it(fresh):
    x, w, b, r, pad = _case(3, 1, 32, 32, (5, 8, 10), (3, 3, 3), (1, 1, 1), torch.bfloat16, "cuda")
    key = _key_of(x, w, b, r, pad, (1, 1, 1))
    y = conv_add(x, w, b, r, pad, 1)
    made = choice(key)
    assert made is not None
    files = list(fresh.iterdir())
    assert len(files) == 1 and files[0].name.startswith("convs-")
    # another process: nothing run yet; its choice is the file's, even where it would
    # time another way faster (the file says torch's: it runs torch's, bit for bit)
    fused_conv._RUNS.clear()
    fused_conv._FILE_CACHE.clear()
    files[0].write_text('{"%s": "torch"}' % key.name())
    y2 = conv_add(x, w, b, r, pad, 1)
    assert choice(key) == "torch"
    assert torch.equal(y2, conv_add_reference(x, w, b, r, pad, 1))
    assert y.shape == y2.shape


@pytest.mark.gpu
def test_gpu_a_bad_saved_entry_is_chosen_again(fresh):
    x, w, b, r, pad = _case(2, 2, 32, 16, (8, 8), (3, 3), (1, 1), torch.bfloat16, "cuda")
    key = _key_of(x, w, b, r, pad, (1, 1))
    conv_add(x, w, b, r, pad, 1)
    path = next(fresh.iterdir())
    for bad in ('["fused", "0"]', '["warp", 1]', '7', '"cudnn"'):
        fused_conv._RUNS.clear()
        fused_conv._FILE_CACHE.clear()
        path.write_text('{"%s": %s}' % (key.name(), bad))
        conv_add(x, w, b, r, pad, 1)
        assert choice(key) is not None
        saved = json.loads(path.read_text())[key.name()]
        assert saved == "torch" or (saved[0] in ("fused", "plain") and type(saved[1]) is int)


@pytest.mark.gpu
def test_gpu_a_key_first_met_in_a_capture_runs_torchs_way(fresh):
    x, w, b, r, pad = _case(2, 2, 32, 32, (12, 12), (3, 3), (1, 1), torch.bfloat16, "cuda")
    key = _key_of(x, w, b, r, pad, (1, 1))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = conv_add(x, w, b, r, pad, 1)
    assert choice(key) is None                         # nothing timed in the capture
    g.replay()
    assert torch.equal(y, conv_add_reference(x, w, b, r, pad, 1))
    conv_add(x, w, b, r, pad, 1)
    assert choice(key) is not None                     # chosen at the next eager call


def test_saved_choices_read_back_and_bad_ones_are_ignored(monkeypatch, tmp_path):
    path = tmp_path / "convs-x.json"
    monkeypatch.setattr(fused_conv, "_file", lambda device: str(path))
    monkeypatch.setattr(fused_conv, "_FILE_CACHE", {})
    key = ConvKey(0, torch.bfloat16, ((1, 8, 4, 4), (128, 1, 32, 8)), ((8, 8, 3, 3), (72, 1, 24, 8)),
                  None, None, (1, 1), (1, 1))
    other = ConvKey(0, torch.bfloat16, ((2, 8, 4, 4), (128, 1, 32, 8)), ((8, 8, 3, 3), (72, 1, 24, 8)),
                    None, None, (1, 1), (1, 1))
    assert fused_conv._saved(key) is None              # no file yet
    fused_conv._save(key, ("plain", 3))
    path.write_text(path.read_text().replace("}", ', "stranger": 1}'))   # another writer's
    fused_conv._save(other, "torch")
    fused_conv._FILE_CACHE.clear()
    assert fused_conv._saved(key) == ("plain", 3) and fused_conv._saved(other) == "torch"
    assert "stranger" in path.read_text()              # kept
    path.write_text("{not json")
    fused_conv._FILE_CACHE.clear()
    assert fused_conv._saved(key) is None              # unreadable: chosen again
    assert key.name() != other.name() and "cuda" not in key.name()
