"""Checks every streaming coder's tests run alike, whichever way it goes: the decoders
(`StreamingVAEDecoder`, `TinyStreamingDecoder`: latents in, frames out) and the
encoders (`StreamingVAEEncoder`, `TinyStreamingEncoder`: frames in, latents out). Each
takes the coder and the data its own test made; the tests say what differs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framekv.graphs import GraphCache


def run(coder, x: torch.Tensor, rows=None) -> torch.Tensor:
    """One chunk: ``decode`` for a decoder, ``encode`` for an encoder."""
    return (coder.decode if hasattr(coder, "decode") else coder.encode)(x, rows)


def chunked(coder, x: torch.Tensor, split, rows=None) -> torch.Tensor:
    """``x`` [B, C, F, H, W] run in chunks of ``split`` frames, the outputs concatenated."""
    outs, f0 = [], 0
    for f in split:
        outs.append(run(coder, x[:, :, f0:f0 + f], rows))
        f0 += f
    assert f0 == x.shape[2]
    return torch.cat(outs, dim=2)


def check_refusals(cases) -> None:
    """Each ``(call, match)`` raises a ValueError matching ``match``."""
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def check_common_refusals(coder, x: torch.Tensor, frames_of) -> None:
    """What every coder refuses alike, by name, changing nothing: ``coder`` holds 2
    sequences, runs eagerly and has run nothing; ``x`` is a valid [2, C, F, H, W] input of
    a video's start; ``frames_of`` its frames-run count (`frames_decoded` /
    `frames_encoded`). An input of other channels, of 4 dims, of ints, on another
    device; rows out of range, repeated or too few, or a batch of 3; a reset, a count
    and a snapshot of a row out of range; a capture without graphs."""
    name, role, C = coder.INPUT, coder.ROLE, x.shape[1]
    check_refusals([
        (lambda: run(coder, x[:, :C - 1]),
         rf"{name} must be a floating \[B, {C}, F, H, W\].*\[2, {C - 1}, "),
        (lambda: run(coder, x[:, :, 0]), rf"{name} must be a \[B, C, F, H, W\] tensor, got ndim 4"),
        (lambda: run(coder, x.long()), rf"{name} must be a floating"),
        (lambda: run(coder, x.to("meta")), rf"{name} must be on the {role}'s device cpu"),
        (lambda: run(coder, x, [0, 2]), r"rows must be 2 distinct integers in \[0, 2\)"),
        (lambda: run(coder, x, [1, 1]), r"rows must be 2 distinct.*got \[1, 1\]"),
        (lambda: run(coder, x, [0]), r"rows must be 2 distinct"),
        (lambda: run(coder, torch.cat([x, x[:1]])), r"rows must be 3 distinct.*\[0, 2\)"),
        (lambda: coder.reset([5]), rf"rows must be distinct integers in \[0, 2\) \(the {role}'s"),
        (lambda: frames_of(2), r"row must be an integer in \[0, 2\).*got 2"),
        (lambda: coder.snapshot(-1), r"row must be an integer in \[0, 2\)"),
        (lambda: coder.capture(1, 1, tuple(x.shape[3:])), r"capture\(\) needs use_graphs=True")])
    assert coder.state == (0, 0) and coder.arena_bytes == 0       # no arena for a refused call


def check_row_subsets(coder, xs: list, solo: list, steps, atol: float = 1e-5) -> None:
    """``coder`` runs ``steps`` [(rows, f0, f)]: frames f0 .. f0 + f of the videos ``xs``
    of the sequences ``rows`` in one call; every call leaves the arena rows it does not
    name as they were, and each sequence's outputs equal ``solo[s]``."""
    got = {s: [] for s in range(len(xs))}
    for rows, f0, f in steps:
        kept = [] if coder._cache is None else [t.clone() for t in coder._cache.tensors]
        out = run(coder, torch.cat([xs[s][:, :, f0:f0 + f] for s in rows]), rows)
        for i, s in enumerate(rows):
            got[s].append(out[i:i + 1])
        others = [r for r in range(coder.sequences) if r not in rows]
        assert all(torch.equal(t[others], k[others]) for t, k in zip(coder._cache.tensors, kept))
    for s, want in enumerate(solo):
        torch.testing.assert_close(torch.cat(got[s], 2), want, rtol=0, atol=atol)


