"""voiced_client.events: JSON lines (audio as a length) and readable lines for every event kind."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

from voiced_client.events import describe_event, event_to_dict, event_to_json, format_event
from voiced_client.proto import voiced_pb2 as pb

EVENTS = [
    pb.SessionEvent(
        session_id="s1",
        started=pb.SessionStarted(
            session_id="s1",
            effective_config=pb.SessionConfig(
                input_format=pb.AudioFormat(encoding=pb.MULAW, sample_rate_hz=8000)
            ),
        ),
    ),
    pb.SessionEvent(
        session_id="s1",
        turn_id=1,
        speech=pb.SpeechActivity(type=pb.SpeechActivity.SPEECH_STARTED, offset_ms=480),
    ),
    pb.SessionEvent(
        session_id="s1",
        turn_id=1,
        speech=pb.SpeechActivity(type=pb.SpeechActivity.SPEECH_ENDED, offset_ms=2100),
    ),
    pb.SessionEvent(
        session_id="s1",
        turn_id=1,
        transcript=pb.Transcript(
            text=" hello world",
            is_final=True,
            language="en",
            start_ms=480,
            end_ms=2100,
            tokens=[1, 2],
            latency_ms=123.4,
        ),
    ),
    pb.SessionEvent(session_id="s1", turn_id=1, agent_text=pb.AgentText(text="Hello world.", last=True)),
    pb.SessionEvent(
        session_id="s1",
        turn_id=1,
        reply=pb.ReplyEvent(type=pb.ReplyEvent.REPLY_STARTED, reply_id=1, text="Hello world."),
    ),
    pb.SessionEvent(
        session_id="s1",
        turn_id=1,
        audio=pb.AudioChunk(reply_id=1, sequence=0, audio=b"\x01\x02\x03" * 100, latency_ms=450),
    ),
    pb.SessionEvent(
        session_id="s1",
        turn_id=1,
        reply=pb.ReplyEvent(type=pb.ReplyEvent.REPLY_INTERRUPTED, reply_id=1, audio_sent_ms=640),
    ),
    pb.SessionEvent(session_id="s1", turn_id=1, notice=pb.Notice(code="AGENT_UNAVAILABLE", message="down")),
]


def test_json_keeps_audio_out_by_default():
    ev = EVENTS[6]
    d = json.loads(event_to_json(ev, received_s=1.5))
    assert d["audio"]["audio_bytes"] == 300
    assert "audio" not in d["audio"]
    assert d["received_ms"] == 1500.0
    assert d["session_id"] == "s1" and d["turn_id"] == 1
    assert len(ev.audio.audio) == 300  # the caller's event is untouched


def test_json_with_audio_is_base64():
    d = event_to_dict(EVENTS[6], include_audio=True)
    assert base64.b64decode(d["audio"]["audio"]) == b"\x01\x02\x03" * 100


def test_json_uses_proto_names_and_the_standard_mapping():
    d = event_to_dict(EVENTS[3])
    t = d["transcript"]
    assert t["text"] == " hello world" and t["is_final"] is True and t["tokens"] == [1, 2]
    assert t["start_ms"] == 480  # int32: a plain JSON number (int64 would travel as a string)
    assert event_to_dict(EVENTS[1])["speech"]["type"] == "SPEECH_STARTED"
    # Fields without presence are printed even at their default, so consumers need no defaults.
    assert event_to_dict(EVENTS[4])["turn_id"] == 1
    assert "is_hallucination" in t


def test_every_kind_has_a_readable_line():
    lines = [format_event(ev, 0.25) for ev in EVENTS]
    assert all(line.startswith("[   0.250 s] turn ") for line in lines)
    assert "mulaw 8000 Hz" in lines[0]
    assert "speech started at 0.48 s" in lines[1]
    assert "speech ended at 2.10 s" in lines[2]
    assert "final en" in lines[3] and "hello world" in lines[3] and "123 ms" in lines[3]
    assert "agent" in lines[4] and "[end]" in lines[4]
    assert "reply 1 started" in lines[5]
    assert "300 B" in lines[6] and "voice-to-voice 450 ms" in lines[6]
    assert "interrupted after 640 ms" in lines[7]
    assert "AGENT_UNAVAILABLE" in lines[8]
    assert describe_event(pb.SessionEvent())  # an empty event still prints
