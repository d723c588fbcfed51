"""`framekv serve`: streaming sessions over HTTP and WebSockets around a `StreamScheduler`.

Routes (every error is ``{"error": ...}`` naming the argument, the value expected and
the value given; with a token, from ``FRAMEKV_TOKEN`` or ``--token``, every route but /
and /health needs ``Authorization: Bearer T`` (any case of "Bearer"; a 401 carries
``WWW-Authenticate: Bearer``), the WebSocket and /docs also ``?token=T``)::

    GET    /                             the page: a prompt box, start / stop, the live
                                         video on a canvas (``--output frames``)
    GET    /health                       liveness, sessions open / max, output, fps,
                                         whether a token and text prompts apply; 503
                                         and "error" once the GPU loop has died or
                                         while the server shuts down
    GET    /docs, /openapi.json          the API's schema and a local page rendering it
    GET    /metrics                      Prometheus (prometheus_client, text/plain):
                                         sessions, slots, sessions resident and
                                         swapped, swaps (count, bytes, seconds),
                                         steps, chunks, latency histograms, sessions
                                         ended by reason, graph replays and captures,
                                         pool and GPU bytes
    GET    /v1/info                      model, prompt shape and dtype, latent layout
                                         [C, F, H, W], frames per chunk (video frames
                                         too when decoding), fps, output, sessions
                                         and slots
    POST   /v1/sessions                  {"seed": int, "chunks": int?, "paused": bool?,
                                          and at most one of "text": str |
                                          "prompt_seed": int | "prompt": {"shape": [L,
                                          D], "data": base64 float32}} -> 201 {"id"};
                                          full: 503 + Retry-After; the GPU loop dead: 503
    GET    /v1/sessions/{id}             state, paused, connected, seed, chunks made and
                                         delivered, prompt_version, error, end_reason
                                         (also for the last ended sessions)
    PUT    /v1/sessions/{id}/prompt      raw little-endian values, X-Prompt-Shape: L,D
                                         and X-Prompt-Dtype: bf16 | fp16 | fp32; body
                                         capped at the prompt's bytes -> {"type":
                                         "prompt_ack", "prompt_version", "applies_from"}
    DELETE /v1/sessions/{id}             204; 404 once it has ended (idempotent)
    WS     /v1/sessions/{id}/stream      binary, one message per chunk: a 4-byte
                                         big-endian header length, a JSON header, then
                                         --output frames: {"type": "frames", index,
                                         frame0, frames, width, height, format, sizes,
                                         seconds, latency, batch, prompt_version} and
                                         the images back to back; --output latents:
                                         {"type": "chunk", index, frame0, frames,
                                         dtype, shape, seconds, batch, prompt_version}
                                         and the latents (fp32, C order)
                                         (`framekv.tools.serve.wire`); a last text
                                         message {"type": "end", "state", "error"}
                                         (+ "reason": "shutdown", "deleted", "idle"
                                         when it did not end by itself; "resumable":
                                         true when --state-dir keeps it).
                                         Control (text): {"type": "prompt",
                                         "text" | "prompt_seed" | "prompt"} (answered
                                         {"type": "prompt_ack", "prompt_version",
                                         "applies_from"}: the first chunk under it),
                                         {"type": "pause"}, {"type": "resume"}; a bad
                                         one (binary included) is answered {"type":
                                         "error", "error"}. Refused sockets close with
                                         a reason: 1008 (token), 4404 (no such session
                                         open), 4409 (a second socket on a session)

``--model wan-diffusers`` serves diffusers' Wan transformer (``--config``, random weights,
or ``--weights DIR``, a diffusers folder with its VAE and text encoder; ``--checkpoint
FILE``, a Self-Forcing / CausVid generator checkpoint in the original Wan layout,
replaces the transformer's weights and is sampled as Self-Forcing samples unless
``--sampler`` and ``--shift`` say otherwise, as ``framekv generate --checkpoint`` is;
`framekv.engine.wan.pipeline.WanPipeline` loads them) at the sizes of ``--preset``
(default the config's, `framekv.engine.wan.PRESETS`); a prompt is then
text (the config's text encoder, random, or the folder's) or [L, text_dim] text
embeddings, and a prompt change re-caches the session's visible frames by clean passes.
Its output is by default ``frames``: every chunk decoded by the VAE in the GPU loop
(one `StreamingVAEDecoder` row per pool slot) and sent as ``--frame-format``
images. The reference model (``--model reference``, default) has no VAE: it streams
latents, and ``--output frames`` is a startup error.
``--kv-dtype fp8`` keeps either model's K/V pool in float8 e4m3 (half a bf16 pool's
bytes; `framekv.engine.rollout.resolve_kv_dtype`).

One thread runs the GPU loop (`StreamScheduler.run`); every graph is captured before
the socket opens. ``--max-sessions`` sessions may be open, ``--slots`` of them (default
all) on the pool at once: the others wait swapped out to host memory and take turns,
the longest waiting first, swapped back in without a capture; a session keeps a slot it
took for ``--swap-quantum`` steps while it is ready. A client that
disconnects ends its session; a session no socket has taken for
``--session-idle-timeout`` seconds is ended (reason "idle"). A session holds at most
``--queue-chunks`` undelivered chunks. Request bodies are JSON of at most 1 MiB
(a prompt upload: its prompt's bytes), counted as they arrive (a Content-Length, no
Transfer-Encoding); a request head must arrive within ``--head-timeout`` seconds
(`framekv.tools.serve.net`). Token values never reach the logs (`redact_tokens`).
SIGTERM drains: no chunk is made any more, every socket gets its queued chunks and an
end message with reason "shutdown", then uvicorn's graceful shutdown, then the loop
stops and the pool is freed. With ``--state-dir D`` the open sessions are written to D
first (one file each, atomic) and a server started over D opens them again under their
ids: a client that reconnects to ``/v1/sessions/{id}/stream`` (with the token) goes on
from its next chunk, its undelivered chunks first; a corrupt file is logged and renamed
``*.corrupt``, one of another model or geometry logged and left in D. (The end
message of a session kept so says ``"resumable": true``; unless a client reconnects
within ``--session-idle-timeout`` seconds of the restart, the session ends.)
Python clients: `framekv.client.sessions` (``framekv.client``).
"""

