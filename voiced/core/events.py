"""What a door feeds a session and what a session gives back.

Plain dataclasses: no transport's types. Each door turns its protocol's messages into the input
events below, feeds them to `Session.run`, and turns the output events into its protocol's
messages; an error that ends a session is a `SessionError` (voiced.core.errors) whose `ErrorKind`
each door maps onto its own status.
"""

from __future__ import annotations

from dataclasses import dataclass

from voiced.core.spec import SessionSpec
from voiced.engines.base import Transcript

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
class TurnWithoutWords:
    """A turn the session ended (SpeechEnded was sent) that has no transcript: its words were judged a
    hallucination (Whisper's output on a cough, noise, or the tail of a word) and dropped, so no transcript
    and no reply follow. A door whose protocol promised the caller the turn's transcript closes it here, and
    tells the caller what was dropped and why (voiced.engines.base.hallucination_reason)."""

    session_id: str
    turn_id: int
    start_ms: int
    end_ms: int
    text: str = ""  # the words dropped
    reason: str = ""  # the filter that dropped them, with its figures


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


OutputEvent = (Started | SpeechStarted | SpeechEnded | TranscriptOut | TurnWithoutWords | AgentTextOut | ReplyStarted
               | ReplyFinished | ReplyInterrupted | AudioOut | NoticeOut | HangupOut)
