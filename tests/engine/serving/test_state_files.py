"""The state folder's reader (`state_files.read_states`) against every file a folder may
hold, on the CPU: no file stops a start.

A header that is a JSON string, number, null or list, framekv metadata that is no JSON
object, either nested 200,000 levels deep, a record acknowledging past its chunks, a
queued chunk whose input frame numbers are negative, a FIFO (never opened: no hang), a
folder, a device, a link to nothing, and a sparse file whose valid header declares 30
GiB (refused before anything is allocated): each is renamed ``.corrupt`` with one log
line saying why, and the good file beside them is read. A seeded fuzz over headers, metadata, lengths and bytes: every case is read or
renamed, no exception escapes, nothing past the bound is allocated.
"""
from __future__ import annotations

import json
import logging
import os
import random
import struct
import threading

import pytest
import torch

from framekv.engine.serving import StreamScheduler, state_files
from state_file_harness import bad_files, pack, sparse_huge, split

BOUND = 1 << 20               # the fuzz's bound on a file's tensor bytes
FUZZ_CASES = 3000


@pytest.fixture(scope="module")
def sched():
    s = StreamScheduler("tiny", max_sessions=4, device="cpu", use_graphs=False, queue_chunks=2)
    yield s
    s.close()


@pytest.fixture(scope="module")
def good(sched, tmp_path_factory) -> bytes:
    """A session file's bytes: two chunks made, the first acknowledged."""
    s = sched.open_session(seed=11)
    sched.step()
    sched.step()
    sched.ack(s.id, 0)
    folder = tmp_path_factory.mktemp("good")
    assert sched.save_sessions(folder) == [s.id]
    sched.close_session(s.id)
    return (folder / f"{s.id}.session").read_bytes()


def read_all(folder, **kw) -> list:
    """What `read_states` yields over ``folder``, in a thread: a read that blocks (a
    FIFO opened) fails the test instead of hanging it."""
    out, errors = [], []

    def run():
        try:
            out.extend(state_files.read_states(folder, room=lambda: True, **kw))
        except BaseException as exc:      # re-raised below, in the test
            errors.append(exc)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=60)
    assert not t.is_alive(), "reading the folder blocks"
    if errors:
        raise errors[0]
    return out


@pytest.fixture
def allocations(monkeypatch) -> list:
    """The bytes of every tensor torch.empty allocates while the test runs."""
    seen, real = [], torch.empty

    def empty(*shape, **kw):
        t = real(*shape, **kw)
        seen.append(t.numel() * t.element_size())
        return t
    monkeypatch.setattr(torch, "empty", empty)
    return seen


def test_every_bad_file_is_renamed_corrupt_with_one_line_and_the_good_one_is_read(
        tmp_path, good, caplog, allocations):
    wrong = bad_files(tmp_path, good)
    (tmp_path / "good.session").write_bytes(good)
    caplog.set_level(logging.ERROR, "framekv.scheduler")
    got = read_all(tmp_path, max_bytes=1 << 30)
    assert [p.name for p, _ in got] == ["good.session"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["good.session", *(f"{n}.corrupt" for n in wrong)]), left
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(wrong) and all("\n" not in ln for ln in lines), lines
    for name in wrong:
        assert sum(f"renamed {name}.corrupt, not opened: " in ln for ln in lines) == 1, name
    says = {name: next(ln for ln in lines if f" {name}.corrupt," in ln) for name in wrong}
    assert "the header is a JSON string, not an object" in says["string.session"]
    assert "the header is a JSON number, not an object" in says["number.session"]
    assert "the header is a JSON null, not an object" in says["null.session"]
    assert "framekv metadata is a JSON list" in says["meta-list.session"]
    assert "nested too deeply" in says["deep.session"]
    assert "nested too deeply" in says["meta-deep.session"]
    assert "acked in [-1, chunks)" in says["acked.session"]
    assert "a queued chunk's input must be None or [first >= 0, count >= 1], got [[-1, 5]" \
        in says["input.session"]
    assert "a FIFO, not a regular file" in says["f.session"]
    assert "a folder, not a regular file" in says["dir.session"]
    assert "a character device" in says["zero.session"]
    assert "a symbolic link to nothing" in says["dangling.session"]
    assert f"declares {30 << 30} bytes of tensors, more than the {1 << 30}" in \
        says["huge.session"]
    assert max(allocations) < 1 << 20                       # the good file's tensors only


def test_a_start_bounds_a_file_by_the_memory_the_host_can_give(sched, tmp_path, monkeypatch,
                                                               allocations, caplog):
    """`restore_sessions` hands the reader the host's room (`host_room`): a file
    declaring more is renamed before anything is allocated."""
    from framekv.engine.serving import moves

    sparse_huge(tmp_path / "huge.session")
    monkeypatch.setattr(moves, "host_room", lambda: 1 << 30)
    assert sched.restore_sessions(tmp_path) == []
    assert [p.name for p in tmp_path.iterdir()] == ["huge.session.corrupt"]
    assert f"more than the {1 << 30} bytes" in caplog.text
    assert not allocations or max(allocations) < 1 << 20