import argparse
import dataclasses
import os
import signal
import sys
import typing

from ..args import add_kv_dtype_argument, bearer_token, nonnegative_int, positive_int, seconds
from ..conventions import add_preset_arguments
from ..generate import SAMPLERS, SELF_FORCING_SHIFT, positive_number
from .app import FRAME_FORMATS, OUTPUTS, build_app, page_html, state_dir_path
from .wire import MAX_BODY_BYTES, chunk_frame, frames_message, parse_prompt

if typing.TYPE_CHECKING:
    from framekv.engine.wan.pipeline import WanPipeline

__all__ = ["MAX_BODY_BYTES", "WAN_CONFIGS", "WanParts", "add_parser", "build_app", "chunk_frame",
           "frames_message", "page_html", "parse_prompt", "run", "wan_factory"]

#: --model wan-diffusers --config names (each rolls out at its preset's sizes by default)
WAN_CONFIGS = ("tiny", "1.3b")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("serve", help="streaming sessions over HTTP/WebSockets",
                              description=__doc__.split("\n\n")[0])
    add_preset_arguments(p, default=None, note="the rollout's: the reference model's, "
                         "default tiny; or the sizes diffusers' Wan runs at, default the "
                         "config's: tiny or wan-1.3b")
    p.add_argument("--model", choices=("reference", "wan-diffusers"), default="reference",
                   help="the reference DiT of --preset (default), or diffusers' Wan "
                        "transformer (needs the wan extra)")
    p.add_argument("--config", choices=WAN_CONFIGS, default="tiny",
                   help="with --model wan-diffusers: the shipped config (random weights "
                        "unless --weights)")
    p.add_argument("--weights", metavar="DIR", default=None,
                   help="with --model wan-diffusers: a local diffusers folder (transformer, "
                        "VAE, text encoder)")
    _checkpoint_options(p)
    p.add_argument("--output", choices=OUTPUTS, default=None,
                   help="what a chunk message carries: decoded video frames (default with "
                        "--model wan-diffusers) or latents (default, and the only choice, "
                        "with the reference model)")
    p.add_argument("--frame-format", choices=FRAME_FORMATS, default="jpeg",
                   help="with --output frames: the images' format (default jpeg)")
    p.add_argument("--fps", type=positive_int, default=16,
                   help="the video's frame rate the page plays at (default 16)")
    add_kv_dtype_argument(p)
    _session_options(p)
    p.add_argument("--cache-dir", default=None, help="kernels and cuDNN plans kept on disk")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.set_defaults(func=run)
    return p


def _checkpoint_options(p: argparse.ArgumentParser) -> None:
    """``--checkpoint``, ``--sampler`` and ``--shift``, as ``framekv generate`` has them."""
    p.add_argument("--checkpoint", metavar="FILE", default=None,
                   help="with --model wan-diffusers: a Self-Forcing generator checkpoint "
                        "(.pt/.pth/.safetensors, the original Wan layout) replacing the "
                        "transformer's weights; its shape, VAE and text encoder from "
                        "--weights, else random ones of --config")
    p.add_argument("--sampler", choices=SAMPLERS, default=None,
                   help="with --model wan-diffusers: euler, or self_forcing (x0, then fresh "
                        "noise; default with --checkpoint)")
    p.add_argument("--shift", type=positive_number, default=None,
                   help=f"with --model wan-diffusers: timestep shift of the preset's steps "
                        f"(default {SELF_FORCING_SHIFT} with --checkpoint, as Self-Forcing "
                        "samples; else 1)")


