"""What the doors share of protocols: the one module a door imports from doors/ besides its own parts
(tests/test_layers.py holds that). Session work two doors need lives in voiced.core instead.

- Addresses: `split_address` reads every door's HOST:PORT (`tcp://HOST:PORT` for Wyoming);
  `door_address` checks a telephony door's listen address and agent at start; `tls_context` is
  the server's certificate for the doors that speak TLS.
- Errors: `DoorError` for a door that cannot open; `HttpError` is OpenAI's error shape
  (`{"error": {"message", "type", "param", "code"}}`) and `from_session_error` maps the core's
  ErrorKind onto it (an INTERNAL message never reaches the caller).
- `last_words`: a door's last write to a caller who may have stopped reading, bounded in time.
- `OPENAI_VOICES`: OpenAI's voice names, which both OpenAI doors (the audio API and Realtime) map
  onto the server's presets.

No transport library is imported here at module level: a door's optional package (aiohttp, ...)
matters only to those who open it.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Awaitable

from voiced.core.errors import ErrorKind, SessionError

CLOSE_GRACE_S = 5.0  # for the last message to a caller that may have stopped reading

# OpenAI's voice names -> the nearest preset (by the voice's published gender and register).
OPENAI_VOICES = {
    "alloy": "female", "coral": "female", "nova": "female-high", "shimmer": "female-high", "sage": "female-low",
    "marin": "female", "ballad": "male-high", "ash": "male", "echo": "male", "fable": "male-high",
    "onyx": "male-low", "verse": "male", "cedar": "male-low",
}


class DoorError(ValueError):
    """A configured door that cannot be built; the message says what to do."""


# ---------------------------------------------------------------------------- addresses


def split_address(address: str, scheme: str | None = None) -> tuple[str, int]:
    """HOST:PORT (or [v6]:PORT, or :PORT for 127.0.0.1) -> (host, port); with `scheme` ("tcp"), the
    address may also be written scheme://HOST:PORT. ValueError says what to write instead."""
    text = address.strip()
    if scheme and text.startswith(f"{scheme}://"):
        text = text[len(scheme) + 3:]
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535 or "/" in host:
        form = f"{scheme}://HOST:PORT" if scheme else "HOST:PORT"
        raise ValueError(f"{address!r} is not {form} (e.g. {f'{scheme}://' if scheme else ''}127.0.0.1:8080)")
    return host.strip("[]") or "127.0.0.1", int(port)


def door_address(services, front: str, agent: str, listen: str) -> tuple[str, int]:
    """A telephony door's start: its agent must exist and `listen` must be HOST:PORT (DoorError
    otherwise); returns (host, port)."""
    if agent and agent not in services.agents.names():
        raise DoorError(f"{front}.agent {agent!r} is not an agent of this server; agents: "
                        f"{', '.join(services.agents.names())}")
    try:
        return split_address(listen)
    except ValueError as e:
        raise DoorError(f"doors.{front}: {e}") from None


def tls_context(cert: str, key: str) -> ssl.SSLContext | None:
    """The server's TLS context from server.tls_cert and server.tls_key; None when neither is set."""
    if not (cert or key):
        return None
    if not (cert and key):
        raise ValueError("TLS needs both server.tls_cert and server.tls_key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    return ctx


# ---------------------------------------------------------------------------- errors

# ErrorKind -> (HTTP status, OpenAI error type).
_KIND_STATUS: dict[ErrorKind, tuple[int, str]] = {
    ErrorKind.BAD_INPUT: (400, "invalid_request_error"),
    ErrorKind.NOT_ENABLED: (400, "invalid_request_error"),
    ErrorKind.NOT_FOUND: (404, "invalid_request_error"),
    ErrorKind.TIMEOUT: (408, "invalid_request_error"),
    ErrorKind.OVER_CAPACITY: (429, "server_busy"),
    ErrorKind.UNAVAILABLE: (503, "server_unavailable"),
    ErrorKind.INTERNAL: (500, "server_error"),
}
_STATUS_TYPE = {401: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error", 422: "invalid_request_error"}
INTERNAL_MESSAGE = "internal error; the server log has the details"


class HttpError(Exception):
    """An error for the caller, in OpenAI's shape; raise it from any HTTP handler."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, close: bool = False):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.close = close  # end the connection after the answer: a body left unread is not drained
        self.type = type or _STATUS_TYPE.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self):
        from aiohttp import web

        headers = {"WWW-Authenticate": 'Bearer realm="voiced"'} if self.status == 401 else None
        response = web.json_response(self.body(), status=self.status, headers=headers)
        if self.close:
            response.force_close()
        return response


def from_session_error(e: SessionError, param: str | None = None) -> HttpError:
    status, kind_type = _KIND_STATUS.get(e.kind, (500, "server_error"))
    message = e.message if e.kind is not ErrorKind.INTERNAL else INTERNAL_MESSAGE
    return HttpError(status, message, code=e.kind.value, param=param, type=kind_type)


def loads(text: str | bytes):
    """json.loads for a caller's text: nesting too deep for the parser (RecursionError) is a ValueError
    like any other malformed JSON."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def json_body(text: str) -> dict:
    """A JSON object from a request body, or a 400 that says what is wrong with it."""
    try:
        body = loads(text)
    except ValueError as e:
        raise HttpError(400, f"the body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    return body


# ---------------------------------------------------------------------------- the end of a connection


async def last_words(write: Awaitable, transport, grace: float | None = None) -> bool:
    """Await a door's last write to a caller (an error message, a close frame); a caller that does not
    read within `grace` seconds (default CLOSE_GRACE_S) has its connection cut (`transport.abort()`)
    instead of holding the door in that write. Returns whether the write went out."""
    try:
        await asyncio.wait_for(write, CLOSE_GRACE_S if grace is None else grace)
        return True
    except TimeoutError:
        if transport is not None:
            transport.abort()
        return False
