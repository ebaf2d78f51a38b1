"""What every door does before it lets a caller in: count the connection, bound the wait for its
first words, bound what it may make the daemon read.

- `connections(services)`: the one count of open connections of every door but gRPC (whose HTTP/2
  server bounds its own streams), against `server.max_connections_per_door` and
  `server.max_connections`. A door takes a place with `hold(door)` as a connection opens (None: the
  door or the daemon is full, and the caller is told so in its own protocol) and gives it back with
  the returned release. Built the first time a door starts, which also raises the process's soft
  open-file limit to its hard limit (`raise_open_file_limit`): 1,024, a common soft default, is what
  997 unfinished TLS handshakes once took from every door at once.
- `serve_http(app, ...)`: an aiohttp application on the event loop with those places and deadlines: the
  TLS handshake, then each request's line and headers (the first, and every next one on a kept-alive
  connection) within `server.handshake_timeout_s` (aiohttp's keep-alive timer, which a byte at a time
  does not reset), or the connection is closed. A connection over the limits gets a 503 in OpenAI's
  error shape, written without reading its request.
- `read_capped`: a body read up to a limit, counted in the bytes actually read (what a Content-Length
  says is not trusted), within a deadline.
- `check_id` / `cut`: a caller's id bounded at the edge, and any caller text cut for a log line.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import resource
import weakref
from collections import Counter
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_ID_CHARS = 128  # a caller's ids (session id, streamSid, callSid): Twilio's are 34, UUIDs 36
LOG_CHARS = 80  # of any caller-supplied text in one log line
REFUSAL_LINGER_S = 1.0  # a refused HTTP caller gets this long to read the 503 before the socket closes


# ---------------------------------------------------------------------------- the open-file limit


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (every connection is a descriptor); returns
    (soft, hard) as they stand after. A limit that cannot be raised is left as it is."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("open-file limit: could not raise the soft limit %d to %d: %s", soft, hard, e)
    return soft, hard


# ---------------------------------------------------------------------------- connection places


class Connections:
    """Open connections by door, against the per-door and the total limits of `[server]`."""

    def __init__(self, config):
        self._config = config  # ServerConfig: read at each connection, so a test may change the limits
        self.open: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        soft, hard = raise_open_file_limit()
        self.file_limit = soft
        log.info("open-file limit %d (hard %d); connections: at most %d per door, %d in all", soft, hard,
                 config.max_connections_per_door, self.total_limit)
        if self.total_limit < config.max_connections:
            log.warning("server.max_connections %d is over what the open-file limit %d leaves for callers; "
                        "holding at %d (raise `ulimit -n` to take more)", config.max_connections, soft,
                        self.total_limit)

    @property
    def total_limit(self) -> int:
        # The descriptors the daemon needs besides callers' (models, logs, gRPC, engine pipes): 128 held back.
        return max(1, min(self._config.max_connections, self.file_limit - 128))

    def hold(self, door: str) -> Callable[[], None] | None:
        """A place for one connection of `door`, or None when the door or the daemon is full."""
        per_door = self._config.max_connections_per_door
        if self.open[door] >= per_door or sum(self.open.values()) >= self.total_limit:
            self.refused[door] += 1
            if self.refused[door] in (1, 10, 100) or self.refused[door] % 1000 == 0:
                log.warning("%s: connection refused: %d open here, %d in all (server.max_connections_per_door "
                            "%d, server.max_connections %d); %d refused so far", door, self.open[door],
                            sum(self.open.values()), per_door, self.total_limit, self.refused[door])
            return None
        self.open[door] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.open[door] -= 1

        return release

    def refusal(self, door: str) -> str:
        return (f"the server holds its limit of open connections ({self._config.max_connections_per_door} on "
                f"{door}, {self.total_limit} in all: server.max_connections_per_door, server.max_connections); "
                "retry later")


_BY_SERVICES: dict[int, Connections] = {}  # by id(): Services is a dataclass, not hashable


def connections(services) -> Connections:
    """The one `Connections` of a daemon (its Services), forgotten with it."""
    found = _BY_SERVICES.get(id(services))
    if found is None:
        found = _BY_SERVICES[id(services)] = Connections(services.config.server)
        weakref.finalize(services, _BY_SERVICES.pop, id(services), None)
    return found


# ---------------------------------------------------------------------------- HTTP and WebSocket doors


def _http_refusal(message: str) -> bytes:
    body = json.dumps({"error": {"message": message, "type": "server_busy", "param": None,
                                 "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
            "\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
    return head + body


@functools.cache
def _aiohttp_classes():
    """aiohttp is a door's optional package: these subclasses are made when a door first serves HTTP."""
    from aiohttp import web
    from aiohttp.web_protocol import RequestHandler

    class CountedHandler(RequestHandler):
        """aiohttp's per-connection protocol, holding a place of `Connections` while it is open."""

        __slots__ = ("_take", "_refusal", "_release")

        def connection_made(self, transport) -> None:
            self._release = self._take()
            if self._release is None:  # full: the 503, without reading what the caller sends
                transport.write(self._refusal)
                asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)
                return
            super().connection_made(transport)

        def data_received(self, data: bytes) -> None:
            if self._release is not None:
                super().data_received(data)

        def eof_received(self):
            return super().eof_received() if self._release is not None else None

        def connection_lost(self, exc) -> None:
            release, self._release = self._release, None
            if release is None:
                return  # refused: aiohttp never saw this connection
            release()
            super().connection_lost(exc)

    class GuardedSite(web.TCPSite):
        """TCPSite whose connections are CountedHandlers and whose TLS handshake has a deadline."""

        def __init__(self, runner, host, port, *, ssl_context, gate: Connections, door: str, handshake_s: float):
            super().__init__(runner, host, port, ssl_context=ssl_context, reuse_address=True)
            self.gate, self.door, self.handshake_s = gate, door, handshake_s

        async def start(self) -> None:
            self._runner._reg_site(self)  # what BaseSite.start does; then TCPSite.start's, with our protocol
            server = self._runner.server
            refusal = _http_refusal(self.gate.refusal(self.door))

            def protocol():
                handler = CountedHandler(server, loop=server._loop, **server._kwargs)
                handler._take = lambda: self.gate.hold(self.door)
                handler._refusal = refusal
                return handler

            self._server = await asyncio.get_running_loop().create_server(
                protocol, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
                reuse_address=self._reuse_address, reuse_port=self._reuse_port,
                **({"ssl_handshake_timeout": self.handshake_s} if self._ssl_context else {}))

    return CountedHandler, GuardedSite


