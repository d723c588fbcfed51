"""Sequence snapshots on CPU: a sequence leaves one pool and goes on in another, exactly;
files round-trip and refuse corruption; faults mid-import and mid-save change nothing."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch

from cache_harness import run_rollout
from framekv.engine import CausalKVCache
from framekv.engine.cache import CorruptFile, SequenceSnapshot
from framekv.engine.cache import cache as cache_mod
from framekv.engine.cache import snapshot as snapshot_mod
from framekv.specs import Geometry

G = Geometry
# Chunks commit all they staged (as a chunk cycle does): a snapshot is taken between them.
roll = functools.partial(run_rollout, partial_commits=False)
# (geometry, page size here, page size of the pool it moves to): odd pins and windows,
# the pin filling over several commits, pages larger than a forward.
MOVES = [(G(6, 9, 6, (3, 6)), 4, 2), (G(5, 37, 12, (3, 12)), 8, 16),
         (G(40, 11, 7, (7,)), 16, 4), (G(0, 13, 5, (1, 5)), 2, 8)]


def make(geometry, tpp, *, sequences=1, layers=3, dtype=torch.float32, heads=2):
    cache = CausalKVCache(num_layers=layers, num_kv_heads=heads, head_dim=8, dtype=dtype,
                          tokens_per_page=tpp, device="cpu", num_sequences=sequences,
                          pool_tokens=CausalKVCache.pool_tokens_for(geometry, tpp,
                                                                    num_sequences=sequences))
    cache.open(geometry)
    return cache


def seq_pages(cache, i):
    """K/V of every page sequence ``i`` owns, as a copy."""
    n = cache._open.plan.total_pages
    return cache._pool[:, :, i * n:(i + 1) * n].clone()


@pytest.mark.parametrize("geometry,tpp,tpp2", MOVES)
def test_a_sequence_moves_to_another_pool_and_goes_on_exactly(geometry, tpp, tpp2):
    src = make(geometry, tpp)
    history: dict[int, int] = {}
    C = roll(src, geometry, commits=9, seed=tpp, history=history)
    snap = src.export_sequence(0)
    assert snap.committed == C and snap.k.shape[1] == len(snap.positions)
    dst = make(geometry, tpp2, sequences=3)
    roll(dst, geometry, commits=4, seed=99, sequence=0)       # a neighbour under way
    before0 = seq_pages(dst, 0)
    dst.import_sequence(2, snap)
    assert dst.sequence_committed_tokens(2) == C
    assert torch.equal(seq_pages(dst, 0), before0), "the import touched another sequence"
    # Going on from the import: every block's row is exactly V(j), with the values the
    # source committed, in both pools, for the same chunks.
    twin = dict(history)
    roll(src, geometry, commits=12, seed=7, history=history)
    roll(dst, geometry, commits=12, seed=7, history=twin, sequence=2)
    assert src.committed_tokens == dst.sequence_committed_tokens(2)
    a, b = src.export_sequence(0), dst.export_sequence(2)
    assert a.positions == b.positions and torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


@pytest.mark.parametrize("geometry,tpp,_", MOVES)
def test_the_slots_of_many_positions_are_each_one_s_slot(geometry, tpp, _):
    """`HostLayout.slots_of` (what an export and an import copy through) gives
    `slot_of` of every resident position at once, before and after the ring turns, and
    names the first position that is not resident."""
    cache = make(geometry, tpp)
    host = cache._seq(0).host
    P, W, M = geometry.pin_tokens, geometry.window_tokens, geometry.max_staged_tokens
    C, history = 0, {}
    for commits in (0, 2, 9):
        if commits:
            C = roll(cache, geometry, commits=commits, seed=commits, history=history)
        resident = list(range(min(P, C))) + list(range(max(P, C - W), C + M))
        got = host.slots_of(resident)
        assert got.dtype == np.int64 and got.tolist() == [host.slot_of(x) for x in resident]
        assert host.slots_of([]).shape == (0,)
        beyond = max(P, C + M)                      # past the pins and the staging
        with pytest.raises(ValueError, match=f"position {beyond} is not resident"):
            host.slots_of(resident[:2] + [beyond, -1])


def test_export_reads_only_the_kept_tokens_and_changes_nothing():
    g = G(4, 10, 6, (2, 6))
    cache = make(g, 4)
    roll(cache, g, commits=8, seed=3)
    C = cache.committed_tokens
    pool = cache._pool.clone()
    snap = cache.export_sequence(0)
    assert snap.positions == list(range(4)) + list(range(max(4, C - 10), C))
    assert torch.equal(cache._pool, pool)
    # each row holds its own position's stamp (digits 3..5 of the head dim)
    pos = (snap.k[:, :, 0, 3] + 128 * snap.k[:, :, 0, 4]).to(torch.int64)
    assert (pos == torch.tensor(snap.positions)[None]).all()
    assert (snap.k[:, :, 0, 0] == torch.arange(3)[:, None]).all()        # layer stamps
    assert snap.nbytes == 2 * 3 * len(snap.positions) * 2 * 8 * 4


def test_export_needs_a_sequence_between_chunks():
    g = G(4, 10, 6, (2, 6))
    cache = make(g, 4)
    roll(cache, g, commits=2, seed=3)
    cache.write_staged(0, torch.zeros(2, 2, 8), torch.zeros(2, 2, 8), 2)
    with pytest.raises(ValueError, match="2 staged tokens"):
        cache.export_sequence(0)


@pytest.mark.parametrize("change,field", [
    (dict(geometry=G(4, 11, 6, (2, 6))), "geometry"),
    (dict(layers=2), "num_layers"),
    (dict(heads=1), "num_kv_heads"),
    (dict(dtype=torch.bfloat16), "dtype"),
])
def test_import_refuses_another_pool_shape_and_changes_nothing(change, field):
    g = G(4, 10, 6, (2, 6))
    src = make(g, 4)
    roll(src, g, commits=5, seed=1)
    snap = src.export_sequence(0)
    g2 = change.pop("geometry", g)
    dst = make(g2, 4, sequences=2, **change)
    roll(dst, g2, commits=3, seed=2, sequence=1)
    pool, C = dst._pool.clone(), dst.sequence_committed_tokens(1)
    with pytest.raises(ValueError, match=f"{field}: the snapshot has"):
        dst.import_sequence(1, snap)
    assert torch.equal(dst._pool, pool) and dst.sequence_committed_tokens(1) == C
    with pytest.raises(ValueError, match="SequenceSnapshot"):
        dst.import_sequence(0, {"k": 1})


def test_save_load_round_trip_and_a_safetensors_reader_opens_it(tmp_path):
    g = G(5, 37, 12, (3, 12))
    cache = make(g, 8, dtype=torch.bfloat16)
    roll(cache, g, commits=6, seed=4)
    snap = cache.export_sequence(0)
    path = tmp_path / "s.safetensors"
    size = snap.save(path)
    assert size == os.path.getsize(path) and sorted(tmp_path.iterdir()) == [path]
    back = SequenceSnapshot.load(path)
    assert back.describe() == snap.describe() and back.committed == snap.committed
    assert torch.equal(back.k, snap.k) and torch.equal(back.v, snap.v)
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("k"), snap.k)
        assert '"format": "framekv.sequence"' in f.metadata()["framekv"]


def _saved(tmp_path):
    g = G(6, 9, 6, (3, 6))
    cache = make(g, 4)
    roll(cache, g, commits=5, seed=5)
    path = tmp_path / "s.safetensors"
    cache.export_sequence(0).save(path)
    return path, path.read_bytes()


@pytest.mark.parametrize("damage", ["truncate", "flip", "extend", "header", "empty"])
def test_a_damaged_file_is_an_error(tmp_path, damage):
    path, raw = _saved(tmp_path)
    if damage == "truncate":
        raw = raw[:-100]
    elif damage == "flip":
        raw = raw[:-50] + bytes([raw[-50] ^ 0x10]) + raw[-49:]
    elif damage == "extend":
        raw = raw + b"\0" * 16
    elif damage == "header":
        raw = raw[:8] + b"[" + raw[9:]          # the JSON header broken
    else:
        raw = b""
    path.write_bytes(raw)
    with pytest.raises(CorruptFile):
        SequenceSnapshot.load(path)


def test_another_version_or_format_is_refused(tmp_path):
    from framekv.engine.cache.tensorfile import read_tensors, write_tensors

    path, _ = _saved(tmp_path)
    tensors, header = read_tensors(path)
    write_tensors(path, tensors, {**header, "version": 99})
    with pytest.raises(ValueError, match="version 99"):
        SequenceSnapshot.load(path)
    write_tensors(path, tensors, {**header, "format": "other"})
    with pytest.raises(ValueError, match="'other'"):
        SequenceSnapshot.load(path)
    write_tensors(path, {"k": tensors["k"], "v": tensors["v"][:, :-1]}, header)
    with pytest.raises(ValueError, match="its header says"):
        SequenceSnapshot.load(path)


def test_a_fault_mid_save_leaves_the_old_file(tmp_path, monkeypatch):
    path, raw = _saved(tmp_path)
    g = G(6, 9, 6, (3, 6))
    other = make(g, 4)
    roll(other, g, commits=9, seed=8)
    snap = other.export_sequence(0)
    calls = []
    real = snapshot_mod.write_tensors.__globals__["_bytes"]

    def failing(t):
        calls.append(1)
        if len(calls) == 2:      # the crc pass is done; the second tensor's write fails
            raise OSError("disk full")
        return real(t)

    monkeypatch.setitem(snapshot_mod.write_tensors.__globals__, "_bytes", failing)
    with pytest.raises(OSError, match="disk full"):
        snap.save(path)
    assert path.read_bytes() == raw and sorted(path.parent.iterdir()) == [path]


@pytest.mark.parametrize("under_way", [True, False])
def test_a_fault_mid_import_puts_the_sequence_back(monkeypatch, under_way):
    g = G(5, 37, 12, (3, 12))
    src = make(g, 8)
    roll(src, g, commits=7, seed=6)
    snap = src.export_sequence(0)
    dst = make(g, 8, sequences=2)
    history: dict[int, int] = {}
    roll(dst, g, commits=4, seed=3, sequence=0)
    if under_way:
        roll(dst, g, commits=5, seed=2, history=history, sequence=1)
    before = (seq_pages(dst, 0), dst.sequence_committed_tokens(1))
    real, calls = cache_mod.scatter, []

    def failing(k_pool, v_pool, slots, k, v):
        if calls:   # one fault: the write-back goes through
            return real(k_pool, v_pool, slots, k, v)
        calls.append(1)
        real(k_pool[:1], v_pool[:1], slots, k[:1], v[:1])      # layer 0 written
        raise RuntimeError("injected copy fault")

    monkeypatch.setattr(cache_mod, "scatter", failing)
    with pytest.raises(RuntimeError, match="injected copy fault"):
        dst.import_sequence(1, snap)
    assert torch.equal(seq_pages(dst, 0), before[0])
    assert dst.sequence_committed_tokens(1) == before[1]
    if under_way:   # back as it was: its rows read exactly its own history
        roll(dst, g, commits=3, seed=9, history=history, sequence=1)
    else:           # a sequence at position 0 starts over: nothing written is left
        assert not seq_pages(dst, 1).any()


def test_a_failing_write_back_starts_the_sequence_over(monkeypatch):
    g = G(6, 9, 6, (3, 6))
    src, dst = make(g, 4), make(g, 4)
    roll(src, g, commits=4, seed=1)
    roll(dst, g, commits=6, seed=2)

    def failing(k_pool, v_pool, slots, k, v):
        k_pool[0, slots[:1]] = float("nan")
        raise RuntimeError("injected copy fault")

    monkeypatch.setattr(cache_mod, "scatter", failing)
    with pytest.raises(RuntimeError, match="injected copy fault"):
        dst.import_sequence(0, src.export_sequence(0))
    assert dst.committed_tokens == 0 and not dst._pool.isnan().any() and not dst._pool.any()


def test_import_into_a_pool_whose_sequence_holds_nan_leaves_no_trace():
    g = G(4, 10, 6, (2, 6))
    src = make(g, 4)
    history: dict[int, int] = {}
    roll(src, g, commits=6, seed=1, history=history)
    snap = src.export_sequence(0)
    dst = make(g, 4)
    dst._pool.fill_(float("nan"))
    dst.import_sequence(0, snap)
    assert not dst._pool.isnan().any(), "an old NaN is left in the pool"
    roll(dst, g, commits=5, seed=4, history=history)


def test_snapshot_round_trip_of_a_sequence_at_position_zero():
    g = G(6, 9, 6, (3, 6))
    cache = make(g, 4)
    snap = cache.export_sequence(0)
    assert snap.committed == 0 and snap.k.shape[1] == 0
    roll(cache, g, commits=3, seed=1)
    cache.import_sequence(0, snap)
    assert cache.committed_tokens == 0
    roll(cache, g, commits=3, seed=2)
    assert np.isfinite(cache._pool.numpy()).all()


def test_reserve_exports_checks_its_count_and_pins_nothing_on_the_cpu():
    g = Geometry(4, 8, 4, (4,))
    c = CausalKVCache(num_layers=2, num_kv_heads=1, head_dim=8, tokens_per_page=4,
                      dtype=torch.float32, pool_tokens=CausalKVCache.pool_tokens_for(g, 4),
                      device="cpu")
    with pytest.raises(ValueError, match="open"):
        c.reserve_exports(1)
    c.open(g)
    assert c.reserve_exports(0) == 0 and c.reserve_exports(2) == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=r"count must be an integer >= 0, got"):
            c.reserve_exports(bad)