def check_rows_at_different_points(make, x: torch.Tensor, whole: torch.Tensor, a, b):
    """Row 0 runs frames [0, a[0]) of video x[0], row 1 [0, b[0]) of x[1]; then both in one
    call, [a[0], a[1]) and [b[0], b[1]); row 0 the rest: each row's outputs equal its
    ``whole`` run. Returns the batched call's output."""
    coder = make(sequences=2)
    first0, first1 = run(coder, x[0:1, :, :a[0]], [0]), run(coder, x[1:2, :, :b[0]], [1])
    both = run(coder, torch.cat([x[0:1, :, a[0]:a[1]], x[1:2, :, b[0]:b[1]]]), [0, 1])
    assert coder.state == (a[1], b[1])
    rest = run(coder, x[0:1, :, a[1]:], [0])
    torch.testing.assert_close(torch.cat([first0, both[0:1], rest], 2), whole[0:1], rtol=0,
                               atol=1e-5)
    torch.testing.assert_close(torch.cat([first1, both[1:2]], 2), whole[1:2], rtol=0, atol=1e-5)
    return both


def check_reset(coder, fresh, x1: torch.Tensor, cut1, x2: torch.Tensor, cut2) -> None:
    """After ``x1`` run in ``cut1``, `reset` starts every row over: ``x2`` in ``cut2`` gives
    the bits a ``fresh`` coder gives; a closed coder refuses to run and closes again
    quietly."""
    chunked(coder, x1, cut1)
    coder.reset()
    assert coder.state == (0,) * x1.shape[0]
    assert torch.equal(chunked(coder, x2, cut2), chunked(fresh, x2, cut2))
    coder.close()
    with pytest.raises(RuntimeError, match="closed"):
        run(coder, x2)
    coder.close()  # idempotent


def check_graph_path(coder, x: torch.Tensor, cut, ref: torch.Tensor, size, graphs: int,
                     warmup_iters: int = 2) -> torch.Tensor:
    """The CUDA path's wiring on a CPU (keys, warm-up without writes, static inputs,
    through `GraphCache`'s eager stand-in): ``capture(B, 2, size)`` captures both stages
    once and moves no row; ``x`` run in ``cut`` equals ``ref`` over ``graphs`` graphs;
    after a reset, the same bits. Returns the output."""
    coder.use_graphs, coder._graphs = True, GraphCache("cpu", warmup_iters=warmup_iters)
    B = x.shape[0]
    assert coder.capture(B, 2, size) == 2 and coder.state == (0,) * B
    assert coder.capture(B, 2, size) == 0
    got = chunked(coder, x, cut)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    assert coder.graph_count == graphs
    coder.reset()
    assert torch.equal(chunked(coder, x, cut), got) and coder.graph_count == graphs
    return got


def check_random_draws(coder_cls, x: torch.Tensor, **size) -> None:
    """``coder_cls.random`` draws from its seed alone (the global RNG untouched): the same
    seed the same outputs, another seed others; ``size``: the net's widths."""
    torch.manual_seed(0)
    ahead = torch.rand(1)
    torch.manual_seed(0)
    a = coder_cls.random(seed=3, latent_channels=4, device="cpu", **size)
    assert torch.equal(torch.rand(1), ahead)
    b = coder_cls.random(seed=3, latent_channels=4, device="cpu", sequences=2, **size)
    c = coder_cls.random(seed=4, latent_channels=4, device="cpu", **size)
    assert a.latent_channels == 4 and b.sequences == 2 and a.dtype == torch.float32
    ya, yb, yc = run(a, x), run(b, x, [0]), run(c, x)
    assert torch.equal(ya, yb) and not torch.equal(ya, yc)


