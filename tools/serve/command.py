"""`framekv serve`: streaming sessions over HTTP and WebSockets around a `StreamScheduler`.

Routes (every error is ``{"error": ...}`` naming the argument, the value expected and
the value given: an unknown route's 404, a wrong method's 405 (``Allow`` says the right
ones) and an internal error's 500 (its traceback logged) too; with a token, from
``FRAMEKV_TOKEN`` or ``--token``, every route but / and /health needs ``Authorization:
Bearer T`` (any case of "Bearer"; a 401 carries ``WWW-Authenticate: Bearer``), the
WebSocket and /docs also ``?token=T``)::

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
                                          D], "data": base64 float32}, "input": "text"
                                          | "video", "strength": S (video: the
                                          server's --video-strength)} -> 201 {"id"};
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
                                         and the latents (fp32, C order); a video
                                         session's headers end with "input": {first,
                                         count}, the input frames of the chunk
                                         (numbered as received, drops counted)
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
                                         one is answered {"type": "error", "error"}.
                                         Binary from the client: a video session's
                                         frames, {"type": "frames_in", "format":
                                         jpeg | webp | png | rgb24, width, height,
                                         count, sizes, id} and the images (or rgb24
                                         bytes), framed as a chunk; a bad one (or a
                                         text session's) answered {"type": "error",
                                         "about": "frames_in", "id"}
                                         (`framekv.tools.serve.frames_in`). Refused sockets close with
                                         a reason: 1008 (token), 4404 (no such session
                                         open), 4409 (a second socket on a session),
                                         4422 (an ``after`` beyond the chunks made:
                                         the reason names the last one); 1008 too for
                                         a page of another origin
    GET    /v1/sessions/{id}/chunks      the long poll (?after=i&wait=s): the next chunk
                                         after i, the socket's binary message as one
                                         body; 204: none within s (10, at most 60); the
                                         end message (JSON) once every chunk is
                                         acknowledged (`framekv.tools.serve.poll`)
    POST   /v1/sessions/{id}/frames      a video session's frames_in message as the
                                         body -> {"frames_in", "frames_dropped",
                                         "frames_waiting", "input_chunks",
                                         "frames_needed"}; 400/413/422 a bad message,
                                         409 a session that takes no frames
    POST   /v1/sessions/{id}/control     one of the socket's control messages (JSON):
                                         204, or a prompt's answer as PUT .../prompt's

``--model NAME`` is the model family served (`framekv.engine.models`: its model loaded
as every command loads it, the model flags checked against it first,
`framekv.tools.model_flags`; a family registered in the process is served with no
other change). ``--model wan-diffusers`` serves diffusers' Wan transformer
(``--config``, random weights, or ``--weights DIR``, a diffusers folder with its VAE and
text encoder; ``--checkpoint FILE``, a Self-Forcing / CausVid generator checkpoint in the
original Wan layout, replaces the transformer's weights and is sampled as Self-Forcing
samples unless ``--sampler`` (a registered sampler, `framekv.engine.samplers`) and
``--shift`` say otherwise, as ``framekv generate --checkpoint`` is;
`framekv.engine.wan.pipeline.WanPipeline` loads them) at the sizes of ``--preset``
(default the config's, `framekv.engine.wan.PRESETS`); a prompt is then
text (the config's text encoder, random, or the folder's) or [L, text_dim] text
embeddings, and a prompt change re-caches the session's visible frames by clean passes.
Either model's output is by default ``frames``, sent as ``--frame-format`` images:
Wan's chunks decoded by its VAE in the GPU loop (one `StreamingVAEDecoder` row per pool
slot); the reference model's (``--model reference``, default), which has no VAE, drawn
as a picture of their latents, one image per latent frame at 8 times its size
(`framekv.engine.serving.LatentPreview`, as for any family without a video decoder), so
the page shows a stream of either.
``--output latents`` streams the latents themselves.
``--video-strength S`` (a model with an encoder, ``--output frames``) takes video
sessions: the runner samples video to video at S (`framekv.engine.samplers`' ``v2v``
over its sampler), one streaming encoder row per slot beside the decoder's; a video
session's chunk i is made once chunk i's frames are in, from their latents; below 1
every session takes video (`framekv.engine.serving.video_in`).
``--kv-dtype fp8`` keeps either model's K/V pool in float8 e4m3 (half a bf16 pool's
bytes; `framekv.engine.rollout.resolve_kv_dtype`); ``--fp8-gemm`` runs either model's
block GEMMs in fp8 (`framekv.engine.fp8_linear`). ``--steps N`` runs N of the preset's
S denoising steps for either model: those at indices floor(i S / N), i = 0 .. N - 1
(evenly spaced, the first always; `framekv.engine.samplers.pick_steps`), N in [1, S].

One thread runs the GPU loop (`StreamScheduler.run`); every graph is captured before
the socket opens. ``--max-sessions`` sessions may be open, ``--slots`` of them (default
all) on the pool at once: the others wait swapped out to host memory and take turns,
the longest waiting first, swapped back in without a capture; a session keeps a slot it
took for ``--swap-quantum`` steps while it is ready. A session outlives its socket: a
client that drops reconnects by id (``?after=`` its last chunk); a session no socket
has taken for ``--session-idle-timeout`` seconds is ended (reason "idle"). A session
holds at most ``--queue-chunks`` unacknowledged chunks. Request bodies are JSON of at
most 1 MiB (a prompt upload: its prompt's bytes), counted as they arrive (a
Content-Length, no Transfer-Encoding); an error answered before a body is read (a 401,
say) closes the connection, the body unread. A request head is at most 16 KiB (431,
and the connection closed) and must arrive within ``--head-timeout`` seconds
(`framekv.tools.serve.net`). A browser's WebSocket is taken from a page of the
server's own origin (the Host it was asked at) and from those ``--allowed-origins``
lists (comma-separated ``http(s)://host[:port]``, or ``*`` for any); one from any
other page is closed 1008 naming its origin; a client that sends no Origin (not a
browser) is not checked. Token values never reach the logs (`redact_tokens`).
SIGTERM drains: no chunk is made any more, every socket gets its queued chunks and an
end message with reason "shutdown", then uvicorn's graceful shutdown, then the loop
stops and the pool is freed. With ``--state-dir D`` the open sessions are written to D
first (one file each, atomic) and a server started over D opens them again under their
ids: a client that reconnects to ``/v1/sessions/{id}/stream`` (with the token) goes on
from its next chunk, its undelivered chunks first; a file that cannot be read as a
session (whatever its bytes: declaring more than the host can hold, or not a regular
file at all) is renamed ``*.corrupt`` with one log line saying why, one of another
model or geometry logged and left in D. (The end
message of a session kept so says ``"resumable": true``; unless a client reconnects
within ``--session-idle-timeout`` seconds of the restart, the session ends.)
``--checkpoint-every N`` (needs ``--state-dir``) also writes each session to D every N
of its chunks, off the GPU thread, atomically, so a server killed outright (SIGKILL,
out of memory) resumes every session from its last checkpoint when started over D.

Every option is checked before anything is built: a bad one (an unknown preset or a
malformed preset file, a device other than cpu or an available cuda[:N], ``--fps``
outside 1..240, ``--port`` outside 0..65535, ``--max-sessions`` over 4096,
``--checkpoint-every`` without ``--state-dir``, ``--steps`` beyond the preset's
steps, ...) is one line on stderr and exit status 2; so are a missing ``serve`` extra
(the package named) and a ``--host``/``--port`` this process cannot listen on (in
use, say), both checked before the model is built. Ctrl-C drains as SIGTERM does, then
ends with one line and exit status 130.
Python clients: `framekv.client.sessions` (``framekv.client``).
"""

