"""The daemon: the shared Services, the engines, every configured front door, health and drain.

It opens the doors at once (health NOT_SERVING, sessions refused UNAVAILABLE), loads the models on
a thread, and switches to SERVING when they are ready. On SIGTERM it drains: NOT_SERVING, every
door stops accepting, open calls get up to `server.drain_seconds` to finish, then it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import threading
import time
from collections.abc import Callable

from voiced import event_loop
from voiced.config import Config
from voiced.core.agents import AgentRegistry
from voiced.core.services import Engines, Services
from voiced.doors.shared import DoorError
from voiced.metrics import Metrics

log = logging.getLogger(__name__)


# Where each listener's address is set: what a "cannot listen" message tells the user to change.
ADDRESS_SETTINGS = {"grpc": "--listen (server.listen)", "http": "--http (doors.http)",
                    "audiosocket": "--audiosocket (doors.audiosocket)", "media_ws": "--media-ws (doors.media_ws)",
                    "wyoming": "--wyoming (doors.wyoming)", "metrics": "--metrics-listen (server.metrics_listen)"}
# The drain's end waits this long for the calls' last utterances to be transcribed and sent (a 30 s
# utterance decodes in well under a second on a GPU; a loaded CPU takes seconds).
KEEP_HEARD_S = 10.0
_BIND_ERRORS = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES, None)  # None: grpc's own bind failure


def cannot_listen(name: str, address: str, error: OSError) -> str:
    """One line for a listener that could not bind: the address, why, and the flag that moves it."""
    if error.errno == errno.EADDRINUSE:
        why = "the address is in use (another voiced, or another program, listens there)"
    else:  # grpc's own failure names the address already
        why = error.strerror or str(error).replace(f"cannot listen on {address}: ", "")
    return (f"cannot open the {name} listener on {address}: {why}; stop what holds it, or pick another address "
            f"with {ADDRESS_SETTINGS.get(name, name)}")


# Doors whose protocols carry no credentials: anyone who reaches their port is a caller.
_NO_AUTH_DOORS = ("audiosocket", "wyoming")


def beyond_loopback(address: str) -> bool:
    """Whether a listener on `address` (HOST:PORT, tcp://HOST:PORT) can be reached from other machines."""
    import ipaddress

    host = address.split("://", 1)[-1].rpartition(":")[0].strip("[]")
    if host in ("", "localhost"):
        return False  # an empty host is 127.0.0.1 (voiced.doors.shared.split_address)
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a host name: whatever it resolves to, it is not known to be loopback


def check_exposure(config: Config) -> None:
    """gRPC or HTTP reachable from the network with no token refuses to start unless the operator said so."""
    s = config.server
    if s.auth_token or s.allow_unauthenticated_network:
        return
    open_ = [f"{key} {address}" for key, address in (("server.listen", s.listen), ("doors.http", config.doors.http))
             if address and beyond_loopback(address)]
    if open_:
        raise DoorError(f"{' and '.join(open_)} would let anyone on the network use this server: no token is set. "
                        "Set server.auth_token (VOICED_SERVER_AUTH_TOKEN), bind 127.0.0.1, or, where only your own "
                        "machines reach it, pass --allow-unauthenticated-network (server.allow_unauthenticated_network)")


def door_addresses(config: Config) -> list[tuple[str, str]]:
    """(name, address) of every door to open: gRPC first, then those set under `[doors]`."""
    extra = [(name, address) for name, address in dataclasses.asdict(config.doors).items() if address]
    return [("grpc", config.server.listen)] + extra


class Daemon:
    def __init__(self, config: Config, load: Callable[[], Engines] | None = None,
                 services: Services | None = None):
        self.config = config
        self.services = services or Services(config=config, metrics=Metrics(), agents=AgentRegistry(config.agent))
        # Loads the engines (voiced.assembly.load_engines); runs on a thread so health can answer meanwhile.
        # Without it the services came with their engines (tests, embedding).
        self._load = load
        self.doors: list = []
        self.port: int | None = None  # the gRPC door's port (tests, benchmarks)
        self._metrics_http = None
        self._stopped = asyncio.Event()
        self._deadline = 0.0  # when a drain stops waiting for open sessions

    async def start(self) -> int:
        """Opens every door, loads the engines, and returns the gRPC port once serving."""
        from voiced import doors

        s = self.services
        check_exposure(self.config)
        for name, address in door_addresses(self.config):
            if name in _NO_AUTH_DOORS and beyond_loopback(address):
                log.warning("the %s door on %s is open to the network and its protocol has no authentication: "
                            "anyone who reaches it is a caller (firewall it to your own machines)", name, address)
            door = doors.build(name, s, address)
            self.doors.append(door)
            try:
                bound = await door.start()
            except OSError as e:
                if e.errno not in _BIND_ERRORS:
                    raise
                raise DoorError(cannot_listen(name, address, e)) from None
            s.doors[door.name] = bound
            if name == "grpc":
                self.port = door.port
            log.info("%s door listening on %s", door.name, bound)
        c = self.config.server
        s.metrics.watch_loop(asyncio.get_running_loop())
        if c.metrics_listen:
            try:
                from voiced.doors.http import MetricsListener  # the doors' bounded listener, the token too

                self._metrics_http = MetricsListener(s, c.metrics_listen)
                await self._metrics_http.start()
            except OSError as e:
                if e.errno not in _BIND_ERRORS:
                    raise
                raise DoorError(cannot_listen("metrics", c.metrics_listen, e)) from None
        log.info("health NOT_SERVING until the models are loaded")
        if self._load is not None:
            s.attach(await asyncio.to_thread(self._load))
        if s.engine_process is not None:
            loop = asyncio.get_running_loop()
            s.engine_process.on_exit = lambda: loop.call_soon_threadsafe(self._engines_lost)
        self._start_workers()
        s.ready = True
        await self._set_serving(True)
        log.info("ready: health SERVING")
        return self.port

    def _start_workers(self) -> None:
        m = self.services.metrics
        for name in ("asr", "tts"):
            worker = getattr(self.services, name)
            if worker is not None:
                worker._on_step = lambda engine, n=name: m.observe_engine(n, engine)
                worker.thread.on_release = m.observe_heap_release
                worker.start()  # a no-op for a thread already running (engines sharing one)

    def _engines_lost(self) -> None:
        """The engine process ended: health NOT_SERVING, so a supervisor or load balancer moves callers on;
        new sessions are refused saying why (the calls in flight have failed already)."""
        s = self.services
        if s.draining:
            return  # its end was the drain's
        s.failure = "the server's engine process has stopped; this server needs a restart (connect to another instance)"
        log.error("the engine process stopped: health NOT_SERVING; restart the daemon")
        asyncio.ensure_future(self._set_serving(False))

    async def _set_serving(self, serving: bool) -> None:
        for door in self.doors:
            hook = getattr(door, "set_serving", None)
            if hook is not None:
                await hook(serving)

    async def drain_and_stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, every door stops accepting, open sessions finish (up to the grace), then stop."""
        s = self.services
        if s.draining:
            return
        s.draining = True
        await self._set_serving(False)
        for door in self.doors:
            await _quietly(door.stop_accepting(), f"{door.name}: stop accepting")
        self._deadline = time.monotonic() + (self.config.server.drain_seconds if grace is None else grace)
        while s.active_sessions and time.monotonic() < self._deadline:
            await asyncio.sleep(0.05)
        if s.active_sessions:
            log.warning("drain: %d sessions still open after the grace period; closing them", s.active_sessions)
            if self._deadline and (grace is None or grace > 0):  # not hurried, nor a stop without a grace
                await self._keep_what_was_heard()
        for door in reversed(self.doors):
            await _quietly(door.close(), f"{door.name}: close")
            s.doors.pop(door.name, None)
        for worker in (s.asr, s.tts):
            if worker is not None:
                await asyncio.to_thread(worker.stop)
        if self._metrics_http is not None:
            await self._metrics_http.close()
        self._stopped.set()

    async def _keep_what_was_heard(self) -> None:
        """The drain's end: each live session's input ends as if its caller had hung up, so the utterance
        in progress is transcribed and sent before the doors close the calls (for up to KEEP_HEARD_S)."""
        from voiced.core.session import live_sessions

        for session in live_sessions(self.services):
            session.end_input()
        end = time.monotonic() + KEEP_HEARD_S
        while live_sessions(self.services) and time.monotonic() < end and self._deadline:
            await asyncio.sleep(0.05)

    def hurry(self) -> None:
        """End a drain in progress now: the sessions still open are closed (a second Ctrl-C)."""
        self._deadline = 0.0

    async def wait(self) -> None:
        await self._stopped.wait()


async def _quietly(coro, what: str) -> None:
    # One door failing to shut down must not keep the others (or the engines) running.
    try:
        await coro
    except Exception:
        log.exception("drain: %s failed", what)


@contextlib.asynccontextmanager
async def running(config: Config, load=None, services: Services | None = None):
    """A started daemon for tests and embedding; drained and stopped on exit."""
    daemon = Daemon(config, load=load, services=services)
    try:
        await daemon.start()
        yield daemon
    finally:
        await daemon.drain_and_stop(grace=0)


def start_in_thread(daemon: Daemon, timeout: float = 600) -> tuple[int, asyncio.AbstractEventLoop, threading.Thread]:
    """Run `daemon` on its own event loop in a daemon thread (tests, benchmarks, embedding in an app).

    Returns once it is serving: (gRPC port, loop, thread). Stop it with
    `asyncio.run_coroutine_threadsafe(daemon.drain_and_stop(), loop)`, then `loop.call_soon_threadsafe(loop.stop)`.
    """
    loop = event_loop.new_event_loop(daemon.config.server.event_loop)
    ready = threading.Event()
    started: dict = {}

    def main():
        asyncio.set_event_loop(loop)

        async def start():
            try:
                started["port"] = await daemon.start()
            except BaseException as e:  # report to the caller instead of dying silently
                started["error"] = e
                await daemon.drain_and_stop(grace=0)
            ready.set()

        loop.run_until_complete(start())
        if "error" not in started:
            loop.run_forever()

    thread = threading.Thread(target=main, daemon=True, name="voiced-daemon")
    thread.start()
    if not ready.wait(timeout):
        raise TimeoutError(f"the daemon did not start within {timeout:.0f} s")
    if "error" in started:
        raise started["error"]
    return started["port"], loop, thread


def catch_stop_signals() -> asyncio.Event:
    """SIGTERM and SIGINT set the returned event (on the running loop) instead of ending the process: a
    daemon drains first (`drain_on_signal`)."""
    import signal

    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def drain_on_signal(daemon: Daemon, stop: asyncio.Event) -> None:
    """Serve until `stop` (catch_stop_signals), then drain, up to server.drain_seconds, and stop; a second
    signal closes the sessions still open at once."""
    await stop.wait()
    stop.clear()
    log.info("signal received: draining (up to %.0f s; a second Ctrl-C stops at once)",
             daemon.config.server.drain_seconds)
    drain = asyncio.ensure_future(daemon.drain_and_stop())
    again = asyncio.ensure_future(stop.wait())
    await asyncio.wait((drain, again), return_when=asyncio.FIRST_COMPLETED)
    if not drain.done():
        log.warning("second signal: closing %d open sessions now", daemon.services.active_sessions)
        daemon.hurry()
    again.cancel()
    await drain
    # What freeze_heap took out of the collector's reach goes back, so the interpreter's exit frees it:
    # frozen, triton's bindings report each of their ~500 objects as a leak on the way out.
    import gc

    gc.unfreeze()