def _session_options(p: argparse.ArgumentParser) -> None:
    """Slots, queues, timeouts, the address and the token."""
    p.add_argument("--max-sessions", type=positive_int, default=8,
                   help="sessions open at once (default 8)")
    p.add_argument("--slots", type=positive_int, default=None,
                   help="sessions on the GPU pool at once, at most --max-sessions (default: "
                        "--max-sessions); the others wait swapped out to host memory and "
                        "take turns")
    p.add_argument("--swap-quantum", type=positive_int, default=16, metavar="STEPS",
                   help="steps a session keeps a slot it took before a waiting one may take "
                        "it: one swap per quantum, not per chunk (default 16)")
    p.add_argument("--state-dir", metavar="DIR", default=None,
                   help="keep sessions over a restart: on SIGTERM the open sessions are "
                        "written to DIR, and a server started with the same DIR opens them "
                        "again (clients reconnect with their session ids)")
    p.add_argument("--queue-chunks", type=positive_int, default=4,
                   help="undelivered chunks a session may hold before it waits for its "
                        "client (default 4)")
    p.add_argument("--session-idle-timeout", type=seconds, default=60.0, metavar="SECONDS",
                   help="a session no socket has taken for this long is ended and its "
                        "slot freed (default 60)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=nonnegative_int, default=8000)
    p.add_argument("--token", type=bearer_token, default=None,
                   help="bearer token every route but / and /health needs (printable "
                        "ASCII, no spaces); prefer the FRAMEKV_TOKEN environment "
                        "variable: an option is visible to every user in ps")
    p.add_argument("--head-timeout", type=seconds, default=10.0,
                   help="seconds a client may take to send a request head before its "
                        "connection is closed (default 10)")


def output_of(args) -> str:
    """The ``--output`` in force: the model's default, or ValueError for frames of the
    reference model."""
    output = args.output or ("frames" if args.model == "wan-diffusers" else "latents")
    if output == "frames" and args.model != "wan-diffusers":
        raise ValueError("--output frames needs --model wan-diffusers: the reference model "
                         "has no VAE to decode its latents; use --output latents")
    return output


def check_wan_options(args) -> None:
    """ValueError for a Wan-only option (``--checkpoint``, ``--sampler``, ``--shift``)
    beside the reference model, which would ignore it."""
    given = [f"--{name}" for name in ("checkpoint", "sampler", "shift")
             if getattr(args, name, None) is not None]
    if given and args.model != "wan-diffusers":
        raise ValueError(f"{', '.join(given)}: only with --model wan-diffusers (the "
                         f"reference model has no checkpoint or sampler to set), got --model "
                         f"{args.model}")


def token_of(args) -> str | None:
    """The bearer token: ``--token`` (with a warning on stderr: every user of the machine
    sees a process's arguments), else ``FRAMEKV_TOKEN``, else None. ValueError for a
    set but malformed FRAMEKV_TOKEN (an empty one included)."""
    if args.token is not None:
        print("framekv serve: warning: --token is visible to every user of this machine "
              "(ps, /proc); set FRAMEKV_TOKEN instead", file=sys.stderr)
        return args.token
    token = os.environ.get("FRAMEKV_TOKEN")
    if token is None:
        return None
    try:
        return bearer_token(token)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"FRAMEKV_TOKEN {exc}") from None


def kv_dtype_of(args) -> str | None:
    """The ``kv_dtype`` of the rollout ``--kv-dtype`` names: None (the model's dtype)
    for bf16, "fp8" for fp8."""
    value = getattr(args, "kv_dtype", "bf16")
    return None if value == "bf16" else value


def model_name(args) -> str:
    """The model's name in /v1/info: "reference:PRESET" or "wan-diffusers:CONFIG" (or
    ":" + the weights folder's name), then "+" + the checkpoint's file name if any."""
    if args.model != "wan-diffusers":
        return f"reference:{args.preset or 'tiny'}"
    import pathlib

    name = pathlib.Path(args.weights).name if args.weights else args.config
    checkpoint = getattr(args, "checkpoint", None)
    return f"wan-diffusers:{name}" + (f"+{pathlib.Path(checkpoint).name}" if checkpoint else "")