def check_nothing_loaded(net, state: dict, match: str) -> None:
    """``net.load_taehv(state)`` refuses with ``match`` and leaves every weight as it was."""
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        net.load_taehv(state)
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def check_state_moves_between_programs(src, dst, x: torch.Tensor, head, tail: int) -> None:
    """Row 1 of ``src`` runs the chunks ``head`` of x; its snapshot goes on in row 2 of
    ``dst`` (the other program): the next chunk, from frame ``tail``, agrees."""
    f0 = 0
    for f in head:
        run(src, x[:, :, f0:f0 + f], [1])
        f0 += f
    dst.restore(2, src.snapshot(1))
    torch.testing.assert_close(run(dst, x[:, :, tail:], [2]), run(src, x[:, :, tail:], [1]),
                               rtol=0, atol=1e-5)


def check_channels_last_arena(fused, ref, x: torch.Tensor) -> None:
    """After ``x`` (two rows) on each: the fused program's arena is stored channels last
    ([S, steps, H, W, C], the layout's views over it), the modules' is not, and their
    snapshots share one form and agree."""
    run(fused, x), run(ref, x)
    arena = fused._cache
    for t, v, shape in zip(arena.rows_last, arena.tensors, arena.layout.shapes):
        C, steps, H, W = shape
        assert t.shape == (2, steps, H, W, C) and t.is_contiguous()
        assert v.shape == (2, *shape) and v.data_ptr() == t.data_ptr()
    assert ref._cache.rows_last is None
    a, b = fused.snapshot(1), ref.snapshot(1)
    assert [tuple(t.shape) for t in a["cache"]] == [tuple(t.shape) for t in b["cache"]]
    assert all(t.is_contiguous() for t in a["cache"])
    for u, v in zip(a["cache"], b["cache"]):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-5)


def check_unwritten(coder, fn, x: torch.Tensor) -> torch.Tensor:
    """``fn`` (a chunk program built with ``write=False``) over ``x`` on rows 0, 1 leaves
    every arena row as it was; returns its output."""
    before = [t.clone() for t in coder._cache.tensors]
    out = fn(x, torch.tensor([0, 1]))
    assert all(torch.equal(a, b) for a, b in zip(before, coder._cache.tensors))
    return out


def fused_pair(coder_cls, vae, **kw) -> tuple:
    """A coder of ``vae`` through the fused program and one through diffusers' modules."""
    return coder_cls(vae, fused=True, **kw), coder_cls(vae, fused=False, **kw)


def check_half_precision(coder_cls, half_vae) -> None:
    """An fp16 vae runs diffusers' modules by default and refuses ``fused=True`` by name;
    a flag that is no bool is refused."""
    assert coder_cls(half_vae).fused is False
    check_refusals([
        (lambda: coder_cls(half_vae, fused=True),
         "fused=True needs a bfloat16 or float32 vae, got torch.float16"),
        (lambda: coder_cls(half_vae, fused="yes"), "fused must be")])


def wan22_vae():
    """A small Wan 2.2 VAE (patch_size, is_residual): what the Wan 2.1 coders refuse."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            patch_size=2, is_residual=True, in_channels=12, out_channels=12,
                            latents_mean=[0.0] * 4, latents_std=[1.0] * 4)


# --------------------------------------------------------------------------- on a GPU
def check_graphed_equal_eager(graphed, eager, x: torch.Tensor, cuts, shape, dtype) -> torch.Tensor:
    """Each cut of ``x`` from a video's start, graphed and eager: bit-equal, finite, of
    ``shape`` and ``dtype``. Returns the last cut's output."""
    assert graphed.use_graphs and not eager.use_graphs
    for cut in cuts:
        graphed.reset()
        eager.reset()
        a, b = chunked(graphed, x, cut), chunked(eager, x, cut)
        assert a.dtype == dtype and a.shape == shape
        assert torch.isfinite(a).all() and torch.equal(a, b), cut
    return a