import argparse
import signal

from ..args import bearer_token, int_in, origins, positive_int, seconds, strength
from ..conventions import add_preset_arguments, fail as _fail, one_line_errors
from ..model_flags import checked_model, loaded_model, model_options, model_parent
from .app import FRAME_FORMATS, MAX_FPS, OUTPUTS, build_app, page_html, state_dir_path
from .preflight import check_address, check_extra
from .tokens import token_of, warn_unguarded
from .wire import MAX_BODY_BYTES, chunk_frame, frames_message, parse_prompt

__all__ = ["MAX_BODY_BYTES", "add_parser", "build_app", "chunk_frame", "frames_message",
           "page_html", "parse_prompt", "run"]

#: the parser's copy of `framekv.engine.serving.sizes.MAX_SESSIONS` (building the
#: parser imports no engine): --max-sessions beyond it is refused at parse time
MAX_SESSIONS = 4096


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = one_line_errors(subparsers.add_parser(
        "serve", help="streaming sessions over HTTP/WebSockets",
        description=__doc__.split("\n\n")[0], parents=[model_parent()]))
    add_preset_arguments(p, default=None, note="the rollout's: default the model family's "
                         "(the reference DiT: tiny; Wan: its config's, tiny or wan-1.3b)")
    p.add_argument("--output", choices=OUTPUTS, default=None,
                   help="what a chunk message carries: video frames (default: Wan's decoded "
                        "by its VAE, a model's without a decoder a picture of its latents) "
                        "or latents")
    p.add_argument("--frame-format", choices=FRAME_FORMATS, default="jpeg",
                   help="with --output frames: the images' format (default jpeg)")
    p.add_argument("--no-overlap", action="store_true",
                   help="with --output frames on CUDA: decode each step after its "
                        "transformer, not beside the next step's")
    p.add_argument("--fps", type=int_in(1, MAX_FPS), default=16,
                   help=f"the video's frame rate the page plays at, 1 to {MAX_FPS} "
                        "(default 16)")
    p.add_argument("--video-strength", type=strength, default=None, metavar="S",
                   help="take video sessions too ({\"input\": \"video\", \"strength\": "
                        "S}: frames in, chunk i made from chunk i's frames), S in (0, 1]; "
                        "the runner samples video to video at S (below 1 every session "
                        "takes video); needs a model with an encoder and --output frames")
    _session_options(p)
    p.add_argument("--cache-dir", default=None, help="kernels and cuDNN plans kept on disk")
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:N] (default: cuda if available)")
    p.set_defaults(func=run)
    return p


