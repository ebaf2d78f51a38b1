"""The daemon's one HTTP listener: aiohttp in the daemon's own event loop, beside gRPC.

`HttpListener` owns the socket, TLS, bearer-token auth, the Kubernetes probes and the error
shape; doors are sets of routes mounted on it before it starts:

    listener = HttpListener(services, "127.0.0.1:8080", name="media_ws")
    listener.add_routes([web.get("/media", handler)])          # behind the token
    listener.add_routes([web.get("/", page)], public=True)     # no token needed
    ws = await listener.websocket(request)                     # tracked: closed on shutdown

`HttpDoor` is the `http` door of the daemon (`--http HOST:PORT`): the OpenAI-compatible audio API
(voiced.doors.openai_http), the Realtime WebSocket (voiced.doors.realtime) and the web page.

Probes answer as Kubernetes expects: `/healthz` is 200 while the process serves, 503 once its engine process
has stopped (liveness: a restart is the cure),
`/readyz` is 200 once the models are loaded and 503 while loading or draining, or once the engine process
has stopped (readiness). Both
are exempt from the token, as gRPC's health service is. During a drain the listener goes on answering
(the probes say 503 draining, new work is refused UNAVAILABLE) until the daemon closes it.

Before a handler runs, voiced.doors.guard has bounded the connection: a place among
`server.max_connections[_per_door]` (else a 503 without reading the request), the TLS handshake and the
request line and headers within `server.handshake_timeout_s`. Bodies come only compressed as sent
(aiohttp's decompression is off: a 2.7 MB gzip body once unpacked to 1.5 GB): a request with a
Content-Encoding other than identity is refused with 415 before its body is read.

Every error is OpenAI's shape (voiced.doors.shared.HttpError), whatever raised it (a handler, the
core, aiohttp's own 404/405/413); an unexpected exception is logged here and the caller gets a
generic message, never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import weakref
from collections.abc import Iterable

from aiohttp import WSCloseCode, web

from voiced.core.errors import SessionError
from voiced.doors.guard import serve_http
from voiced.doors.shared import (
    INTERNAL_MESSAGE,
    DoorError,
    HttpError,
    from_session_error,
    split_address,
    tls_context,
)

log = logging.getLogger(__name__)

WS_SUBPROTOCOL_TOKEN = "openai-insecure-api-key."  # how a browser, which cannot set headers, sends a token


class HttpListener:
    """One aiohttp application on one address; doors add routes to it before `start()`."""

    def __init__(self, services, address: str, *, name: str = "http"):
        self.services = services
        self.name = name
        self.address = address
        try:
            self.host, self.port = split_address(address)
        except ValueError as e:
            raise DoorError(f"doors.{name}: {e}") from None
        server = services.config.server
        self._token = f"Bearer {server.auth_token}".encode() if server.auth_token else None
        self._ws_token = (WS_SUBPROTOCOL_TOKEN + server.auth_token) if server.auth_token else None
        self._ssl = tls_context(server.tls_cert, server.tls_key)
        self._public: set[str] = set()  # route names that need no token
        self._websockets: weakref.WeakSet[web.WebSocketResponse] = weakref.WeakSet()
        self._closing = False
        self.app = web.Application(middlewares=[self._errors, self._auth, self._encoding],
                                   client_max_size=self.max_body_bytes, handler_args={"auto_decompress": False})
        self.app.router.add_get("/healthz", self._healthz, name="healthz")
        self.app.router.add_get("/readyz", self._readyz, name="readyz")
        self._public |= {"healthz", "readyz"}
        self.app.on_shutdown.append(self._close_websockets)
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None

    @property
    def max_body_bytes(self) -> int:
        """The largest request body: an upload at the configured limit plus its multipart framing."""
        return self.services.config.http.max_upload_bytes + 64 * 1024

    @property
    def scheme(self) -> str:
        return "https" if self._ssl else "http"

    # ------------------------------------------------------------------ mounting

    def add_routes(self, routes: Iterable[web.AbstractRouteDef], *, public: bool = False) -> None:
        """Mount routes (before `start`). `public`: no token needed (static pages, probes)."""
        for route in routes:
            for registered in route.register(self.app.router):
                if public:
                    self._public.add(id(registered.resource))

    async def websocket(self, request: web.Request, **kwargs) -> web.WebSocketResponse:
        """Accept a WebSocket upgrade; the listener closes it (1001, going away) when it shuts down."""
        if self._closing:
            raise HttpError(503, "the server is shutting down; connect again to another instance",
                            code="unavailable", type="server_unavailable")
        protocols = list(kwargs.pop("protocols", ()))
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        if self._ws_token and self._ws_token in offered:
            protocols.append(self._ws_token)  # the browser closes a socket whose protocol is not echoed
        ws = web.WebSocketResponse(protocols=protocols, max_msg_size=self.services.config.server.max_message_bytes,
                                   heartbeat=30.0, **kwargs)
        await ws.prepare(request)
        self._websockets.add(ws)
        return ws

    # ------------------------------------------------------------------ middlewares

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except HttpError as e:
            self.services.count_error(self.name, str(e.status))
            return e.response()
        except SessionError as e:
            err = from_session_error(e)
            self.services.count_error(self.name, str(err.status))
            return err.response()
        except web.HTTPException as e:
            if e.status < 400:
                raise  # redirects and the like
            message = {
                404: f"no route {request.method} {request.path} on this server; see GET /v1/models and the README",
                405: f"{request.method} is not allowed on {request.path}",
                413: f"the request body is larger than this server takes ({self.max_body_bytes} bytes); "
                     "send a smaller file or raise http.max_upload_bytes",
            }.get(e.status, e.text or e.reason)
            err = HttpError(e.status, message, code={413: "request_too_large"}.get(e.status))
            self.services.count_error(self.name, str(e.status))
            return err.response()
        except (asyncio.CancelledError, ConnectionResetError):
            raise  # the caller went away
        except Exception:
            log.exception("%s %s: unexpected error", request.method, request.path)
            self.services.count_error(self.name, "500")
            return HttpError(500, INTERNAL_MESSAGE, type="server_error").response()

    @web.middleware
    async def _encoding(self, request: web.Request, handler):
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            # Audio files are compressed already, and JSON bodies are small: nothing is gained that a
            # decompression bomb would not take back a thousandfold.
            raise HttpError(415, f"Content-Encoding {encoding!r} is not accepted; send the body uncompressed",
                            code="unsupported_content_encoding", close=True)
        return await handler(request)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self._token is None or self._is_public(request) or self._authorized(request):
            return await handler(request)
        raise HttpError(401, "missing or wrong API key: send the header `Authorization: Bearer <token>` "
                             "(server.auth_token)", code="invalid_api_key")

    def _is_public(self, request: web.Request) -> bool:
        route = request.match_info.route
        return route.name in self._public or id(route.resource) in self._public

    def _authorized(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "").encode()
        if hmac.compare_digest(given, self._token):
            return True
        if request.headers.get("Upgrade", "").lower() == "websocket":
            offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
            return any(hmac.compare_digest(p.encode(), self._ws_token.encode()) for p in offered if p)
        return False

    # ------------------------------------------------------------------ probes

    async def _healthz(self, request: web.Request) -> web.Response:
        failure = self.services.failure
        if failure is not None:  # only a restart brings the engines back: liveness says so
            return web.json_response({"status": "failed", "reason": failure}, status=503)
        return web.json_response({"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        s = self.services
        if s.failure is not None:
            return web.json_response({"status": "failed", "reason": s.failure}, status=503)
        if s.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not s.ready:
            return web.json_response({"status": "loading"}, status=503)
        return web.json_response({"status": "ready"})

    # ------------------------------------------------------------------ life cycle

    async def start(self) -> str:
        self._runner, self._site = await serve_http(self.app, self.host, self.port, self._ssl, self.services,
                                                    self.name)
        sockets = self._site._server.sockets if self._site._server else []
        if sockets:
            self.port = sockets[0].getsockname()[1]
        bound = f"{self.host}:{self.port}"
        log.info("%s: listening on %s://%s", self.name, self.scheme, bound)
        return bound

    async def stop_accepting(self) -> None:
        """Drain: the socket stays open so `/readyz` can say 503 draining (a probe refused a connection
        reads as a crash, not a drain); new work is refused by admission. `close` closes it."""

    async def close(self) -> None:
        if self._runner is not None:
            if self._site is not None:
                await self._site.stop()
                self._site = None
            await self._runner.cleanup()  # shutdown signal (closes WebSockets), then the connections
            self._runner = None

    async def _close_websockets(self, app: web.Application) -> None:
        self._closing = True
        sockets = [ws for ws in self._websockets if not ws.closed]
        await asyncio.gather(*(ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
                               for ws in sockets), return_exceptions=True)


class HttpDoor(HttpListener):
    """The `http` door (`--http HOST:PORT`): OpenAI's audio API, the Realtime WebSocket, the page."""

    def __init__(self, services, address: str):
        super().__init__(services, address, name="http")
        from voiced.doors import openai_http, realtime
        from voiced.doors import web as page

        self.add_routes(openai_http.routes(services))
        self.add_routes(realtime.routes(self))
        self.add_routes(page.routes(), public=True)

    async def start(self) -> str:
        bound = await super().start()
        host = f"[{self.host}]" if ":" in self.host else self.host
        log.info("web page: %s://%s:%d/  OpenAI-compatible API: %s://%s:%d/v1", self.scheme, host, self.port,
                 self.scheme, host, self.port)
        return bound


class MetricsListener(HttpListener):
    """Prometheus's `/metrics` on `server.metrics_listen` (its own address, as a scraper expects), served by
    the same bounded listener as the doors: the connection places and deadlines of voiced.doors.guard,
    TLS and the bearer token where they are configured (a scraper sends `authorization` with
    `bearer_token_file`), instead of a thread per connection that an idle client holds forever.
    A scrape reads the collectors on a worker thread: the GPU readings may ask the engine process."""

    def __init__(self, services, address: str):
        super().__init__(services, address, name="metrics")
        self.add_routes([web.get("/metrics", self._metrics)])

    async def _metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        body = await asyncio.to_thread(generate_latest, self.services.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
