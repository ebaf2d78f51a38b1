"""Waiting in tests for something another thread or task does: poll a condition until it holds.

The limit only turns a hang into a failure with a message; it is never what a test judges. A test
that needs "X happened before Y" synchronizes on X, it does not sleep and hope (HELPERS.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

GUARD_S = 60.0  # far beyond any wait on a loaded 2-core machine: reaching it means a hang


def until(condition: Callable[[], object], what: str, timeout_s: float = GUARD_S, interval_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


async def until_async(condition: Callable[[], object], what: str, timeout_s: float = GUARD_S,
                      interval_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(interval_s)