async def serve_http(app, host: str, port: int, ssl_context, services, door: str):
    """Start `app` on host:port under the limits above; returns (runner, site). Stop it with
    `site.stop()` (no new connections) and `runner.cleanup()`."""
    from aiohttp import web

    c = services.config.server
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0,
                           keepalive_timeout=c.handshake_timeout_s)
    await runner.setup()
    site = _aiohttp_classes()[1](runner, host, port, ssl_context=ssl_context, gate=connections(services),
                                 door=door, handshake_s=c.handshake_timeout_s)
    await site.start()
    return runner, site


# ---------------------------------------------------------------------------- bounded reads


class TooLarge(ValueError):
    """A body past its limit (counted in bytes read)."""


async def read_capped(stream, limit: int, timeout_s: float) -> bytes:
    """Read `stream` (an aiohttp StreamReader or BodyPartReader) to its end, at most `limit` bytes
    (TooLarge past it, before more is held), within `timeout_s` (TimeoutError)."""
    buf = bytearray()
    async with asyncio.timeout(timeout_s or None):
        while True:
            chunk = await (stream.read_chunk(64 * 1024) if hasattr(stream, "read_chunk") else stream.readany())
            if not chunk:
                return bytes(buf)
            buf += chunk
            if len(buf) > limit:
                raise TooLarge(f"more than {limit} bytes")


# ---------------------------------------------------------------------------- caller-supplied text


def cut(text, limit: int = LOG_CHARS) -> str:
    """`text` for a log line: at most `limit` characters, the cut said."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} chars)"


def check_id(value: str, what: str, limit: int = MAX_ID_CHARS) -> str | None:
    """None when `value` (a caller's id) is within bounds, else the message that refuses it."""
    if len(value) > limit:
        return f"{what} is {len(value)} characters; send at most {limit}"
    if not value.isprintable():
        return f"{what} holds control characters; send printable text"
    return None
