"""OpenAI Realtime's JSON events, as the generally available interface defines them.

`parse_client_event` checks what a client sent (type, required fields, their JSON types) and raises
`EventError` with the code, message and parameter that the `error` event reports; it returns the
event as a dict with the fields the daemon uses. The `server_*` builders make the events the daemon
sends; every one validates against the `openai` SDK's own models (`openai.types.realtime`), which the
tests check. Plain dicts and no SDK import here: the SDK is a client library, not a server dependency.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import uuid
from dataclasses import dataclass

from voiced.core.errors import SessionError
from voiced.core.spec import MAX_TEXT_CHARS, check_user_text, clean_text

CLIENT_EVENTS = (
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "response.create",
    "response.cancel",
    "output_audio_buffer.clear",
)
# In the SDK's client events, not served by this daemon (an `error` event says so).
UNSUPPORTED_CLIENT_EVENTS = ("conversation.item.delete", "conversation.item.retrieve", "conversation.item.truncate")

# Realtime audio formats -> (encoding, sample rate) of voiced's Format.
AUDIO_FORMATS = {"audio/pcm": ("LINEAR16", 24000), "audio/pcmu": ("MULAW", 8000), "audio/pcma": ("ALAW", 8000)}


class EventError(ValueError):
    """A client event the daemon cannot act on; the connection goes on."""

    def __init__(self, code: str, message: str, param: str | None = None, event_id: str | None = None):
        super().__init__(message)
        self.code, self.message, self.param, self.event_id = code, message, param, event_id


class Ids:
    """Ids in OpenAI's style (`event_...`, `item_...`, `resp_...`), unique within the process."""

    _counter = itertools.count(1)

    def __init__(self):
        self._prefix = uuid.uuid4().hex[:10]

    def new(self, kind: str) -> str:
        return f"{kind}_{self._prefix}{next(self._counter):06d}"


# ---------------------------------------------------------------------------- client events


def _need(obj: dict, key: str, kind: type | tuple, where: str, event_id: str | None, *, required: bool = True):
    value = obj.get(key)
    if value is None:
        if required:
            raise EventError("missing_required_parameter", f"{where}.{key} is required", f"{where}.{key}", event_id)
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _tuple(kind)):
        names = " or ".join(t.__name__ for t in _tuple(kind)).replace("str", "a string").replace("dict", "an object")
        raise EventError("invalid_type", f"{where}.{key} must be {names}", f"{where}.{key}", event_id)
    return value


