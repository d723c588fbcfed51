"""``framekv.client``: the Python clients of `framekv serve`, `Client` and `AsyncClient`
(their module: `framekv.tools.client`, which documents them)."""
from framekv.tools.client import (AsyncClient, AsyncSession, Chunk, Client, ServerError, Session,
                                  decode_chunk)

__all__ = ["AsyncClient", "AsyncSession", "Chunk", "Client", "ServerError", "Session",
           "decode_chunk"]