def check_rows_graphed_equal_eager(make, xs: list, steps) -> list[torch.Tensor]:
    """`check_row_subsets`' ``steps`` on a graphed coder and an eager one
    (``make(use_graphs)``): bit-equal per sequence, each row's frame count the sum of its
    steps'. Returns each sequence's outputs."""
    coders = {"graphed": make(True), "eager": make(False)}
    assert coders["graphed"].use_graphs and not coders["eager"].use_graphs
    got = {d: {s: [] for s in range(len(xs))} for d in coders}
    for rows, f0, f in steps:
        for name, coder in coders.items():
            out = run(coder, torch.cat([xs[s][:, :, f0:f0 + f] for s in rows]), rows)
            for i, s in enumerate(rows):
                got[name][s].append(out[i:i + 1])
    counts = tuple(sum(f for rows, _, f in steps if s in rows) for s in range(len(xs)))
    assert coders["graphed"].state == coders["eager"].state == counts
    outs = []
    for s in range(len(xs)):
        a, b = torch.cat(got["graphed"][s], 2), torch.cat(got["eager"][s], 2)
        assert torch.equal(a, b), s
        outs.append(a)
    return outs


def check_long_stream(coder, xs: list, capture: tuple) -> list[torch.Tensor]:
    """``capture`` (batch, frames, size) captures two graphs ahead; the chunks ``xs`` (a
    video's first, then later ones) replay them alone; a reset reproduces the first
    five; `close` frees the graphs and the arena (kept in whole device chunks)."""
    assert coder.capture(*capture) == 2 and coder.graph_count == 2 and coder.state == (0,)
    assert coder.capture(*capture) == 0
    first = [run(coder, x) for x in xs]
    assert coder.state == (sum(x.shape[2] for x in xs),)
    stats = coder._graphs.stats()
    assert coder.graph_count == 2 and stats.captures == 2 and stats.hits == len(xs)
    coder.reset()
    again = [run(coder, x) for x in xs[:5]]
    assert all(torch.equal(a, b) for a, b in zip(again, first))
    assert coder.graph_count == 2
    assert coder.arena_bytes > 0 and coder.arena_bytes % (2 << 20) == 0  # the arena's chunks
    coder.close()
    assert coder.arena_bytes == 0 and coder.graph_count == 0
    return first


def check_as_close_as(got: torch.Tensor, base: torch.Tensor, exact: torch.Tensor,
                      step: float) -> None:
    """``got`` (bf16) no further from the fp32 ``exact`` than ``base`` (diffusers' modules
    in bf16) is: at most a bf16 ``step`` more at the worst element, and at most 1.5 times
    as far on average."""
    err, ref = (got.float() - exact).abs(), (base.float() - exact).abs()
    assert err.max() <= ref.max() + step, (float(err.max()), float(ref.max()))
    assert err.mean() <= 1.5 * ref.mean(), (float(err.mean()), float(ref.mean()))


def check_fresh_output(coder, first: torch.Tensor, later: list) -> None:
    """A chunk's output is the caller's: replaying the graph for the ``later`` chunks
    leaves it as it was."""
    run(coder, first)
    a = run(coder, later[0])
    keep = a.clone()
    for x in later[1:]:
        run(coder, x)
    assert torch.equal(a, keep)


# --------------------------------------------------------------------------- tiny coders
def tiny_factory(coder_cls, size, seed: int = 7, channels: int = 16):
    """Fresh eager tiny coders over one set of random weights: a ``coder_cls.NET`` of
    ``channels`` latent channels and ``size`` (its widths)."""
    from framekv.engine.wan.tiny_blocks import random_init

    net = coder_cls.NET(channels, size)
    random_init(net, seed=seed)
    return lambda **kw: coder_cls(net, **{"use_graphs": False, **kw})


