"""How a session fails, or a request is refused: an `ErrorKind` each door maps onto its own status
(gRPC code, HTTP status, WebSocket close code, Wyoming error, AudioSocket error), and a message for
the caller that says what to fix.

`engine_error` is the one mapping of the engines' errors: a full queue is the server's state (the
caller may retry), an engine fault is the server's failure (its text goes to the log, never to the
caller), anything else is about the request.
"""

from __future__ import annotations

from enum import Enum

from voiced.engines.base import CapacityError, EngineError, EngineFault


class ErrorKind(str, Enum):
    BAD_INPUT = "bad_input"  # gRPC INVALID_ARGUMENT, HTTP 400
    OVER_CAPACITY = "over_capacity"  # RESOURCE_EXHAUSTED, HTTP 429 / WS close 1013
    UNAVAILABLE = "unavailable"  # loading or draining: UNAVAILABLE, HTTP 503
    NOT_ENABLED = "not_enabled"  # e.g. TTS off: FAILED_PRECONDITION, HTTP 400/404
    NOT_FOUND = "not_found"  # unknown voice/model: NOT_FOUND, HTTP 404
    TIMEOUT = "timeout"  # idle / max length: DEADLINE_EXCEEDED, HTTP 408
    INTERNAL = "internal"  # INTERNAL, HTTP 500 (message never a traceback)


class SessionError(Exception):
    """Ends a call (or refuses a request); the message is for the caller and says what to fix."""

    def __init__(self, kind: ErrorKind, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def invalid(message: str) -> SessionError:
    return SessionError(ErrorKind.BAD_INPUT, message)


ENGINE_FAULT_MESSAGE = ("the speech engine failed while serving this request (an internal error; the server "
                        "log has the details); other requests go on, retry this one")


def engine_error(e: EngineError) -> SessionError:
    """An engine's error as the caller gets it, whichever door it came through."""
    if isinstance(e, CapacityError):
        return SessionError(ErrorKind.OVER_CAPACITY, str(e))
    if isinstance(e, EngineFault):
        # The scheduler has logged the fault with its traceback; its text names our code, not the request.
        return SessionError(ErrorKind.INTERNAL, ENGINE_FAULT_MESSAGE)
    return SessionError(ErrorKind.BAD_INPUT, str(e))