def _tuple(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def parse_client_event(event) -> dict:
    """A decoded JSON message -> the event (a dict); raises EventError naming what is wrong."""
    if not isinstance(event, dict):
        raise EventError("invalid_event", "each message must be a JSON object with a `type`")
    event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
    kind = _need(event, "type", str, "event", event_id)
    if kind in UNSUPPORTED_CLIENT_EVENTS:
        raise EventError("unsupported_event", f"{kind} is not supported by this server", "type", event_id)
    if kind not in CLIENT_EVENTS:
        raise EventError("unknown_event_type", f"unknown event type {kind!r}; this server takes: "
                         + ", ".join(CLIENT_EVENTS), "type", event_id)
    if kind == "session.update":
        session = _need(event, "session", dict, "event", event_id)
        _need(session, "type", str, "session", event_id, required=False)
    elif kind == "input_audio_buffer.append":
        audio = _need(event, "audio", str, "event", event_id)
        try:
            event["audio"] = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise EventError("invalid_value", "audio must be base64-encoded audio bytes", "audio", event_id) from None
    elif kind == "conversation.item.create":
        item = _need(event, "item", dict, "event", event_id)
        _need(item, "type", str, "item", event_id)
    elif kind == "response.create":
        _need(event, "response", dict, "event", event_id, required=False)
    elif kind == "response.cancel":
        _need(event, "response_id", str, "event", event_id, required=False)
    return event


def user_text(item: dict, event_id: str | None, waiting_chars: int = 0) -> str:
    """The text of a `conversation.item.create` user message (its input_text parts, cleaned as the
    session core takes typed text). `waiting_chars`: typed text already waiting for response.create,
    which goes to the agent with this one."""
    if item.get("type") != "message" or item.get("role") != "user":
        raise EventError("unsupported_item", "only message items with role user can be created here (the "
                         "agent's instructions go in session.update; function calls and tools are not served)",
                         "item.type" if item.get("type") != "message" else "item.role", event_id)
    content = _need(item, "content", list, "item", event_id)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict):
            raise EventError("invalid_type", f"item.content[{i}] must be an object", f"item.content[{i}]", event_id)
        if part.get("type") == "input_text":
            texts.append(_need(part, "text", str, f"item.content[{i}]", event_id))
        else:
            raise EventError("unsupported_content", f"item.content[{i}].type {part.get('type')!r} is not served; "
                             "send input_text (audio goes through input_audio_buffer.append)",
                             f"item.content[{i}].type", event_id)
    text = clean_text(" ".join(texts))
    if waiting_chars + len(text) > MAX_TEXT_CHARS:
        waiting = f" (with the {waiting_chars} waiting for response.create)" if waiting_chars else ""
        raise EventError("string_above_max_length", f"the message's text is {len(text)} characters{waiting}; "
                         f"send at most {MAX_TEXT_CHARS} at a time", "item.content", event_id)
    try:
        return check_user_text(text, "the message's text")
    except SessionError as e:
        raise EventError("invalid_value", e.message, "item.content", event_id) from None


# ---------------------------------------------------------------------------- session config


@dataclass
class TurnDetection:
    """server_vad's or semantic_vad's settings (None fields: the daemon's default). server_vad ends a turn
    on silence; semantic_vad is the daemon's smart turn detection (voiced.core.turns) at `eagerness`."""

    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None
    interrupt_response: bool = True
    type: str = "server_vad"  # or "semantic_vad"
    eagerness: str = "medium"  # semantic_vad: low | medium | high ("auto" is medium)


@dataclass
class RealtimeConfig:
    """What `session.update` can set, as the daemon keeps it."""

    type: str = "realtime"  # or "transcription"
    input_format: str = "audio/pcm"
    output_format: str = "audio/pcm"
    turn_detection: TurnDetection | None = None  # None: manual (commit ends a turn)
    voice: str | None = None
    speed: float = 1.0
    instructions: str | None = None
    language: str | None = None
    prompt: str | None = None  # transcription prompt
    # audio.input.transcription.model as the client named it. Partial transcripts (transcription .delta
    # events) come for any model but whisper-1, as OpenAI streams them only from its newer models: each
    # costs a recognition of the speech so far every asr.interim_interval_ms.
    transcription_model: str | None = None

    @property
    def interim(self) -> bool:
        return self.transcription_model not in (None, "whisper-1")


def _format(obj, where: str, event_id) -> str | None:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise EventError("invalid_type", f"{where} must be an object such as {{\"type\": \"audio/pcm\", \"rate\": 24000}}",
                         where, event_id)
    kind = _need(obj, "type", str, where, event_id, required=False) or "audio/pcm"
    if kind not in AUDIO_FORMATS:
        raise EventError("invalid_value", f"{where}.type {kind!r} is not served; use audio/pcm (24 kHz), "
                         "audio/pcmu or audio/pcma (8 kHz G.711)", f"{where}.type", event_id)
    rate = obj.get("rate")
    if kind == "audio/pcm" and rate not in (None, 24000):
        raise EventError("invalid_value", f"{where}.rate must be 24000 for audio/pcm", f"{where}.rate", event_id)
    return kind


