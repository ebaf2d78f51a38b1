"""The daemon's event loop: uvloop's by default, the standard library's on request.

Every front door (grpc.aio, the aiohttp doors, Wyoming, AudioSocket) and the session core run in this
one loop, and the engines' threads wait for the GIL whenever it runs Python. At 128 callers it wakes
for 6,400 frames a second: each wake-up goes through the loop's own machinery (the selector, handles,
futures), which asyncio writes in Python and uvloop (libuv) in Cython. On the same daemon, uvloop's
loop spent less of the loop thread's CPU per caller frame (docs/BENCHMARKS.md, "The event loop's CPU
per caller frame, session 10").

`server.event_loop = "asyncio"` (or VOICED_SERVER_EVENT_LOOP=asyncio, or `voiced serve --event-loop
asyncio`) turns it off; uvloop does not run on Windows, where its package is not installed.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

KINDS = ("uvloop", "asyncio")


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop]:
    """What makes a new loop of `kind` (one of KINDS)."""
    if kind == "asyncio":
        return asyncio.new_event_loop
    if kind == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise RuntimeError('server.event_loop is "uvloop" but uvloop is not installed (it does not run on '
                               'Windows); install it, or set server.event_loop = "asyncio" '
                               "(VOICED_SERVER_EVENT_LOOP=asyncio, voiced serve --event-loop asyncio)") from None
        return uvloop.new_event_loop
    raise ValueError(f"server.event_loop is {kind!r}; set one of {', '.join(KINDS)}")


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    return loop_factory(kind)()


def run(main: Coroutine[Any, Any, Any], kind: str) -> Any:
    """`asyncio.run(main)` on a loop of `kind`."""
    factory = loop_factory(kind)
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main)
    loop = factory()  # Python 3.10: asyncio.run has no loop factory
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