def _session_options(p: argparse.ArgumentParser) -> None:
    """Slots, queues, timeouts, the address and the token."""
    p.add_argument("--max-sessions", type=int_in(1, MAX_SESSIONS), default=8,
                   help=f"sessions open at once, at most {MAX_SESSIONS} (default 8)")
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
    p.add_argument("--checkpoint-every", type=positive_int, default=None, metavar="CHUNKS",
                   help="with --state-dir: also write each session there every CHUNKS of "
                        "its chunks (off the GPU thread, atomically), so a server killed "
                        "outright resumes them from the last one")
    p.add_argument("--queue-chunks", type=positive_int, default=4,
                   help="undelivered chunks a session may hold before it waits for its "
                        "client (default 4)")
    p.add_argument("--session-idle-timeout", type=seconds, default=60.0, metavar="SECONDS",
                   help="a session no socket has taken for this long is ended and its "
                        "slot freed (default 60)")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to bind (default 127.0.0.1); another than loopback "
                        "without a token is served with a warning")
    p.add_argument("--port", type=int_in(0, 65535), default=8000,
                   help="0 to 65535; 0: any free port (default 8000)")
    p.add_argument("--token", type=bearer_token, default=None,
                   help="bearer token every route but / and /health needs (printable "
                        "ASCII, no spaces); prefer the FRAMEKV_TOKEN environment "
                        "variable: an option is visible to every user in ps")
    p.add_argument("--head-timeout", type=seconds, default=10.0,
                   help="seconds a client may take to send a request head (at most 16 "
                        "KiB) before its connection is closed (default 10)")
    p.add_argument("--allowed-origins", type=origins, default=None, metavar="ORIGINS",
                   help="pages of other origins whose WebSockets are taken, comma-separated "
                        "http(s)://host[:port], or * for any (default: only the server's "
                        "own origin, and clients that send no Origin)")


def output_of(args) -> str:
    """The ``--output`` in force: frames unless latents are asked for (the reference
    model's frames are `LatentPreview` pictures of its latents)."""
    return args.output or "frames"


def model_name(args) -> str:
    """The model's name in /v1/info: its family's label (`ModelFamily.label`), e.g.
    "reference:PRESET", or "wan-diffusers:CONFIG" (or ":" + the weights folder's name)
    then "+" + the checkpoint's file name if any."""
    from framekv.engine.models import get_model

    return get_model(args.model).label(model_options(args))


