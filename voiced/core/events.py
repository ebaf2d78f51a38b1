"""What a door feeds a session, what a session gives back, and how a session fails.

Plain dataclasses: no transport's types. Each door turns its protocol's messages into the input
events below, feeds them to `Session.run`, and turns the output events into its protocol's
messages; an error that ends a session is a `SessionError` whose `ErrorKind` each door maps onto
its own status (gRPC code, HTTP status, WebSocket close code, Wyoming error, AudioSocket error).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from voiced.engines.base import Transcript

if TYPE_CHECKING:  # spec.py imports this module for SessionError
    from voiced.core.spec import SessionSpec


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


# ---------------------------------------------------------------------------- into a session
# The end of the iterator given to Session.run means the caller hung up / finished sending.


@dataclass
class AudioIn:
    data: bytes  # in the session's input Format, any length (the session re-frames it)


@dataclass
class TalkStart:
    pass


@dataclass
class TalkEnd:
    pass


@dataclass
class Speak:
    text: str


@dataclass
class StopSpeaking:
    pass


DTMF_DIGITS = frozenset("0123456789*#ABCD")


@dataclass
class Dtmf:
    digit: str  # "0"-"9", "*", "#", "A"-"D"


@dataclass
class UserText:
    """Typed user text: the agent answers it as it answers a final transcript (a reply with
    AgentTextOut, ReplyStarted, AudioOut when the server speaks, ReplyFinished); Speak, by contrast,
    is text the session says itself."""

    text: str


InputEvent = AudioIn | TalkStart | TalkEnd | Speak | StopSpeaking | Dtmf | UserText


# ---------------------------------------------------------------------------- out of a session
# Every event starts with session_id and turn_id.


@dataclass
class Started:
    session_id: str
    turn_id: int
    spec: SessionSpec  # the effective config: the caller's settings with every default filled in


@dataclass
class SpeechStarted:
    session_id: str
    turn_id: int
    offset_ms: int


@dataclass
class SpeechEnded:
    session_id: str
    turn_id: int
    offset_ms: int


@dataclass
class TranscriptOut:
    session_id: str
    turn_id: int
    transcript: Transcript
    is_final: bool
    start_ms: int
    end_ms: int
    latency_ms: float = 0.0


@dataclass
class AgentTextOut:
    session_id: str
    turn_id: int
    text: str
    last: bool
    latency_ms: float = 0.0


@dataclass
class ReplyStarted:
    session_id: str
    turn_id: int
    reply_id: int
    text: str


@dataclass
class ReplyFinished:
    session_id: str
    turn_id: int
    reply_id: int
    audio_sent_ms: int
    caller_offset_ms: int


@dataclass
class ReplyInterrupted:
    session_id: str
    turn_id: int
    reply_id: int
    audio_sent_ms: int
    caller_offset_ms: int


@dataclass
class AudioOut:
    session_id: str
    turn_id: int
    reply_id: int
    sequence: int
    offset_ms: int
    last: bool
    audio: bytes  # in the caller's output Format
    latency_ms: float = 0.0


@dataclass
class NoticeOut:
    """A problem the session survives (a lost turn, a failed reply)."""

    session_id: str
    turn_id: int
    code: str
    message: str


@dataclass
class HangupOut:
    """The agent ended the call: the door sends what its protocol needs (after the reply's audio,
    which precedes this event) and closes."""

    session_id: str
    turn_id: int
    reason: str


OutputEvent = (Started | SpeechStarted | SpeechEnded | TranscriptOut | AgentTextOut | ReplyStarted | ReplyFinished
               | ReplyInterrupted | AudioOut | NoticeOut | HangupOut)
