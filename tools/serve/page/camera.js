"use strict";
// The page's camera source: a session created with {"input": "video", "strength"} takes
// the camera's frames on its socket, one JPEG per frames_in message at the session's
// frame rate, and streams chunks made from them back; the page shows the camera beside
// the output and measures input to output (per chunk: from sending the chunk's last
// input frame to receiving the chunk, the median of the last LATENCY_CHUNKS chunks).
// A chunk's header names its input frames, input {first, count}, numbered as the
// server received them: the order they were sent here less the ones it refused. Each
// message carries its frame's index here as its id, a refusal names that id, so the
// server's frame n is the n-th frame sent here that was not refused (`pageIndex`) and
// the send time of the chunk's last frame (a ring of the last RING send times) is
// exact whatever the server dropped or refused. Frames are sent no more than two
// chunks ahead of the input the chunks received have taken: the server keeps one
// chunk of frames waiting at most and drops older ones, so frames beyond that are
// skipped here instead.
const Camera = (() => {
  const el = (id) => document.getElementById(id);
  const LATENCY_CHUNKS = 8;   // the median's window
  const FIRST_SIDE = 256;     // the longest side sent while nothing told the model's size
  const MAX_BUFFERED = 1 << 20;   // bytes the socket may hold unsent before a frame is skipped
  const QUALITY = 0.8;
  const RING = 256;   // send times kept: a chunk answers frames sent within a few chunks
  const C = { stream: null, ws: null, timer: null, fps: 16, sent: 0, nextAt: 0, busy: false,
              sentAt: [], latencies: [], size: null, canvas: null, chunkFrames: null,
              received: 0, covered: 0, touched: false, refused: [] };

  /** One wire message (specs/wire.py): [n: uint32 BE][n bytes of JSON header][payload],
   * the payload the ArrayBuffers ``parts`` back to back. */
  function encodeMessage(header, parts) {
    const head = new TextEncoder().encode(JSON.stringify(header));
    const out = new Uint8Array(4 + head.length + parts.reduce((n, b) => n + b.byteLength, 0));
    new DataView(out.buffer).setUint32(0, head.length, false);
    out.set(head, 4);
    let at = 4 + head.length;
    for (const b of parts) {
      out.set(new Uint8Array(b), at);
      at += b.byteLength;
    }
    return out.buffer;
  }

  /** A frames_in message of encoded images (ArrayBuffers), all width x height; ``id``
   * (optional) names it in the server's refusal. */
  function framesIn(images, format, width, height, id) {
    const header = { type: "frames_in", format, width, height, count: images.length,
                     sizes: images.map((b) => b.byteLength) };
    if (id !== undefined) header.id = id;
    return encodeMessage(header, images);
  }

  function explain(err) {
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      return "this browser gives this page no camera (it needs https or localhost)";
    }
    const why = {
      NotAllowedError: "permission to use the camera was denied",
      SecurityError: "permission to use the camera was denied",
      NotFoundError: "no camera found",
      OverconstrainedError: "no camera found",
      NotReadableError: "the camera is in use by another program",
    }[err && err.name];
    return why || `the camera cannot be opened (${err && err.message || err})`;
  }

  async function select(source) {
    el("camera-note").textContent = "";
    if (source !== "camera") return release();
    try {
      if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) throw null;
      C.stream = await navigator.mediaDevices.getUserMedia({ video: true, audio: false });
    } catch (err) {
      el("source").value = "text";
      el("camera-note").textContent = explain(err) + ": the text prompt still works";
      return release();
    }
    C.stream.getVideoTracks()[0].addEventListener("ended", () => {
      el("source").value = "text";
      el("camera-note").textContent = "the camera stopped: the text prompt still works";
      release();
    });
    const video = el("camera");
    video.srcObject = C.stream;
    video.hidden = false;
    el("strength-row").hidden = false;
    document.body.dataset.source = "camera";
    await video.play().catch(() => {});
  }

  function release() {
    halt();
    if (C.stream) C.stream.getTracks().forEach((t) => t.stop());
    C.stream = null;
    el("camera").srcObject = null;
    el("camera").hidden = true;
    el("strength-row").hidden = true;
    document.body.dataset.source = "text";
  }

  /** The keys a new session's body gets in camera mode (none in text mode), once
   * /v1/info told the model's size, its chunks' frames and the server's strength
   * (the slider's until moved); without it, frames go at FIRST_SIDE, unthrottled. */
  async function session(headers) {
    if (!C.stream) return {};
    try {
      const r = await fetch("v1/info", { headers, cache: "no-store" });
      const info = r.ok ? await r.json() : {};
      const vin = info.video_in, per = info.video_frames_per_chunk;
      C.size = vin ? [vin.width, vin.height] : null;
      C.chunkFrames = per ? [per.first, per.later] : null;
      if (vin && !C.touched) el("strength").value = String(vin.strength);
    } catch (err) {
      C.size = C.chunkFrames = null;
    }
    el("strength-value").textContent = Number(el("strength").value).toFixed(2);
    return { input: "video", strength: Number(el("strength").value) };
  }

  /** The session's socket is open: send frames on it at ``fps`` until `halt`. */
  function opened(ws, fps) {
    halt();
    el("frames-sent").textContent = C.stream ? "0" : "-";
    el("io-latency").textContent = "-";
    if (!C.stream) return;
    Object.assign(C, { ws, fps, sent: 0, nextAt: performance.now(), sentAt: new Array(RING),
                       latencies: [], received: 0, covered: 0, refused: [] });
    pace();
  }

  function pace() {
    const now = performance.now();
    if (now >= C.nextAt) {
      if (!C.busy) send();                 // one frame in encoding at a time: a slow one skips
      C.nextAt += 1000 / C.fps;
      if (C.nextAt < now) C.nextAt = now + 1000 / C.fps;   // late by a frame: skip, no burst
    }
    C.timer = setTimeout(pace, Math.max(0, C.nextAt - performance.now()));
  }

  async function send() {
    const ws = C.ws, video = el("camera");
    if (!ws || ws.readyState !== WebSocket.OPEN || !video.videoWidth) return;
    if (ws.bufferedAmount > MAX_BUFFERED || C.sent - C.refused.length >= ahead()) return;
    C.busy = true;
    try {
      const [crop, w, h] = fit(video.videoWidth, video.videoHeight);
      const jpeg = await encode(video, crop, w, h);
      if (C.ws !== ws || ws.readyState !== WebSocket.OPEN) return;
      ws.send(framesIn([jpeg], "jpeg", w, h, C.sent));
      C.sentAt[C.sent % RING] = [C.sent, performance.now()];
      C.sent += 1;
      el("frames-sent").textContent = String(C.sent);
    } finally {
      C.busy = false;
    }
  }

  /** The server refused a frames_in message (its error message): the frame whose index
   * it names was never numbered there. */
  function refused(msg) {
    const id = msg.id;
    if (!Number.isInteger(id) || id < 0 || id >= C.sent || C.refused.includes(id)) return;
    C.refused.push(id);
    C.refused.sort((a, b) => a - b);
  }

  /** The index here of the server's frame ``n``: n plus the refused frames before it. */
  function pageIndex(n) {
    let p = n;
    for (const r of C.refused) {
      if (r > p) break;
      p += 1;
    }
    return p;
  }

  /** When frame ``index`` was sent, while the ring holds it; else undefined. */
  function sentTime(index) {
    const slot = C.sentAt[index % RING];
    return slot && slot[0] === index ? slot[1] : undefined;
  }

  function ahead() {
    // Frames the server may hold without dropping: those the chunks received took or
    // passed over, the chunk in the works, the next one's waiting.
    if (!C.chunkFrames) return Infinity;
    const [first, later] = C.chunkFrames;
    return C.covered + (C.received === 0 ? first + later : 2 * later);
  }

  function fit(width, height) {
    // ([sx, sy, sw, sh] of the camera, width, height) of the frame sent: once the
    // model's size is known, the camera's center cut to its aspect (the crop the server
    // would make) at that size, or the cut's own where the camera is smaller; before,
    // the whole camera at FIRST_SIDE on its long side at most.
    if (!C.size) {
      const s = Math.min(1, FIRST_SIDE / Math.max(width, height));
      return [[0, 0, width, height], Math.max(1, Math.round(width * s)),
              Math.max(1, Math.round(height * s))];
    }
    const [W, H] = C.size;
    const s = Math.min(width / W, height / H);       // camera pixels a model pixel covers
    const sw = W * s, sh = H * s, k = Math.min(1, s);
    return [[(width - sw) / 2, (height - sh) / 2, sw, sh],
            Math.max(1, Math.round(W * k)), Math.max(1, Math.round(H * k))];
  }

  async function encode(video, crop, w, h) {
    if (typeof OffscreenCanvas !== "undefined") {
      const c = new OffscreenCanvas(w, h);
      c.getContext("2d").drawImage(video, ...crop, 0, 0, w, h);
      return (await c.convertToBlob({ type: "image/jpeg", quality: QUALITY })).arrayBuffer();
    }
    const c = C.canvas || (C.canvas = document.createElement("canvas"));
    c.width = w;
    c.height = h;
    c.getContext("2d").drawImage(video, ...crop, 0, 0, w, h);
    const blob = await new Promise((ok) => c.toBlob(ok, "image/jpeg", QUALITY));
    return blob.arrayBuffer();
  }

  /** A frames chunk arrived (its header): the model's size, the chunk's latency from
   * sending the last of its input frames (``input``: first, count). */
  function received(header) {
    const now = performance.now();
    C.size = [header.width, header.height];
    C.received += 1;
    // no input named (not a video session's chunk): its frames, had none been dropped
    const input = header.input || { first: header.frame0, count: header.frames };
    C.covered = input.first + input.count;
    const at = sentTime(pageIndex(C.covered - 1));
    if (at === undefined) return;
    C.latencies.push(now - at);
    if (C.latencies.length > LATENCY_CHUNKS) C.latencies.shift();
    const sorted = C.latencies.slice().sort((a, b) => a - b);
    const mid = sorted.length >> 1;
    const median = sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
    el("io-latency").textContent = `${median.toFixed(0)} ms`;
  }

  /** Stop sending (the camera stays open for the next session). */
  function halt() {
    clearTimeout(C.timer);
    C.timer = null;
    C.ws = null;
  }

  el("source").addEventListener("change", (ev) => select(ev.target.value));
  el("strength").addEventListener("input", (ev) => {
    C.touched = true;
    el("strength-value").textContent = Number(ev.target.value).toFixed(2);
  });
  return { encodeMessage, framesIn, session, opened, received, refused, pageIndex, halt,
           active: () => C.stream !== null, refusedFrames: () => C.refused.slice() };
})();
