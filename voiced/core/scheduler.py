"""Runs stepped engines on a worker thread and serves them to asyncio sessions.

All sessions share one worker per engine. The worker's thread is the engine's only caller (see
voiced.engines.base): it takes submissions and cancellations from a queue between steps, runs one
batched step, and hands each output to the session that asked for it on the event loop. So the
batch fills from every caller at once, and a caller that is slow to read its results only grows
its own queue; it never holds up the engine or the other callers.

Engines on one GPU share one thread (`EngineThread`), stepped in a fixed order (recognition first,
its steps are short and a caller is waiting on each transcript). Two threads would fight over the
GIL: a busy TTS thread holds it for most of every 5 ms switch interval, and each of the ASR
thread's few hundred Python-level operations per step would wait for it.

With `overlap` (engines.overlap), the thread steps its engines in rounds: each engine with work
launches its step's GPU work (`step_parts`, engines/base.py) before any of them waits for its results,
so recognition's kernels and the TTS's run side by side on their own CUDA streams, and one engine's
host work and read-back happen while the other's kernels run. Without it, one engine's step waits for
the GPU while the other has nothing queued there.

When the engines go quiet after a batch of more than one request, the thread hands the C heap's
free memory back to the OS (voiced.heap), so a long-running daemon's RSS does not ratchet up after
each burst: wide batches free the largest buffers, and glibc keeps them otherwise.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from voiced import heap
from voiced.engines.base import (
    CapacityError,
    EngineError,
    EngineFault,
    EngineOutput,
    SteppedEngine,
    fault_output,
    finish,
)

log = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    steps: int = 0
    submitted: int = 0
    cancelled: int = 0
    finished: int = 0
    failed: int = 0


class EngineThread:
    """One thread stepping one or more engines, in the order they were attached.

    `step_log=N` keeps the thread's last N events, in the order it did them, as (engine name, event,
    request ids): "submit" and "cancel" when one reaches the engine, "step" with the ids the engine
    held, "done" when one finished or failed; and, under the thread's own name, "trim" when it handed
    free heap memory back and "idle" when it went to sleep with nothing to do. The scheduling policy
    is judged from it exactly, as the thread saw it, whatever the machine's load. Off (None) by default.
    """

    def __init__(self, name: str, step_log: int = 0, overlap: bool = False):
        self.name = name
        self.overlap = overlap
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.workers: list[EngineWorker] = []
        self._thread: threading.Thread | None = None
        self.first_budget_s = FIRST_BUDGET_S
        self.step_log: deque[tuple[str, str, tuple[int, ...]]] | None = deque(maxlen=step_log) if step_log else None
        self.trim_after_s = TRIM_AFTER_S
        self.widest = 0  # most requests one engine held in a step since the last trim
        self.last_release: heap.Release | None = None
        self.on_release = None  # callback(heap.Release) for metrics; called on this thread

    def attach(self, worker: EngineWorker) -> None:
        self.workers.append(worker)

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"{self.name}-worker", daemon=True)
            self._thread.start()

    def call(self, fn, *args):
        """Run `fn(*args)` on this thread (starting it if needed) and return its result.

        Warm-up goes through here: cuDNN keeps its attention and convolution plans per thread, so
        plans built on a loading thread are built again (50-150 ms each, measured on an H200) the
        first time the serving thread meets each shape, on a caller's time.
        """
        done: Future = Future()
        self.start()
        self.commands.put((None, "call", None, (done, fn, args)))
        return done.result()

    def stop(self, timeout: float = 10.0) -> None:
        for w in self.workers:
            w._stopping = True
        self.commands.put((None, "stop", None, None))
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        self._stopped = False
        while not self._stopped:
            if not any(w.engine.has_work() for w in self.workers):
                self._apply(self._wait())  # idle: sleep until a command arrives
            self._drain()
            if not self._stopped:
                self._step_all()

    def _wait(self):
        """The next command, however long it takes to come.

        After a batch of more than one request, a quiet spell of `trim_after_s` first hands the C
        heap's free pages back to the OS (tens of ms at most). Waiting for the quiet keeps it off the
        hot path: a busy daemon, whose next request comes within the spell, reuses those buffers
        instead, and the sessions the batch served have ended and freed theirs by then. One request at
        a time (a batch of one) leaves nothing to trim: resident memory stays flat over thousands of
        such sessions.
        """
        if self.widest > 1:
            try:
                return self.commands.get(timeout=self.trim_after_s)
            except queue.Empty:
                self.widest = 0
                self.last_release = heap.release()
                self._log(self.name, "trim")
                if self.last_release is not None and self.on_release is not None:
                    self.on_release(self.last_release)
        self._log(self.name, "idle")
        return self.commands.get()

    def _log(self, name: str, event: str, request_ids: tuple[int, ...] = ()) -> None:
        if self.step_log is not None:
            self.step_log.append((name, event, request_ids))

    def _apply(self, command) -> None:
        worker, kind, request_id, request = command
        if kind == "stop":
            self._stopped = True
        elif kind == "call":
            done, fn, args = request
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # handed to the caller, who raises it
                done.set_exception(e)
        else:
            worker._apply(kind, request_id, request)

    def _drain(self) -> None:
        """Apply whatever arrived since the last step: submissions and cancellations."""
        while not self._stopped:
            try:
                self._apply(self.commands.get_nowait())
            except queue.Empty:
                return

    def _step_all(self) -> None:
        """The first engine runs until it is idle (or has had `FIRST_BUDGET_S`), then the others step once.

        Recognition requests are short (a transcript is a few steps) and a caller waits on each one;
        a TTS request is long and streams. So a transcript finishes in a burst instead of one step
        per TTS step, and the budget keeps a queue of transcripts from starving the replies.
        """
        if not self.workers:
            return  # started early for `call` (warm-up) before any engine was attached
        if self.overlap:
            self._step_round()
            return
        first, *others = self.workers
        deadline = time.monotonic() + self.first_budget_s
        while first.engine.has_work() and not self._stopped:
            first._step()
            if others and time.monotonic() >= deadline:
                break
            self._drain()  # new utterances join the burst; cancellations land at once
        for w in others:
            if w.engine.has_work() and not self._stopped:
                w._step()

    def _step_round(self) -> None:
        """One step of every engine with work, interleaved at the points where each waits for the GPU:
        recognition launches first, then the TTS, then each reads its results back in the same order."""
        running = [w._stepping(split=True) for w in self.workers if w.engine.has_work()]
        while running:
            for parts in list(running):
                try:
                    next(parts)
                except StopIteration:
                    running.remove(parts)


# The sink of a request another process submitted (EngineWorker.submit_forwarded).
FORWARDED = (None, None)
# How long the first engine (recognition) may step back to back before the others get a step.
FIRST_BUDGET_S = 0.05
# How long the engines stay quiet after a wide batch before the thread trims the C heap.
TRIM_AFTER_S = 1.0


class EngineWorker:
    def __init__(self, engine: SteppedEngine, name: str, on_step=None, thread: EngineThread | None = None):
        self.engine = engine
        self.name = name
        self.stats = WorkerStats()
        self._on_step = on_step  # callback(engine) for metrics; called on the worker thread
        self.thread = thread or EngineThread(name)
        self.thread.attach(self)
        self._ids = itertools.count(1)
        self._sinks: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._in_engine: dict[int, None] = {}  # ids the engine holds, oldest first (worker thread only)
        self._stopping = False
        # Set where this worker serves another process (voiced.engine_process): outputs go to it, not to
        # an asyncio queue here.
        self.forward: Callable[[EngineOutput], None] | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def _thread(self) -> threading.Thread | None:
        return self.thread._thread

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.thread.stop(timeout)

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
        self._submit(request_id, request)
        done = False
        try:
            while True:
                out = await sink.get()
                if out.error is not None:
                    done = True
                    raise (CapacityError if out.busy else EngineFault if out.fault else EngineError)(out.error)
                if out.final:
                    done = True
                yield out.value
                if done:
                    return
        finally:
            self._sinks.pop(request_id, None)
            if not done:
                self._cancel(request_id)

    async def run(self, request: Any) -> Any:
        """Submit and wait for the single final value (ASR)."""
        result = None
        async for value in self.stream(request):
            result = value
        return result

    def _submit(self, request_id: int, request: Any) -> None:
        self.thread.commands.put((self, "submit", request_id, request))

    def _cancel(self, request_id: int) -> None:
        self.thread.commands.put((self, "cancel", request_id, None))

    # ------------------------------------------------------------------ for another process

    def submit_forwarded(self, request_id: int, request: Any) -> None:
        """Submit for another process (`forward` set): the id is its, the outputs go to `forward`."""
        self._sinks[request_id] = FORWARDED
        self._submit(request_id, request)

    def cancel_forwarded(self, request_id: int) -> None:
        if self._sinks.pop(request_id, None) is not None:
            self._cancel(request_id)

    # ------------------------------------------------------------------ worker thread

    def _apply(self, kind: str, request_id: int, request: Any) -> None:
        if kind == "submit":
            if request_id not in self._sinks:
                return  # cancelled before it was ever submitted
            self.stats.submitted += 1
            try:
                self.engine.submit(request_id, request)
                self._in_engine[request_id] = None
                self._log("submit", (request_id,))
            except CapacityError as e:
                self._deliver(EngineOutput(request_id, error=str(e), busy=True))
            except EngineError as e:
                self._deliver(EngineOutput(request_id, error=str(e)))
            except Exception as e:  # a bug (or out of memory) fails this request, not the worker
                log.exception("%s: submit failed", self.name)
                self._deliver(fault_output(request_id, self.name, e))
        elif kind == "cancel":
            self.stats.cancelled += 1
            self.engine.cancel(request_id)
            if request_id in self._in_engine:
                self._in_engine.pop(request_id)
                self._log("cancel", (request_id,))

    def _log(self, event: str, request_ids: tuple[int, ...]) -> None:
        self.thread._log(self.name, event, request_ids)

    def _step(self) -> None:
        finish(self._stepping(split=False))

    def _stepping(self, split: bool) -> Generator[None, None, None]:
        """One engine step, delivered; `split`: through the engine's `step_parts` where it has them,
        yielding where the engine waits for the GPU (EngineThread._step_round)."""
        self.thread.widest = max(self.thread.widest, len(self._in_engine))
        if self.thread.step_log is not None:
            self._log("step", tuple(sorted(self._in_engine)))
        parts = getattr(self.engine, "step_parts", None) if split else None
        try:
            outputs = (yield from parts()) if parts is not None else self.engine.step()
        except Exception as e:
            outputs = self._recover(e)
            if outputs is None:
                return
        self.stats.steps += 1
        if self._on_step is not None:
            self._on_step(self.engine)
        for out in outputs:
            self._deliver(out)

    def _recover(self, error: Exception) -> list[EngineOutput] | None:
        """After a step raised: the engine could not tell which request caused it (see
        voiced.engines.base). The newest is the likeliest (it grew the batch, or it is what changed), so
        it fails and the rest step again; at worst every request goes, one per try, not the worker.
        The outputs of the step that went through, or None when no request was left to fail."""
        while True:
            if not self._in_engine:
                log.error("%s: engine step failed with no request in flight", self.name, exc_info=error)
                return None
            newest = max(self._in_engine)
            log.error("%s: engine step failed; failing the newest request (%d) and stepping again",
                      self.name, newest, exc_info=error)
            self.engine.cancel(newest)
            self._deliver(fault_output(newest, self.name, error))
            try:
                return self.engine.step()
            except Exception as e:
                error = e

    def _deliver(self, out: EngineOutput) -> None:
        target = self._sinks.get(out.request_id)
        if out.final or out.error is not None:
            if out.error is not None:
                self.stats.failed += 1
            else:
                self.stats.finished += 1
            if out.request_id in self._in_engine:
                self._in_engine.pop(out.request_id)
                self._log("done", (out.request_id,))
        if target is None:
            return  # the caller left; its cancel is on the way
        if target is FORWARDED:
            if out.final or out.error is not None:
                self._sinks.pop(out.request_id, None)
            self.forward(out)
            return
        loop, sink = target
        try:
            loop.call_soon_threadsafe(sink.put_nowait, out)
        except RuntimeError:
            pass  # the loop is closed (shutdown)
