"""What waits for a caller who may have stopped reading: responses made but not yet taken, bounded in bytes.

A door writes to a socket, and a caller that stops reading blocks that write (flow control); what the
engines make meanwhile (reply audio comes faster than anyone listens) waits in the daemon's memory.
`server.max_outbound_bytes` bounds it: past it the request ends with OVER_CAPACITY, which frees its
engine work and its place, instead of the daemon's memory growing or its place being held forever.
A session (voiced.core.session) keeps its events this way; `deliver` does it for a door's work that
has no session (a Wyoming synthesis), under the same `server.max_session_s` as a session.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

from voiced.core.errors import ErrorKind, SessionError

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


def too_long(limit_s: float) -> SessionError:
    return SessionError(
        ErrorKind.TIMEOUT,
        f"the session reached its maximum length of {limit_s:g} s (server.max_session_s); start a new one to go on")


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


async def deliver(limits, produce: Callable[[Callable[[object, int], None]], Awaitable[None]],
                  write: Callable[[object], Awaitable]) -> None:
    """Runs `produce(put)` while a task of its own `write`s each item `put(item, size)` hands it, in order;
    returns once produce has returned and every item is written. `limits` is the config's `[server]`:
    items waiting for the writer are bounded by `max_outbound_bytes` (past it, OVER_CAPACITY) and the
    whole, the caller's reading of the last items included, by `max_session_s` (TIMEOUT). A failed
    write ends it with that error; whatever ends it, the writer is cancelled."""
    outbound = Outbound(limits.max_outbound_bytes)

    async def write_out() -> None:
        async for item in outbound:
            await write(item)

    writer = asyncio.ensure_future(write_out())

    def put(item, size: int) -> None:
        if writer.done():
            writer.result()  # the connection failed: its error ends the work
        outbound.put(item, size)

    async def run() -> None:
        await produce(put)
        outbound.end()
        await writer

    try:
        await asyncio.wait_for(run(), limits.max_session_s or None)
    except TimeoutError:
        raise too_long(limits.max_session_s) from None
    finally:
        writer.cancel()
        await asyncio.gather(writer, return_exceptions=True)
