"""Printing session events: one readable line each, or one JSON object each (json_format mapping).

Reply audio is bulk binary; by default the JSON replaces it with its length ("audio_bytes") so that a
terminal or a log stays readable. `include_audio=True` keeps it as base64, as grpcurl would print it.
"""

from __future__ import annotations

import json

from google.protobuf import json_format

from .proto import voiced_pb2 as pb


def event_kind(event: pb.SessionEvent) -> str:
    """The name of the field the event sets ("started", "speech", "transcript", ...)."""
    return event.WhichOneof("event") or "none"


def event_to_dict(event: pb.SessionEvent, include_audio: bool = False) -> dict:
    """The proto3 JSON mapping of `event` (field names as in the .proto), audio bytes as a length."""
    audio_len = None
    if event.HasField("audio") and not include_audio:
        audio_len = len(event.audio.audio)
        event = pb.SessionEvent.FromString(event.SerializeToString())  # leave the caller's copy intact
        event.audio.ClearField("audio")
    d = json_format.MessageToDict(
        event, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    if audio_len is not None:
        d["audio"].pop("audio", None)
        d["audio"]["audio_bytes"] = audio_len
    return d


def event_to_json(
    event: pb.SessionEvent, received_s: float | None = None, include_audio: bool = False
) -> str:
    d = event_to_dict(event, include_audio=include_audio)
    if received_s is not None:
        d["received_ms"] = round(received_s * 1000.0, 1)  # client clock, from the first request sent
    return json.dumps(d, ensure_ascii=False)


def _format_name(fmt: pb.AudioFormat) -> str:
    return f"{pb.AudioEncoding.Name(fmt.encoding).lower()} {fmt.sample_rate_hz} Hz"


def describe_event(event: pb.SessionEvent) -> str:
    """A one-line human description of an event (without timestamp)."""
    kind = event_kind(event)
    if kind == "started":
        cfg = event.started.effective_config
        out = cfg.output_format if cfg.HasField("output_format") else cfg.input_format
        return (
            f"session {event.started.session_id} started: in {_format_name(cfg.input_format)}, "
            f"out {_format_name(out)}, segmentation {pb.SegmentationMode.Name(cfg.segmentation.mode)}"
        )
    if kind == "speech":
        name = "speech started" if event.speech.type == pb.SpeechActivity.SPEECH_STARTED else "speech ended"
        return f"{name} at {event.speech.offset_ms / 1000:.2f} s"
    if kind == "transcript":
        t = event.transcript
        what = "final" if t.is_final else "interim"
        flag = " [hallucination?]" if t.is_hallucination else ""
        lang = f" {t.language}" if t.language else ""
        span = f"{t.start_ms / 1000:.2f}-{t.end_ms / 1000:.2f} s"
        latency = f", {t.latency_ms:.0f} ms" if t.is_final else ""
        return f"transcript ({what}{lang}, {span}{latency}){flag}: {t.text}"
    if kind == "agent_text":
        a = event.agent_text
        latency = f" ({a.latency_ms:.0f} ms)" if a.latency_ms else ""
        return f"agent{latency}: {a.text}" + (" [end]" if a.last else "")
    if kind == "reply":
        r = event.reply
        name = pb.ReplyEvent.Type.Name(r.type).removeprefix("REPLY_").lower()
        extra = f': "{r.text}"' if r.text and r.type == pb.ReplyEvent.REPLY_STARTED else ""
        sent = f" after {r.audio_sent_ms} ms of audio" if r.type != pb.ReplyEvent.REPLY_STARTED else ""
        return f"reply {r.reply_id} {name}{sent}{extra}"
    if kind == "audio":
        c = event.audio
        latency = f", voice-to-voice {c.latency_ms:.0f} ms" if c.sequence == 0 and c.latency_ms else ""
        last = " last" if c.last else ""
        return f"audio reply {c.reply_id} #{c.sequence} at {c.offset_ms} ms, {len(c.audio)} B{last}{latency}"
    if kind == "notice":
        return f"notice {event.notice.code}: {event.notice.message}"
    if kind == "dropped":
        d = event.dropped
        return f"transcript dropped as a likely hallucination ({d.reason}): {d.text}"
    return f"event without content: {event}"


def format_event(event: pb.SessionEvent, received_s: float | None = None) -> str:
    """`[  1.234 s] turn 2  transcript (final en, ...): hello` — time on the client's clock."""
    stamp = f"[{received_s:8.3f} s] " if received_s is not None else ""
    return f"{stamp}turn {event.turn_id:<3d} {describe_event(event)}"