def apply_session_update(current: RealtimeConfig, session: dict, event_id: str | None,
                         vad_defaults: TurnDetection) -> RealtimeConfig:
    """`session.update`'s `session` applied to `current`: a new config, or EventError."""
    from dataclasses import replace

    kind = session.get("type", current.type)
    if kind != current.type:
        raise EventError("invalid_value", f"session.type is {current.type!r} for this connection"
                         + (" (connect with ?intent=transcription for a transcription session)"
                            if kind == "transcription" else ""), "session.type", event_id)
    cfg = replace(current)
    if "instructions" in session:
        cfg.instructions = _need(session, "instructions", str, "session", event_id, required=False) or None
    modalities = session.get("output_modalities")
    if modalities is not None and (not isinstance(modalities, list) or "audio" not in modalities):
        raise EventError("invalid_value", "session.output_modalities must include \"audio\": "
                         "this server answers in speech (with its transcript)", "session.output_modalities", event_id)
    audio = _need(session, "audio", dict, "session", event_id, required=False) or {}
    inp = _need(audio, "input", dict, "session.audio", event_id, required=False) or {}
    out = _need(audio, "output", dict, "session.audio", event_id, required=False) or {}
    cfg.input_format = _format(inp.get("format"), "session.audio.input.format", event_id) or cfg.input_format
    if "turn_detection" in inp:
        cfg.turn_detection = _turn_detection(inp["turn_detection"], vad_defaults, event_id)
    transcription = inp.get("transcription")
    if "transcription" in inp and transcription is None:
        cfg.transcription_model = None
    if isinstance(transcription, dict):
        cfg.transcription_model = _need(transcription, "model", str, "session.audio.input.transcription", event_id,
                                        required=False) or cfg.transcription_model or "whisper-1"
        cfg.language = _need(transcription, "language", str, "session.audio.input.transcription", event_id,
                             required=False) or cfg.language
        cfg.prompt = _need(transcription, "prompt", str, "session.audio.input.transcription", event_id,
                           required=False) or cfg.prompt
    cfg.output_format = _format(out.get("format"), "session.audio.output.format", event_id) or cfg.output_format
    voice = out.get("voice")
    if isinstance(voice, dict):
        voice = voice.get("id")
    if voice is not None:
        if not isinstance(voice, str) or not voice.strip():
            raise EventError("invalid_value", "session.audio.output.voice must be a voice name",
                             "session.audio.output.voice", event_id)
        cfg.voice = voice.strip()
    if out.get("speed") is not None:
        speed = out["speed"]
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
            raise EventError("invalid_value", "session.audio.output.speed must be a number from 0.25 to 4.0",
                             "session.audio.output.speed", event_id)
        cfg.speed = float(speed)
    return cfg


def _turn_detection(td, defaults: TurnDetection, event_id) -> TurnDetection | None:
    where = "session.audio.input.turn_detection"
    if td is None:
        return None
    if not isinstance(td, dict):
        raise EventError("invalid_type", f"{where} must be an object or null", where, event_id)
    kind = td.get("type")
    if kind not in ("server_vad", "semantic_vad"):
        raise EventError("invalid_value", f"{where}.type {kind!r} is not served; use server_vad, semantic_vad, "
                         "or null to end turns with input_audio_buffer.commit", f"{where}.type", event_id)
    if td.get("create_response") is False:
        raise EventError("invalid_value", f"{where}.create_response false is not served: every turn is answered "
                         "(use intent=transcription for transcripts only)", f"{where}.create_response", event_id)
    out = TurnDetection(defaults.threshold, defaults.prefix_padding_ms, defaults.silence_duration_ms,
                        type=kind, eagerness=defaults.eagerness)
    if kind == "semantic_vad" and td.get("eagerness") is not None:
        eagerness = td["eagerness"]
        if eagerness not in ("low", "medium", "high", "auto"):
            raise EventError("invalid_value", f"{where}.eagerness must be low, medium, high or auto",
                             f"{where}.eagerness", event_id)
        out.eagerness = "medium" if eagerness == "auto" else eagerness
    for key, low, high in (("threshold", 0.0, 1.0), ("prefix_padding_ms", 0, 2000), ("silence_duration_ms", 100, 5000)):
        value = td.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            raise EventError("invalid_value", f"{where}.{key} must be a number from {low} to {high}",
                             f"{where}.{key}", event_id)
        setattr(out, key, value if key == "threshold" else int(value))
    if td.get("interrupt_response") is not None:
        out.interrupt_response = _need(td, "interrupt_response", bool, where, event_id)
    return out