def check_refused_layouts(coder_cls, good: dict, wide: tuple, tmp_path) -> None:
    """``good``, a full TAEHV state (both parts, the checkpoint layout), with this coder's
    part broken each way and refused by name by a ``coder_cls.NET``'s `load_taehv`: a key
    renamed (one missing, one unexpected, both named), a key missing, two keys extra,
    the other part's keys alone (every key of this part missing); the renamed one by
    `from_file` naming the file; ``wide`` (a state, its shape error's match) with every
    weight left as it was."""
    net_cls = coder_cls.NET
    part = net_cls.PART
    mine = [k for k in good if k.startswith(part + ".")]
    old, gone = mine[8], mine[-3]
    renamed = {(f"{old}.9" if k == old else k): v for k, v in good.items()}
    extra = {**good, f"{part}.99.weight": torch.zeros(3), f"{part}.98.bias": torch.zeros(3)}
    cases = [
        (renamed, rf"{part} of this layout \(16 latent channels\): 1 missing {part} keys "
                  rf"\['{old}'\], 1 unexpected keys \['{old}.9'\]"),
        ({k: v for k, v in good.items() if k != gone},
         rf"1 missing {part} keys \['{gone}'\], 0 unexpected keys \[\]"),
        (extra, rf"0 missing {part} keys \[\], 2 unexpected keys \['{part}.98.bias', "
                rf"'{part}.99.weight'\]"),
        ({k: v for k, v in good.items() if k not in mine},
         rf"{len(mine)} missing {part} keys \['{mine[0]}', '{mine[1]}', .*\], 0 unexpected")]
    check_refusals([(lambda st=st: net_cls(16).load_taehv(st), m) for st, m in cases])
    torch.save(renamed, tmp_path / "renamed.pth")
    with pytest.raises(ValueError, match=rf"checkpoint '.*renamed\.pth' is not a TAEHV "
                                         rf"{net_cls.PART}"):
        coder_cls.from_file(tmp_path / "renamed.pth")
    check_nothing_loaded(net_cls(16), *wide)


def taehv_memory_block(sd: dict, key: str, h: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """TAEHV's memory block ``key`` (``decoder.3``, ``encoder.4``, ...) written over the
    checkpoint's own names: h [B T, C, H, W], each frame beside the one before it (zeros
    before the first)."""
    past = F.pad(h.unflatten(0, (B, T)), (0, 0, 0, 0, 0, 0, 1, 0))[:, :T].flatten(0, 1)
    hdn = torch.cat([h, past], 1)
    for j in (0, 2, 4):
        hdn = F.conv2d(hdn, sd[f"{key}.conv.{j}.weight"], sd[f"{key}.conv.{j}.bias"], padding=1)
        hdn = F.relu(hdn) if j < 4 else hdn
    return F.relu(hdn + h)


def check_tiny_on_cuda(coder_cls, dtype, x: torch.Tensor, cuts, shape, graphs: int,
                       more: torch.Tensor) -> None:
    """A tiny coder of the checkpoint layout's size in ``dtype`` on CUDA, two rows: graphed
    and eager bit-equal over ``cuts`` of ``x`` (``graphs`` graphs), an output kept as it
    was by a later replay (``more``, a chunk after the last cut), close to ``x`` run in
    one call; `close` frees the graphs and the arena."""
    from framekv.engine.wan.tiny_blocks import random_init

    net = coder_cls.NET(16)
    random_init(net, seed=1)
    net = net.to("cuda", dtype)
    graphed = coder_cls(net, sequences=2)
    a = check_graphed_equal_eager(graphed, coder_cls(net, sequences=2, use_graphs=False), x,
                                  cuts, shape, dtype)
    assert graphed.graph_count == graphs
    keep = a.clone()
    run(graphed, more)              # a replay must not change outputs handed out
    assert torch.equal(a, keep)
    whole = run(coder_cls(net, use_graphs=False), x)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(a, whole, rtol=0, atol=tol)
    graphed.close()
    assert graphed.graph_count == 0 and graphed.arena_bytes == 0