def run(args) -> int:
    """``framekv serve``: build, capture, serve until SIGTERM; the exit status (2 for a
    bad option combination, before anything is built)."""
    from framekv.engine.serving import StreamScheduler

    from .net import DrainingServer, server_config

    try:
        token = token_of(args)
        output = output_of(args)
        check_wan_options(args)
        if args.slots is not None and args.slots > args.max_sessions:
            raise ValueError(f"--slots must be at most --max-sessions ({args.max_sessions}), "
                             f"got {args.slots}")
        state_dir = None if args.state_dir is None else state_dir_path(args.state_dir)
        parts = (wan_factory(args, decode=output == "frames") if args.model == "wan-diffusers"
                 else None)
    except ValueError as exc:
        print(f"framekv serve: error: {exc}", file=sys.stderr)
        return 2
    sched = StreamScheduler(args.preset or "tiny", max_sessions=args.max_sessions,
                            slots=args.slots, swap_quantum=args.swap_quantum,
                            device=args.device, cache_dir=args.cache_dir,
                            progress=True, queue_chunks=args.queue_chunks, runner_factory=parts,
                            kv_dtype=kv_dtype_of(args) if parts is None else None,
                            decoder_factory=parts.decoder if output == "frames" else None)
    app = build_app(sched, token=token, output=output, frame_format=args.frame_format,
                    fps=args.fps, idle_timeout=args.session_idle_timeout,
                    model=model_name(args), state_dir=state_dir)
    server = DrainingServer(server_config(app, host=args.host, port=args.port,
                                          head_timeout=args.head_timeout))
    # uvicorn drains on SIGTERM, then puts back the handler it found and raises the
    # signal again; with this one in place that ends here, and the exit status is 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    return 0 if server.started else 3   # 3: uvicorn's status for a failed startup


@dataclasses.dataclass
class WanParts:
    """``--model wan-diffusers``: a loaded `WanPipeline` (transformer, text encoder, VAE
    or None: latents only, the rollout's sizes and sampling) as the scheduler's
    factories. Called ``(sequences=N, batch_sizes=...)`` it builds the scheduler's
    runner (the pipeline's `WanRollout`, which encodes text); `decoder` is the
    scheduler's ``decoder_factory``. ``backend``: the rollout's attention backend
    (default: the device's, `default_backend`); ``kv_dtype``: its K/V pool
    (`WanRollout`'s: None the model's dtype, or "fp8")."""

    pipeline: "WanPipeline"
    cache_dir: str | None = None
    use_graphs: bool = True
    backend: str | None = None
    kv_dtype: str | None = None

    model = property(lambda self: self.pipeline.transformer, doc="The transformer.")
    text_encoder = property(lambda self: self.pipeline.text_encoder, doc="Its TextEncoder.")
    vae = property(lambda self: self.pipeline.vae, doc="The VAE, or None.")
    sizes = property(lambda self: self.pipeline.sizes, doc="`preset_sizes` of the preset.")

    def __call__(self, *, sequences: int, batch_sizes):
        return self.pipeline.rollout(cache_dir=self.cache_dir, use_graphs=self.use_graphs,
                                     sequences=sequences, batch_sizes=batch_sizes,
                                     backend=self.backend, kv_dtype=self.kv_dtype)

    def decoder(self, slots: int):
        """A `StreamingVAEDecoder` of one row per pool slot; on CUDA with graphs,
        every batch of 1 to ``slots`` rows captured in both stages up front."""
        dec = self.pipeline.decoder(slots, use_graphs=self.use_graphs)
        if dec.use_graphs:
            for b in range(1, slots + 1):
                dec.capture(b, self.sizes["frames_per_chunk"], self.sizes["latent_size"])
        return dec


def wan_factory(args, *, use_graphs: bool = True, decode: bool = True) -> WanParts:
    """The `WanParts` of ``--model wan-diffusers`` (`WanPipeline.load`): ``--config``'s
    transformer, text encoder (its built-in tokenizer) and, with ``decode``, VAE, all
    random; or those of the diffusers folder ``--weights`` (its text encoder where it
    has one); the transformer's weights those of ``--checkpoint`` if given, sampled by
    ``--sampler`` at ``--shift`` (default Self-Forcing's with a checkpoint); at the
    sizes of ``--preset`` (default: the preset of the shipped config the transformer
    matches), prompts of the preset's ``prompt_tokens``, the pool of ``--kv-dtype``.
    ValueError for a bad option, before anything is built."""
    from framekv.engine.wan.pipeline import WanPipeline

    weights = getattr(args, "weights", None)
    pipe = WanPipeline.load(None if weights else args.config, weights=weights,
                            checkpoint=getattr(args, "checkpoint", None),
                            preset=getattr(args, "preset", None),
                            sampler=getattr(args, "sampler", None),
                            shift=getattr(args, "shift", None), device=args.device,
                            text_encoder=None, vae=decode)
    return WanParts(pipe, args.cache_dir, use_graphs, kv_dtype=kv_dtype_of(args))