def vad_aggressiveness(threshold: float) -> int:
    """Realtime's VAD threshold (0..1, higher: louder speech needed) -> webrtcvad's aggressiveness 0..3."""
    return min(3, int(threshold * 4))


def session_object(cfg: RealtimeConfig, *, model: str, asr_model: str) -> dict:
    """The `session` of session.created / session.updated: the effective settings."""
    inp: dict = {"format": _format_object(cfg.input_format)}
    td = cfg.turn_detection
    inp["turn_detection"] = None if td is None else {
        "type": "server_vad", "threshold": td.threshold, "prefix_padding_ms": td.prefix_padding_ms,
        "silence_duration_ms": td.silence_duration_ms, "create_response": True,
        "interrupt_response": td.interrupt_response} if td.type == "server_vad" else {
        "type": "semantic_vad", "eagerness": td.eagerness, "create_response": True,
        "interrupt_response": td.interrupt_response}
    transcription = {"model": cfg.transcription_model or asr_model}
    if cfg.language:
        transcription["language"] = cfg.language
    if cfg.prompt:
        transcription["prompt"] = cfg.prompt
    inp["transcription"] = transcription
    if cfg.type == "transcription":
        return {"type": "transcription", "audio": {"input": inp}}
    session = {"type": "realtime", "model": model, "output_modalities": ["audio"],
               "audio": {"input": inp, "output": {"format": _format_object(cfg.output_format), "speed": cfg.speed}}}
    if cfg.voice:
        session["audio"]["output"]["voice"] = cfg.voice
    if cfg.instructions:
        session["instructions"] = cfg.instructions
    return session


def _format_object(kind: str) -> dict:
    return {"type": kind, "rate": 24000} if kind == "audio/pcm" else {"type": kind}


# ---------------------------------------------------------------------------- server events


def error_event(event_id: str, code: str, message: str, *, param: str | None = None,
                client_event_id: str | None = None, type: str = "invalid_request_error") -> dict:
    error = {"type": type, "code": code, "message": message, "param": param}
    if client_event_id:
        error["event_id"] = client_event_id
    return {"type": "error", "event_id": event_id, "error": error}


def user_item(item_id: str, transcript: str | None = None, *, text: str | None = None,
              status: str = "completed") -> dict:
    if text is not None:
        content = [{"type": "input_text", "text": text}]
    else:
        content = [{"type": "input_audio", "transcript": transcript}]
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": status,
            "content": content}


def assistant_item(item_id: str, transcript: str | None, status: str) -> dict:
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_audio", "transcript": transcript}]}


def response_object(response_id: str, status: str, *, output: list | None = None, voice: str | None = None,
                    output_format: str = "audio/pcm", reason: str | None = None,
                    error: tuple[str, str] | None = None) -> dict:
    """A `response` for response.created / response.done."""
    resp: dict = {"id": response_id, "object": "realtime.response", "status": status,
                  "output": output or [], "output_modalities": ["audio"], "conversation_id": None,
                  "audio": {"output": {"format": _format_object(output_format), "voice": voice}}}
    if status in ("cancelled", "failed", "incomplete"):
        details: dict = {"type": status}
        if reason:
            details["reason"] = reason
        if error:
            details["error"] = {"code": error[0], "message": error[1], "type": "server_error"}
        resp["status_details"] = details
    return resp
