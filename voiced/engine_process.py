"""The engines in a process of their own, beside the daemon's (`engines.process = "separate"`,
`voiced serve --engine-process separate`).

In one process the event loop (every door, every caller's frame path) and the engine threads share one
GIL. At 128 callers the recognition thread spends nearly all its time waiting to take it back (py-spy's
native stacks): after each PyTorch call, in tensor reference counts and deallocations, while the loop
reads 6,400 frames a second. vLLM moved its engine core out of its API
server's process for the same reason. Here the child process holds the engines, their threads and the
GPU (it is spawned: CUDA does not survive a fork); the daemon keeps the doors, the sessions, the agents
and the end-of-turn model, and reaches the engines through one pipe:

    daemon -> child  ("submit", engine, id, request)  ("cancel", engine, id)  ("call", id, name, args)  ("stop",)
    child -> daemon  ("ready", {engine: EngineInfo})  ("failed", message)  ("out", engine, EngineOutput)
                     ("reply", id, error, value)  ("heap", voiced.heap.Release)

Requests and outputs are the engines' own dataclasses (numpy audio inside), pickled. The child steps the
engines exactly as the daemon would (voiced.core.scheduler), with each worker's `forward` sending its
outputs up the pipe; the daemon's RemoteWorker has EngineWorker's asyncio side unchanged (stream, run,
cancel on leaving). "call" runs a named function the builder registered (the voice store's methods, a
benchmark's step timings) on a thread of the child.

The daemon's metrics still cover the engines: PyTorch's GPU memory (`voiced_gpu_memory_bytes`) is read in
the child at each scrape (a "call"), and the engine threads' heap trims (`voiced_heap_*`) come up the pipe
as they happen. If the child dies, every request in flight fails with an internal error that says so, and
new ones fail the same way.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from voiced.core.scheduler import EngineWorker
from voiced.core.services import Engines
from voiced.engines.base import EngineError, EngineFault, EngineOutput
from voiced.metrics import gpu_memory_readings

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # as voiced.cli sets it up


@dataclass
class EngineInfo:
    """What the daemon reads of an engine it does not hold (the doors advertise these)."""

    model_name: str
    backend: str
    device: str
    languages: tuple[str, ...]

    def active_requests(self) -> int:
        worker = getattr(self, "worker", None)  # set on the daemon's side (not sent through the pipe)
        return worker.pending if worker is not None else 0


@dataclass
class Built:
    """What a builder (voiced.assembly.build_engines, or a benchmark's around it) returns: the engines'
    workers by name ("asr", "tts"; each on its thread, not started), the TTS engine's voice store, and the
    functions a daemon's "call" may run in the engine process."""

    workers: dict[str, EngineWorker]
    voices: Any = None
    calls: dict[str, Callable[..., Any]] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ the daemon's side


class EngineProcess:
    """The child process and the daemon's end of its pipe. `start` blocks until the engines are loaded
    and warm (minutes on a GPU); then `workers` holds a RemoteWorker per engine."""

    def __init__(self, builder: Callable[[Any], Built], arg: Any, name: str = "voiced-engines"):
        # The child calls builder(arg): a module-level function and a picklable argument (spawned, both
        # travel pickled; the function by its module and name).
        self.builder, self.arg, self.name = builder, arg, name
        self.workers: dict[str, RemoteWorker] = {}
        self.on_release = None  # EngineThread's hook (heap trims): called for each trim the child reports
        self.on_exit: Callable[[], None] | None = None  # called on the reader thread when the child ends unasked
        self._conn = None
        self._proc = None
        self._send_lock = threading.Lock()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count(1)
        self._reader: threading.Thread | None = None
        self._stopped = False

    def start(self) -> dict[str, RemoteWorker]:
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        # Not a daemonic process: torch.compile starts worker processes of its own, which those may not.
        self._proc = ctx.Process(target=_child_main, name=self.name, daemon=False,
                                 args=(theirs, self.builder, self.arg, logging.getLogger().level))
        self._proc.start()
        theirs.close()
        self._conn = ours
        try:
            kind, *rest = ours.recv()
        except EOFError:
            self._proc.join(5)
            raise EngineError(f"the engine process exited with status {self._proc.exitcode} while loading; "
                              "its log above says why") from None
        if kind == "failed":
            self._proc.join(30)
            raise EngineError(f"the engine process could not load the engines: {rest[0]}")
        for engine, info in rest[0].items():
            worker = RemoteWorker(self, engine, info)
            info.worker = worker
            self.workers[engine] = worker
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
        self._reader.start()
        log.info("engines serve from process %d (%s)", self._proc.pid, ", ".join(self.workers))
        return self.workers

    def engines(self) -> Engines:
        """`start`, then the engines as the daemon serves with them (voiced.core.services.Engines): their
        workers, the voice store, the GPU memory readings, and this process, which the daemon watches."""
        workers = self.start()
        tts = workers.get("tts")
        return Engines(asr=workers.get("asr"), tts=tts, voices=RemoteVoices(self) if tts is not None else None,
                       process=self, gpu_memory=lambda: self.call("gpu.memory", timeout=5), call=self.call)

    # EngineWorker's thread interface, which the daemon starts and stops each worker's "thread" through.
    def attach(self, worker) -> None:
        pass

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def send(self, message: tuple) -> None:
        if self._stopped:
            raise EngineFault("the engine process has ended; the daemon needs a restart")
        with self._send_lock:  # the event loop and voice calls' threads both send
            self._conn.send(message)

    def call(self, name: str, *args: Any, timeout: float | None = 600.0) -> Any:
        """Run the child's function `name` (Built.calls) on `args`; its exception is raised here."""
        call_id = next(self._call_ids)
        done: Future = Future()
        self._calls[call_id] = done
        try:
            self.send(("call", call_id, name, args))
            return done.result(timeout)
        finally:
            self._calls.pop(call_id, None)

    def stop(self, timeout: float = 10.0) -> None:
        if self._proc is None or self._stopped:
            return
        try:
            self.send(("stop",))
        except (OSError, EngineFault):
            pass
        self._stopped = True  # asked: the reader's end of the pipe is no news
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s; terminating it", timeout)
            self._proc.terminate()
            self._proc.join(5)

    def _read(self) -> None:
        """The reader thread: outputs to their callers' queues (on their loops), replies to their calls."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "out":
                worker = self.workers[message[1]]
                worker._deliver(message[2])
                if worker._on_step is not None and (message[2].final or message[2].error is not None):
                    worker._on_step(worker.engine)  # the daemon's gauge of requests in flight
            elif kind == "heap":
                if self.on_release is not None:
                    self.on_release(message[1])
            elif kind == "reply":
                _, call_id, error, value = message
                done = self._calls.get(call_id)
                if done is not None:
                    if error is not None:
                        done.set_exception(error)
                    else:
                        done.set_result(value)
        unasked = not self._stopped
        self._stopped = True
        if unasked:
            self._proc.join(5)
            log.error("the engine process ended (exit status %s); requests in flight fail", self._proc.exitcode)
        for worker in self.workers.values():
            for request_id in list(worker._sinks):
                worker._deliver(EngineOutput(request_id, error="the engine process ended; the daemon needs a restart",
                                             fault=True))
        for done in list(self._calls.values()):
            if not done.done():
                done.set_exception(EngineFault("the engine process ended"))
        if unasked and self.on_exit is not None:
            self.on_exit()


class RemoteWorker(EngineWorker):
    """EngineWorker's asyncio side for an engine in the child: the same `stream` and `run`, with
    submissions and cancellations sent down the pipe and outputs delivered by the reader thread."""

    def __init__(self, host: EngineProcess, name: str, info: EngineInfo):
        super().__init__(info, name, thread=host)
        self.host = host

    def start(self) -> None:
        pass  # the child's threads run from `EngineProcess.start`

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self.host.stop(timeout)

    def _submit(self, request_id: int, request: Any) -> None:
        self.host.send(("submit", self.name, request_id, request))

    def _cancel(self, request_id: int) -> None:
        try:
            self.host.send(("cancel", self.name, request_id))
        except (OSError, EngineFault):
            pass  # the child is gone, and the request with it


VOICE_CALLS = ("list", "has", "resolve", "add", "delete")  # what the daemon asks of a voice store


def voice_calls(voices) -> dict[str, Callable[..., Any]]:
    """A builder's `Built.calls` for the TTS engine's voice store (what RemoteVoices calls)."""
    return {f"voices.{m}": getattr(voices, m) for m in VOICE_CALLS}


class RemoteVoices:
    """The TTS engine's voice store in the child, as the daemon uses it. `has` is asked on the event loop
    before each reply, so presets and the cloned voices seen so far answer here, without a round trip."""

    def __init__(self, host: EngineProcess):
        self.host = host
        self._known = {v.name for v in self.list()}

    def list(self):
        voices = self.host.call("voices.list")
        self._known = {v.name for v in voices}
        return voices

    def has(self, name: str) -> bool:
        from voiced.engines.spark.voices import parse_preset

        if name in self._known or parse_preset(name) is not None:
            return True
        return bool(self.host.call("voices.has", name))

    def resolve(self, name: str | None):
        return self.host.call("voices.resolve", name)

    def add(self, name: str, audio, transcript: str):
        info = self.host.call("voices.add", name, audio, transcript)
        self._known.add(info.name)
        return info

    def delete(self, name: str) -> bool:
        self._known.discard(name)
        return bool(self.host.call("voices.delete", name))


# ------------------------------------------------------------------------------------ the child's side


def _child_main(conn, builder: Callable[[Any], Built], arg: Any, level: int) -> None:
    # The daemon decides when the engines stop: after its drain (a "stop"), or when its end of the pipe
    # closes. A terminal's Ctrl-C and a service manager's SIGTERM reach the whole process group, and the
    # engines must outlive the calls the drain lets finish.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=level or logging.INFO, format=LOG_FORMAT)
    try:
        built = builder(arg)
    except BaseException as e:  # the daemon reports it and stops
        log.exception("the engine process could not load the engines")
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    built.calls.setdefault("gpu.memory", gpu_memory_readings)  # this process's, as the daemon's metrics read it
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock:  # each engine's thread, and the call threads
            conn.send(message)

    for name, worker in built.workers.items():
        worker.forward = lambda out, n=name: send(("out", n, out))
        worker.thread.on_release = lambda release: send(("heap", release))  # for the daemon's metrics
        worker.start()
    send(("ready", {name: EngineInfo(w.engine.model_name, w.engine.backend, str(w.engine.device),
                                     tuple(w.engine.languages)) for name, w in built.workers.items()}))
    calls = ThreadPoolExecutor(2, thread_name_prefix="engine-call")
    try:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break  # the daemon is gone
            kind = message[0]
            if kind == "submit":
                built.workers[message[1]].submit_forwarded(message[2], message[3])
            elif kind == "cancel":
                built.workers[message[1]].cancel_forwarded(message[2])
            elif kind == "call":
                calls.submit(_answer, send, built.calls, *message[1:])
            elif kind == "stop":
                break
    finally:
        for worker in built.workers.values():
            worker.stop()
        calls.shutdown(wait=False)


def _answer(send, calls: dict, call_id: int, name: str, args: tuple) -> None:
    try:
        value, error = calls[name](*args), None
    except Exception as e:  # raised in the daemon by the caller
        value, error = None, e if isinstance(e, EngineError) else EngineFault(f"{name} failed: {type(e).__name__}: {e}")
    send(("reply", call_id, error, value))
