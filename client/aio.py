"""The asyncio client of `framekv serve` (`AsyncClient`, `AsyncSession`): the blocking
client's methods (`framekv.client.sessions`, whose module doc is the contract of both),
awaited; ``async with AsyncClient(url) as client``, ``async for chunk in
session.stream()``.
"""
from __future__ import annotations

import asyncio
import contextlib
import json

from .frames import DEFAULT_MAX_FRAMES, encode_frames, server_strength, video_fields
from .poll import AsyncPollLink
from .wire import (OCTETS, ServerError, SessionState, auth_headers, check_response,
                   check_transport, create_body, env_token, prompt_message, prompt_upload)

__all__ = ["AsyncClient", "AsyncSession"]

class AsyncSession(SessionState):
    """A session of an `AsyncClient`: `Session`'s methods, awaited."""

    async def info(self) -> dict:
        return check_response(await self.client.http.get(f"/v1/sessions/{self.id}")).json()

    async def connect(self) -> None:
        from websockets.asyncio.client import connect
        from websockets.exceptions import InvalidHandshake

        if self._ws is not None:
            return
        info = None
        if self.last is not None:
            r = await self.client.http.get(f"/v1/sessions/{self.id}")
            info = r.json() if r.status_code == 200 else None
        if self._transport != "poll":
            try:
                self._ws = await connect(self._ws_url(info), max_size=None,
                                         additional_headers=auth_headers(self.client.token),
                                         open_timeout=self.client.timeout)
            except InvalidHandshake as exc:
                self._refused(exc)
        if self._ws is None:
            self._ws = AsyncPollLink(self.client.http, self.id, self._after(info),
                                     self.client.timeout)
        if self._resume:
            self._resume = False
            await self.resume()

    async def _read(self, timeout) -> None:
        from websockets.exceptions import ConnectionClosed

        try:
            self._take(await asyncio.wait_for(self._ws.recv(), timeout))
            while self._outbox:
                await self._ws.send(self._outbox.popleft())
        except ConnectionClosed as exc:
            raise self._closed(exc) from None

    async def stream(self, timeout: float | None = None):
        from websockets.exceptions import ConnectionClosed

        await self.connect()
        while True:
            while self.pending:
                chunk = self.pending.popleft()
                with contextlib.suppress(ConnectionClosed):   # as the blocking client's
                    await self._ws.send(self._handed(chunk))
                yield chunk
            if self.end is not None:
                return
            await self._read(timeout)

    async def reconnect(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        self._ws = None
        await self.connect()

    async def change_prompt(self, text: str | None = None, *, prompt=None,
                            prompt_seed: int | None = None,
                            timeout: float | None = None) -> dict:
        if prompt is not None:
            raw, headers = prompt_upload(prompt)
            r = await self.client.http.put(f"/v1/sessions/{self.id}/prompt", content=raw,
                                           headers=headers)
            return check_response(r).json()
        message = prompt_message(text, prompt_seed)
        await self.connect()
        self._asking = True
        try:
            await self._ws.send(message)
            while not self._acks:
                if self.end is not None:
                    raise ServerError(409, f"the session ended ({self.end}) before the ack")
                await self._read(timeout)
            return self._ack()
        finally:
            self._asking = False

    async def send_frames(self, frames, *, format: str = "jpeg",
                          quality: int = 90) -> dict | None:
        """`Session.send_frames`, awaited (frames encoded on a worker thread)."""
        from websockets.exceptions import ConnectionClosed

        encoded = await asyncio.to_thread(encode_frames, frames, format, quality)
        messages = encoded.messages(await self.client._max_frames())
        await self.connect()
        if isinstance(self._ws, AsyncPollLink):
            for m in messages:
                r = check_response(await self.client.http.post(
                    f"/v1/sessions/{self.id}/frames", content=m, headers=OCTETS))
            return r.json()
        self._refused_frames()
        try:
            for m in messages:
                await self._ws.send(m)
        except ConnectionClosed as exc:
            raise self._closed(exc) from None

    async def pause(self) -> None:
        await self.connect()
        await self._ws.send(json.dumps({"type": "pause"}))

    async def resume(self) -> None:
        await self.connect()
        await self._ws.send(json.dumps({"type": "resume"}))

    async def close(self) -> bool:
        r = await self.client.http.delete(f"/v1/sessions/{self.id}")
        if self._ws is not None:
            await self._ws.close()
        return r.status_code != 404 and check_response(r) is r


class AsyncClient:
    """`Client` for asyncio: ``await client.create(...)``, ``async for chunk in
    session.stream()``; ``async with AsyncClient(url) as client``."""

    def __init__(self, url: str = "http://127.0.0.1:8000", *, token: str | None = None,
                 timeout: float = 30.0, transport: str = "auto"):
        import httpx

        self.transport = check_transport(transport)
        self.url, self.token, self.timeout = url.rstrip("/"), env_token(token), timeout
        self.http = httpx.AsyncClient(base_url=self.url, headers=auth_headers(self.token),
                                      timeout=timeout)
        self._video: dict | None | bool = False

    async def info(self) -> dict:
        return check_response(await self.http.get("/v1/info")).json()

    async def create(self, *, seed: int, chunks: int | None = None, text: str | None = None,
                     prompt=None, prompt_seed: int | None = None, paused: bool = False,
                     input: str = "text", strength: float | None = None) -> AsyncSession:
        body = {**create_body(seed, chunks, text, prompt_seed, prompt, paused),
                **video_fields(input, strength)}
        if body.get("input") == "video" and strength is None:
            body["strength"] = server_strength(await self._video_in())
        sid = check_response(await self.http.post("/v1/sessions", json=body)).json()["id"]
        s = AsyncSession(self, sid, resume=prompt is not None and not paused)
        if prompt is not None:
            await s.change_prompt(prompt=prompt)
        return s

    async def _video_in(self) -> dict | None:
        if self._video is False:
            self._video = (await self.info()).get("video_in")
        return self._video

    async def _max_frames(self) -> int:
        return (await self._video_in() or {}).get("max_frames", DEFAULT_MAX_FRAMES)

    def session(self, sid: str, *, after: int | None = None) -> AsyncSession:
        return AsyncSession(self, sid, resume=False, after=after)

    async def close(self) -> None:
        await self.http.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
