"""``framekv.client``: the Python clients of `framekv serve`, `Client` (blocking) and
`AsyncClient` (asyncio, ``aio.py``), documented in ``sessions.py``; ``wire.py`` is what
they send and read (the chunk message itself is `framekv.specs.wire`); ``frames.py``
a video session's frames in; ``poll.py`` the long-poll transport, where a WebSocket
cannot be opened."""
from .sessions import AsyncClient, AsyncSession, Client, Session
from .wire import Chunk, ServerError, decode_chunk

__all__ = ["AsyncClient", "AsyncSession", "Chunk", "Client", "ServerError", "Session",
           "decode_chunk"]