def check_checkpoint_every(args) -> None:
    """ValueError for ``--checkpoint-every`` without ``--state-dir`` to write to."""
    every = getattr(args, "checkpoint_every", None)
    if every is not None and args.state_dir is None:
        raise ValueError(f"--checkpoint-every needs --state-dir, the folder the sessions are "
                         f"written to: got --checkpoint-every {every} and no --state-dir")


def check_video_strength(args, output: str) -> None:
    """ValueError for ``--video-strength`` a server cannot take: without frames out, or
    a model family without an encoder, or one that runs no step (`video_options`)."""
    S = getattr(args, "video_strength", None)
    if S is None:
        return
    if output != "frames":
        raise ValueError(f"--video-strength needs --output frames (the encoder follows the "
                         f"decoder), got --output {output}")
    from framekv.engine.models import get_model

    try:
        get_model(args.model).video_options(model_options(args), S)
    except ValueError as exc:
        raise ValueError(f"--video-strength {S:g}: {exc}") from None


def fail(exc: Exception) -> int:
    """``exc`` as the command's one-line error; exit status 2."""
    return _fail("serve", exc)


def checked_options(args) -> dict:
    """What ``args`` ask for, each option checked before anything is built: the token,
    the output, the model (`checked_model`: its family and options, and the preset of a
    family that has a default one, None for another), the device, the state folder
    (made). ValueError naming the option for a bad value or combination."""
    from framekv.ops.device import resolve_device

    token = token_of(args)
    output = output_of(args)
    family, model, preset = checked_model(args)
    device = resolve_device(args.device, name="--device")
    if args.slots is not None and args.slots > args.max_sessions:
        raise ValueError(f"--slots must be at most --max-sessions ({args.max_sessions}), "
                         f"got {args.slots}")
    check_checkpoint_every(args)
    check_video_strength(args, output)
    state_dir = None if args.state_dir is None else state_dir_path(args.state_dir)
    return {"token": token, "output": output, "device": device, "preset": preset,
            "family": family, "model": model, "state_dir": state_dir}


def build_scheduler(args, options: dict):
    """The `StreamScheduler` of ``args`` (``options``: `checked_options`'): the model its
    family loads (`loaded_model`), whose runner the scheduler runs and whose decoder
    (with ``--output frames``) makes its frames; ValueError for one that cannot be
    built (a bad preset for the weights, a pool too large for the device)."""
    from framekv.engine.serving import StreamScheduler

    frames = options["output"] == "frames"
    model = loaded_model(args, decode=frames, device=options["device"])
    return StreamScheduler(**model.scheduler_args(), max_sessions=args.max_sessions,
                           slots=args.slots, swap_quantum=args.swap_quantum,
                           device=options["device"], cache_dir=args.cache_dir, progress=True,
                           queue_chunks=args.queue_chunks,
                           decoder_factory=model.decoder if frames else None,
                           encoder_factory=(model.encoder if getattr(args, "video_strength", None)
                                            is not None else None),
                           overlap=False if getattr(args, "no_overlap", False) else None)


def run(args) -> int:
    """``framekv serve``: build, capture, serve until SIGTERM; the exit status (2 for a
    bad option or option combination, before anything is built; or for a scheduler
    that cannot be built, e.g. a pool too large for the device)."""
    try:
        options = checked_options(args)
        check_extra()                           # before a model is built, not after
        check_address(args.host, args.port)
        warn_unguarded(args.host, options["token"])
        sched = build_scheduler(args, options)
    except ValueError as exc:
        return fail(exc)
    from .net import DrainingServer, server_config

    app = build_app(sched, token=options["token"], output=options["output"],
                    frame_format=args.frame_format, fps=args.fps,
                    idle_timeout=args.session_idle_timeout, model=model_name(args),
                    state_dir=options["state_dir"], checkpoint_every=args.checkpoint_every,
                    allowed_origins=args.allowed_origins)
    server = DrainingServer(server_config(app, host=args.host, port=args.port,
                                          head_timeout=args.head_timeout))
    # uvicorn drains on SIGTERM, then puts back the handler it found and raises the
    # signal again; with this one in place that ends here, and the exit status is 0.
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    server.run()
    return 0 if server.started else 3   # 3: uvicorn's status for a failed startup
