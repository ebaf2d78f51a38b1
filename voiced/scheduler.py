"""Runs a stepped engine on its own thread and serves it to asyncio sessions.

All sessions share one worker per engine. The worker thread is the engine's only caller (see
voiced.engines.base): it takes submissions and cancellations from a queue between steps, runs one
batched step, and hands each output to the session that asked for it on the event loop. So the
batch fills from every caller at once, and a caller that is slow to read its results only grows
its own queue; it never holds up the engine or the other callers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, AsyncIterator

from voiced.engines.base import CapacityError, EngineError, EngineOutput, SteppedEngine

log = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    steps: int = 0
    submitted: int = 0
    cancelled: int = 0
    finished: int = 0
    failed: int = 0


class EngineWorker:
    def __init__(self, engine: SteppedEngine, name: str, on_step=None):
        self.engine = engine
        self.name = name
        self.stats = WorkerStats()
        self._on_step = on_step  # callback(active_requests) for metrics; called on the worker thread
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._sinks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._commands.put(("stop", None, None))
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished (what the sessions are waiting on)."""
        return len(self._sinks)

    # ------------------------------------------------------------------ asyncio side

    async def stream(self, request: Any) -> AsyncIterator[Any]:
        """Submit `request` and yield its outputs' values until the final one.

        Leaving the loop early (the caller hung up, a barge-in) cancels the request in the engine
        and frees its batch slot. An engine error is raised as EngineError.
        """
        if self._stopping:
            raise EngineError(f"the {self.name} engine is shutting down")
        request_id = next(self._ids)
        sink: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._sinks[request_id] = (asyncio.get_running_loop(), sink)
        self._commands.put(("submit", request_id, request))
        done = False
        try:
            while True:
                out = await sink.get()
                if out.error is not None:
                    done = True
                    raise (CapacityError if out.busy else EngineError)(out.error)
                if out.final:
                    done = True
                yield out.value
                if done:
                    return
        finally:
            self._sinks.pop(request_id, None)
            if not done:
                self._commands.put(("cancel", request_id, None))

    async def run(self, request: Any) -> Any:
        """Submit and wait for the single final value (ASR)."""
        result = None
        async for value in self.stream(request):
            result = value
        return result

    # ------------------------------------------------------------------ worker thread

    def _run(self) -> None:
        while True:
            busy = self.engine.has_work()
            try:
                # Block only when idle; while busy, take whatever arrived during the last step.
                command = self._commands.get(block=not busy)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    return
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_work():
                self._step()

    def _apply(self, command: tuple) -> None:
        kind, request_id, request = command
        if kind == "submit":
            if request_id not in self._sinks:
                return  # cancelled before it was ever submitted
            self.stats.submitted += 1
            try:
                self.engine.submit(request_id, request)
            except CapacityError as e:
                self._deliver(EngineOutput(request_id, error=str(e), busy=True))
            except EngineError as e:
                self._deliver(EngineOutput(request_id, error=str(e)))
            except Exception as e:  # a bug must not take the worker (and every caller) down
                log.exception("%s: submit failed", self.name)
                self._deliver(EngineOutput(request_id, error=f"internal error: {e}"))
        elif kind == "cancel":
            self.stats.cancelled += 1
            self.engine.cancel(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("%s: engine step failed; failing the requests in flight", self.name)
            for request_id in list(self._sinks):
                self.engine.cancel(request_id)
                self._deliver(EngineOutput(request_id, error=f"internal error in the {self.name} engine: {e}"))
            return
        self.stats.steps += 1
        if self._on_step is not None:
            self._on_step(self.engine)
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: EngineOutput) -> None:
        target = self._sinks.get(out.request_id)
        if out.final or out.error is not None:
            if out.error is not None:
                self.stats.failed += 1
            else:
                self.stats.finished += 1
        if target is None:
            return  # the caller left; its cancel is on the way
        loop, sink = target
        try:
            loop.call_soon_threadsafe(sink.put_nowait, out)
        except RuntimeError:
            pass  # the loop is closed (shutdown)
