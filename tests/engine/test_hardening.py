"""One test per hardening item: inputs with gradients, commits that cannot half-happen,
all-or-nothing replay inputs, clear errors for bad presets, sizes, command-line values,
devices and used-up objects, a server that refuses bad bodies, and a GPU install that
brings the cuDNN backend. Injected faults are in ``test_faults.py``."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import socket
import subprocess
import threading
import time

import msgspec
import pytest
import torch

from fault_harness import GEOMETRY, Fault, InjectedFault, Twin
from framekv import specs
from framekv.engine import CausalKVCache, Rollout
from framekv.engine.attention import registry
from framekv.graphs import GraphCache, GraphKey
from framekv.tools.cli import main as cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
M = GEOMETRY.max_staged_tokens
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")


# 1 -------------------------------------------------------------------------- gradients
def test_inputs_that_require_grad_never_reach_the_cache():
    twin = Twin()
    twin.chunk()
    x = twin.qkv().requires_grad_(True)
    out = twin.attn[0](x, kv_cache=twin.cache, seq_len=M, causal_block_size=M)  # no no_grad
    assert out.grad_fn is None and not out.requires_grad
    assert not twin.cache.k_pool.requires_grad and not twin.cache.v_pool.requires_grad
    twin.ref.write(0, twin.ref.committed, x[0, :, 4:6].detach(), x[0, :, 6:].detach())
    want = twin.ref.attention(0, x[0, :, :4].detach(), M, M)
    assert float((out[0] - want).abs().max()) < 1e-5
    k = torch.randn(3, 2, 16, requires_grad=True)
    twin.cache.write_range(1, twin.cache.committed_tokens - 3, k, k * 2)
    twin.ref.write(1, twin.cache.committed_tokens - 3, k.detach(), 2 * k.detach())
    assert not twin.cache.k_pool.requires_grad
    twin.cache.close()
    twin.cache.open(GEOMETRY)
    fresh = Twin(seed=1)
    fresh.cache.shutdown()
    fresh.cache = twin.cache
    fresh.verify()


# 2, 3 ----------------------------------------------------------------------- commits
def test_a_commit_whose_device_half_fails_can_be_retried(monkeypatch):
    twin = Twin()
    twin.chunk()
    twin.forward(M)
    from framekv.engine.cache.sequences import PoolState

    real = PoolState.commit_device
    fault = Fault(real)
    monkeypatch.setattr(PoolState, "commit_device", lambda self, *a: fault(self, *a))
    with pytest.raises(InjectedFault):
        twin.cache.commit(M)
    assert twin.cache.committed_tokens == M and twin.cache.staged_tokens == M
    twin.commit()                                        # the same commit, accepted now
    twin.verify()


def test_a_commit_after_a_partly_failed_forward_is_refused_and_changes_nothing():
    twin = Twin()
    twin.chunk()
    twin.forward_layer(0, M)
    with pytest.raises(ValueError, match=r"commit\(8\) needs every layer.*layers \[1\] staged \[0\]"):
        twin.cache.commit(M)
    assert twin.cache.committed_tokens == M and twin.cache.staged_tokens == M
    twin.forward_layer(1, M)
    twin.commit()
    twin.verify()


# 4 -------------------------------------------------------------------------- replay inputs
def test_replay_checks_every_input_before_copying_any():
    cache = GraphCache("cpu")
    inputs = {"a": torch.zeros(4), "b": torch.zeros(2, 3)}
    key = GraphKey.build(owner=1, program="sum", inputs=inputs)
    cache.capture(key, lambda a, b: a.sum() + b.sum(), inputs)
    with pytest.raises(ValueError, match="input 'b': got shape \\[3, 2\\]"):
        cache.replay(key, {"a": torch.ones(4), "b": torch.ones(3, 2)})
    with pytest.raises(ValueError, match="input 'b' must be a torch.Tensor, got list"):
        cache.replay(key, {"a": torch.ones(4), "b": [1, 2]})
    assert not cache.get_static_inputs(key)["a"].any()   # 'a' was not copied either time
    assert float(cache.replay(key, {"a": torch.ones(4)})) == 4.0


# 5 -------------------------------------------------------------------------- bad presets
def test_warmup_of_a_bad_preset_reports_the_presets_problem(tmp_path, capsys):
    text = (ROOT / "specs" / "presets" / "tiny.toml").read_text()
    path = tmp_path / "bad.toml"
    path.write_text(text.replace("num_layers = 2", "num_layers = 0"))
    assert cli(["warmup", str(path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "num_layers" in err and ">= 1" in err and "unknown field" not in err


# 6 -------------------------------------------------------------------------- sizes
def test_sizes_have_an_upper_bound_and_a_memory_check(tmp_path, capsys):
    tiny = specs.load_preset("tiny")
    with pytest.raises(ValueError, match=r"ModelSpec.num_layers must be <= 2147483647, got 10{23}"):
        msgspec.structs.replace(tiny.model, num_layers=10**23)
    path = tmp_path / "huge.toml"
    path.write_text((ROOT / "specs" / "presets" / "tiny.toml").read_text()
                    .replace("num_layers = 2", f"num_layers = {10**23}"))
    for command in (["demo", "--preset", str(path)], ["warmup", str(path), "--no-progress"]):
        assert cli(command) == 2
        assert "must be <= 2147483647" in capsys.readouterr().err
    big = msgspec.structs.replace(tiny, model=msgspec.structs.replace(tiny.model,
                                                                      num_layers=10**6))
    with pytest.raises(ValueError, match=r"needs about [\d.]+ GiB on cpu \(weights [\d.]+ GiB, "
                                         r"kv cache [\d.]+ GiB.*GiB free"):
        Rollout(big, "cpu")


# 7 -------------------------------------------------------------------------- command line
@pytest.mark.parametrize("argv, words", [
    (["demo", "--json", "/no/such/dir/r.json"], ["--json", "does not exist"]),
    (["demo", "--check-chunks", "-1"], ["--check-chunks", "integer >= 0, got -1"]),
    (["verify", "--tolerance", "-1"], ["--tolerance", "finite number >= 0, got -1"]),
    (["verify", "--tolerance", "nan"], ["--tolerance", "finite number >= 0, got nan"]),
    (["warmup", "tiny", "--json", "/no/such/dir/w.json"], ["--json", "does not exist"]),
    (["bench", "--png", "/no/such/dir/c.png"], ["--png", "does not exist"]),
])
def test_bad_values_are_usage_errors_before_any_work(capsys, argv, words):
    with pytest.raises(SystemExit) as exc:
        cli(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_an_unwritable_report_is_refused_up_front(tmp_path, capsys, monkeypatch):
    from framekv.tools import args

    monkeypatch.setattr(args.os, "access", lambda path, mode: False)  # as for a read-only folder
    with pytest.raises(SystemExit):
        cli(["demo", "--json", str(tmp_path / "r.json")])
    assert "permission denied" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli(["demo", "--json", str(tmp_path)])
    assert "must be a file path, got the folder" in capsys.readouterr().err


@pytest.mark.parametrize("backend, words", [
    ("cudnn", "backend 'cudnn' needs a CUDA device, got cpu"),
    ("sdpa", "backend 'sdpa' cannot attend over the K/V cache"),
])
def test_backends_that_cannot_run_here_say_why(capsys, backend, words):
    assert cli(["demo", "--device", "cpu", "--backend", backend]) == 2
    assert words in capsys.readouterr().err


def test_api_values_are_checked_too():
    from framekv.engine import verify_rollout
    from framekv.tools.demo import run_demo

    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
            verify_rollout("tiny", chunks=1, tolerance=bad)
    with pytest.raises(ValueError, match="check_chunks must be an integer >= 0, got -1"):
        run_demo("tiny", chunks=1, check_chunks=-1)


# 8 -------------------------------------------------------------------------- clear errors
@NO_CUDA
def test_cuda_on_a_machine_without_it_is_one_clear_error():
    with pytest.raises(ValueError, match="'cuda': CUDA is not available on this machine"):
        CausalKVCache(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.bfloat16,
                      tokens_per_page=4, pool_tokens=64, device="cuda")
    with pytest.raises(ValueError, match="CUDA is not available on this machine"):
        GraphCache("cuda")


def test_misuse_gets_named_errors():
    twin = Twin()
    with pytest.raises(ValueError, match="kv_cache must be a framekv.engine.CausalKVCache, got dict"):
        twin.attn[0](twin.qkv(), kv_cache={}, seq_len=M)
    with pytest.raises(ValueError, match="num_layers must be a positive integer, got -1"):
        CausalKVCache.pool_bytes_for(GEOMETRY, num_layers=-1, num_kv_heads=1, head_dim=8,
                                     dtype=torch.bfloat16, tokens_per_page=4)
    with pytest.raises(ValueError, match="dtype must be one of bfloat16, float16"):
        CausalKVCache.pool_bytes_for(GEOMETRY, num_layers=1, num_kv_heads=1, head_dim=8,
                                     dtype=torch.int8, tokens_per_page=4)
    twin.cache.shutdown()
    for call in (lambda c: c.page_view(0), lambda c: c.commit(0), lambda c: c.open(GEOMETRY),
                 lambda c: c.write_staged(0, torch.zeros(M, 2, 16), torch.zeros(M, 2, 16), M)):
        with pytest.raises(RuntimeError, match="was shut down"):
            call(twin.cache)
    r = Rollout("tiny", use_graphs=False)
    r.close()
    for call in (r.step, r.prefill, r.reset, r.capture):
        with pytest.raises(RuntimeError, match="this Rollout was closed"):
            call()
    r.close()  # idempotent


# 9 -------------------------------------------------------------------------- server inputs
@pytest.fixture(scope="module")
def server():
    pytest.importorskip("fastapi")
    uvicorn = pytest.importorskip("uvicorn")
    from framekv.engine.serving import StreamScheduler
    from framekv.tools.serve import build_app

    sched = StreamScheduler("tiny", max_sessions=2, device="cpu")
    srv = uvicorn.Server(uvicorn.Config(build_app(sched, body_timeout=0.5), host="127.0.0.1",
                                        port=0, log_level="warning"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    yield srv.servers[0].sockets[0].getsockname()[1], sched
    srv.should_exit = True


def _raw(port: int, head: str, body: bytes = b"") -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1] or b"{}")


def _post(length: str | None = None, extra: str = "") -> str:
    head = "POST /v1/sessions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + extra
    return head + (f"Content-Length: {length}\r\n" if length is not None else "")


@pytest.mark.parametrize("case, status, words", [
    ("100k deep", 400, "nested too deeply"),
    ("deep", 400, "nested too deeply"),
    ("huge length", 413, "Content-Length must be in [0, 1048576] bytes, got 1000000000000"),
    ("stalled", 408, "did not arrive within"),
    ("chunked", 411, "chunked request bodies are not accepted"),
    ("array", 400, "the body must be a JSON object, got a list"),
    ("not json", 400, "the body is not JSON"),
])
def test_the_server_refuses_bad_bodies_with_a_json_error(server, case, status, words):
    port, sched = server
    head, body = {
        "100k deep": (_post("200000"), b"[" * 100_000 + b"]" * 100_000),
        "deep": (_post("4000"), b"[" * 2000 + b"]" * 2000),
        "huge length": (_post(str(10**12)), b""),
        "stalled": (_post("10"), b"{"),
        "chunked": (_post(None, "Transfer-Encoding: chunked\r\n"), b"2\r\n{}\r\n0\r\n\r\n"),
        "array": (_post("6"), b"[1, 2]"),
        "not json": (_post("5"), b"{oops"),
    }[case]
    got, payload = _raw(port, head, body)
    assert got == status and words in payload["error"], (got, payload)
    assert not sched.sessions
    ok, payload = _raw(port, _post("11"), b'{"seed": 1}')          # the server goes on
    assert ok == 201 and payload["id"] in sched.sessions
    sched.close_session(payload["id"])


# 10 ------------------------------------------------------------------------- GPU newcomers
@pytest.mark.parametrize("cuda, want", [(True, ".[test,gpu]"), (False, ".[test]")])
def test_install_brings_the_gpu_extra_where_torch_sees_cuda(tmp_path, cuda, want):
    log = tmp_path / "pip.log"
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\n"
                    "if [ \"$1\" = -c ]; then case \"$2\" in *cuda*) exit "
                    f"{0 if cuda else 1};; *) exit 0;; esac; fi\n"
                    f"echo \"$@\" >> {log}\n")
    fake.chmod(0o755)
    out = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "test"],
                         env={**os.environ, "PYTHON": str(fake)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert f"-m pip install -q -e {want}" in log.read_text()


def test_cuda_without_cudnn_frontend_falls_back_and_says_what_to_install(monkeypatch):
    monkeypatch.setattr(registry, "cudnn_frontend_available", lambda: False)
    assert registry.default_backend("cuda") == "reference"
    with pytest.raises(ValueError, match=r"needs nvidia-cudnn-frontend.*pip install 'framekv\[gpu\]'"):
        registry.get_backend("cudnn")



@pytest.mark.parametrize("head_dim,want", [(128, "cudnn"), (64, "cudnn"), (256, "cudnn"),
                                           (12, "reference"), (300, "reference"), (None, "cudnn")])
def test_cuda_heads_cudnn_refuses_default_to_the_reference(monkeypatch, head_dim, want):
    """cuDNN's SDPA takes head dims that are multiples of 8 up to 256: a model with other
    heads (the tiny Wan config's 12) gets the reference backend on CUDA unless told."""
    monkeypatch.setattr(registry, "cudnn_frontend_available", lambda: True)
    assert registry.default_backend("cuda", head_dim) == want
    assert registry.default_backend("cpu", head_dim) == "reference"
