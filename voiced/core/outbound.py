"""What waits for a caller who may have stopped reading: responses made but not yet taken, bounded in bytes.

A door writes to a socket, and a caller that stops reading blocks that write (flow control); what the
engines make meanwhile (reply audio comes faster than anyone listens) waits in the daemon's memory.
`server.max_outbound_bytes` bounds it: past it the request ends with OVER_CAPACITY, which frees its
engine work and its place, instead of the daemon's memory growing or its place being held forever.
A session (voiced.core.session) keeps its events this way; `Outbound` does it for a door's work that
has no session (a Wyoming synthesis).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from voiced.core.events import ErrorKind, SessionError

EVENT_BYTES = 64  # what an event costs in the budget, besides its audio


def cost(event) -> int:
    """An event's bytes in the budget: its audio, if any, plus EVENT_BYTES."""
    audio = getattr(event, "audio", None)
    return EVENT_BYTES + (len(audio) if isinstance(audio, (bytes, bytearray)) else 0)


def over_capacity(waiting: int, limit: int) -> SessionError:
    return SessionError(
        ErrorKind.OVER_CAPACITY,
        f"the caller is not reading its responses: {waiting} bytes are waiting "
        f"(server.max_outbound_bytes is {limit}); read the stream as fast as it arrives")


class Outbound:
    """One request's responses on their way to the one task that writes them, bounded in bytes.

    The producer `put`s (never blocks; past the limit it raises OVER_CAPACITY) and `end`s; the writer
    iterates. An item stops counting once the writer has taken it."""

    def __init__(self, limit: int):
        self.limit = limit
        self.waiting = 0  # bytes put and not yet taken
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item, size: int) -> None:
        if self.waiting + size > self.limit:
            raise over_capacity(self.waiting + size, self.limit)
        self.waiting += size
        self._queue.put_nowait((item, size))

    def end(self) -> None:
        self._queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator:
        while (entry := await self._queue.get()) is not None:
            item, size = entry
            self.waiting -= size
            yield item