def test_a_fifo_is_never_opened(tmp_path, monkeypatch):
    opened, real = [], os.open
    monkeypatch.setattr(os, "open", lambda p, *a, **k: (opened.append(str(p)), real(p, *a, **k))[1])
    os.mkfifo(tmp_path / "f.session")
    assert read_all(tmp_path) == []
    assert opened == [] and (tmp_path / "f.session.corrupt").exists()


# ---------------------------------------------------------------------------- the fuzz
def _value(rng: random.Random, depth: int = 0):
    """A random JSON value, names and numbers a state file's header holds among them."""
    kind = rng.randrange(10 if depth < 4 else 6)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2, 7, 2**31, 2**63, 10**30, -(10**30), rng.randrange(100)])
    if kind == 3:
        return rng.choice([0.5, -1.5, 1e308, float("inf")])
    if kind in (4, 5):
        return rng.choice(["", "x", "F32", "U8", "BF16", "float32", "live", "start", "none",
                           "active", "done", "framekv.stream", "framekv.session", "a" * 300,
                           "seq0.k", "__metadata__"])
    if kind in (6, 7):
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["dtype", "shape", "data_offsets", "format", "version", "acked", "chunks", "id",
            "queue", "index", "cache", "geometry", "x"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def _mutate(rng: random.Random, node) -> None:
    """Replace, delete or add one random entry somewhere in the JSON tree ``node``."""
    path = [node]
    while True:
        kids = [v for v in (node.values() if isinstance(node, dict) else node)
                if isinstance(v, (dict, list)) and v]
        if not kids or rng.random() < 0.3:
            break
        node = rng.choice(kids)
        path.append(node)
    if isinstance(node, dict):
        key = rng.choice(list(node) + ["new"]) if node else "new"
        if rng.random() < 0.2 and key in node:
            del node[key]
        else:
            node[key] = _value(rng)
    elif node:
        node[rng.randrange(len(node))] = _value(rng)


def _case(rng: random.Random, good: bytes, folder) -> None:
    """Write one mutated file into ``folder``: headers, metadata, lengths or bytes."""
    entries, header, data = split(good)
    # header mutations most: they reach deepest, into the record a server acts on
    kind, raw = rng.choices(range(8), weights=(1, 6, 1, 1, 1, 1, 1, 1))[0], None
    if kind == 0:
        _mutate(rng, entries)
    elif kind == 1:
        for _ in range(rng.randint(1, 3)):
            _mutate(rng, header)
        entries["__metadata__"]["framekv"] = json.dumps(header)
    elif kind == 2:
        entries["__metadata__"]["framekv"] = json.dumps(_value(rng))
    elif kind == 3:
        raw = pack(json.dumps(_value(rng)).encode(), data)
    if raw is None:
        raw = pack(entries, data)
    if kind == 4:                     # the header length
        (n,) = struct.unpack("<Q", raw[:8])
        raw = struct.pack("<Q", rng.choice([0, 1, n - 1, n + 1, 2**63, rng.randrange(2 * n)])) + raw[8:]
    elif kind == 5:                   # cut or grown
        raw = raw[:rng.randrange(len(raw))] if rng.random() < 0.5 else raw + os.urandom(
            rng.randint(1, 64))
    elif kind == 6:                   # bytes flipped anywhere
        raw = bytearray(raw)
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        raw = bytes(raw)
    with open(folder / "case.session", "wb") as f:
        f.write(raw)
        if kind == 7:                 # the last tensor declares more, its bytes sparse
            name, e = max(((k, v) for k, v in entries.items() if k != "__metadata__"),
                          key=lambda kv: kv[1]["data_offsets"][0])
            size = rng.choice([BOUND + 1, 1 << 30, 1 << 40])
            e.update(dtype="U8", shape=[size], data_offsets=[e["data_offsets"][0],
                                                             e["data_offsets"][0] + size])
            f.seek(0)
            head = pack(entries)
            f.write(head + data[:e["data_offsets"][0]])
            f.truncate(len(head) + e["data_offsets"][1])


def test_fuzzed_files_are_read_or_renamed_and_nothing_past_the_bound_is_allocated(
        sched, good, tmp_path, allocations):
    rng = random.Random(20240611)
    outcomes = {"read": 0, "renamed": 0, "fits": 0}
    for i in range(FUZZ_CASES):
        _case(rng, good, tmp_path)
        del allocations[:]
        got = read_all(tmp_path, max_bytes=BOUND)
        assert sum(allocations) <= BOUND, (i, sum(allocations))
        names = sorted(p.name for p in tmp_path.iterdir())
        if got:
            assert names == ["case.session"], (i, names)
            outcomes["read"] += 1
            try:
                state_files.stream_of(got[0][1], sched.model, sched.decoding)
                outcomes["fits"] += 1
            except ValueError:
                pass
        else:
            assert names == ["case.session.corrupt"], (i, names)
            outcomes["renamed"] += 1
        for p in tmp_path.iterdir():
            p.unlink()
    assert outcomes["renamed"] > FUZZ_CASES // 2 and outcomes["fits"] > 0, outcomes
