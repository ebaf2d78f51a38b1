"""Realtime events: what a client sends is checked with errors that name the field; what the daemon
sends validates against the openai SDK's own models."""

from __future__ import annotations

import base64

import pytest

from tests.openai_models import server_event
from voiced.doors import realtime_events as rt
from voiced.doors.realtime_events import EventError, RealtimeConfig, TurnDetection

DEFAULTS = TurnDetection(threshold=0.5, prefix_padding_ms=300, silence_duration_ms=500)


def test_client_events_are_parsed_and_audio_is_decoded():
    ev = rt.parse_client_event({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"\x01\x02").decode()})
    assert ev["audio"] == b"\x01\x02"
    assert rt.parse_client_event({"type": "response.cancel"})["type"] == "response.cancel"


@pytest.mark.parametrize("event, code, param", [
    ({"type": "nonsense"}, "unknown_event_type", "type"),
    ({"no": "type"}, "missing_required_parameter", "event.type"),
    ({"type": 3}, "invalid_type", "event.type"),
    ([1, 2], "invalid_event", None),
    ({"type": "input_audio_buffer.append"}, "missing_required_parameter", "event.audio"),
    ({"type": "input_audio_buffer.append", "audio": "@@not base64@@"}, "invalid_value", "audio"),
    ({"type": "session.update"}, "missing_required_parameter", "event.session"),
    ({"type": "session.update", "session": "x"}, "invalid_type", "event.session"),
    ({"type": "conversation.item.create", "item": {}}, "missing_required_parameter", "item.type"),
    ({"type": "conversation.item.truncate", "item_id": "x", "content_index": 0, "audio_end_ms": 1},
     "unsupported_event", "type"),
])
def test_bad_client_events_name_what_is_wrong(event, code, param):
    with pytest.raises(EventError) as e:
        rt.parse_client_event(event)
    assert (e.value.code, e.value.param) == (code, param)


def test_a_client_event_id_is_carried_into_the_error():
    with pytest.raises(EventError) as e:
        rt.parse_client_event({"type": "input_audio_buffer.append", "event_id": "evt_9"})
    assert e.value.event_id == "evt_9"


def test_user_text_items():
    item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": " Hello "},
                                                           {"type": "input_text", "text": "there"}]}
    assert rt.user_text(item, None) == "Hello there"
    with pytest.raises(EventError, match="input_audio_buffer.append"):
        rt.user_text({"type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "AA=="}]}, None)
    with pytest.raises(EventError, match="function calls"):
        rt.user_text({"type": "function_call_output", "call_id": "c", "output": "{}"}, None)


def test_session_update_maps_formats_vad_voice_and_instructions():
    cfg = rt.apply_session_update(RealtimeConfig(), {
        "type": "realtime", "instructions": "Be brief.",
        "audio": {"input": {"format": {"type": "audio/pcmu"},
                            "turn_detection": {"type": "server_vad", "threshold": 0.9, "silence_duration_ms": 700}},
                  "output": {"format": {"type": "audio/pcma"}, "voice": "male"}}}, None, DEFAULTS)
    assert (cfg.input_format, cfg.output_format, cfg.voice, cfg.instructions) == ("audio/pcmu", "audio/pcma", "male",
                                                                                  "Be brief.")
    assert cfg.turn_detection == TurnDetection(0.9, 300, 700)
    assert rt.vad_aggressiveness(0.9) == 3 and rt.vad_aggressiveness(0.5) == 2 and rt.vad_aggressiveness(0.0) == 0
    manual = rt.apply_session_update(cfg, {"audio": {"input": {"turn_detection": None}}}, None, DEFAULTS)
    assert manual.turn_detection is None and manual.voice == "male"


@pytest.mark.parametrize("session, param", [
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.input.format.rate"),
    ({"audio": {"input": {"format": {"type": "audio/opus"}}}}, "session.audio.input.format.type"),
    ({"audio": {"input": {"turn_detection": {"type": "push_to_talk"}}}}, "session.audio.input.turn_detection.type"),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad", "eagerness": "eager"}}}},
     "session.audio.input.turn_detection.eagerness"),
    ({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 3}}}},
     "session.audio.input.turn_detection.threshold"),
    ({"audio": {"output": {"speed": 9}}}, "session.audio.output.speed"),
    ({"type": "transcription"}, "session.type"),
    ({"output_modalities": ["text"]}, "session.output_modalities"),
])
def test_bad_session_updates_are_refused(session, param):
    with pytest.raises(EventError) as e:
        rt.apply_session_update(RealtimeConfig(), session, "evt_1", DEFAULTS)
    assert e.value.param == param and e.value.event_id == "evt_1"


def test_every_server_event_validates_against_the_sdk_models():
    ids = rt.Ids()
    item, resp = ids.new("item"), ids.new("resp")
    cfg = rt.apply_session_update(RealtimeConfig(), {"instructions": "x", "audio": {
        "input": {"turn_detection": {"type": "server_vad"}}, "output": {"voice": "female"}}}, None, DEFAULTS)
    transcription = RealtimeConfig(type="transcription", input_format="audio/pcmu")
    part = {"content_index": 0, "item_id": item, "output_index": 0, "response_id": resp}
    events = [
        {"type": "session.created", "session": rt.session_object(cfg, model="voiced", asr_model="large-v3-turbo")},
        {"type": "session.updated", "session": rt.session_object(RealtimeConfig(), model="voiced", asr_model="tiny")},
        {"type": "session.created", "session": rt.session_object(transcription, model="voiced", asr_model="tiny")},
        {"type": "input_audio_buffer.speech_started", "audio_start_ms": 120, "item_id": item},
        {"type": "input_audio_buffer.speech_stopped", "audio_end_ms": 900, "item_id": item},
        {"type": "input_audio_buffer.committed", "item_id": item, "previous_item_id": None},
        {"type": "input_audio_buffer.cleared"},
        {"type": "conversation.item.added", "item": rt.user_item(item, None, status="in_progress"),
         "previous_item_id": None},
        {"type": "conversation.item.done", "item": rt.user_item(item, "hello"), "previous_item_id": None},
        {"type": "conversation.item.added", "item": rt.user_item(item, text="typed")},
        {"type": "conversation.item.input_audio_transcription.delta", "item_id": item, "content_index": 0,
         "delta": "hel"},
        {"type": "conversation.item.input_audio_transcription.completed", "item_id": item, "content_index": 0,
         "transcript": "hello", "usage": {"type": "duration", "seconds": 1.2}},
        {"type": "response.created", "response": rt.response_object(resp, "in_progress", voice="female")},
        {"type": "response.output_item.added", "response_id": resp, "output_index": 0,
         "item": rt.assistant_item(item, None, "in_progress")},
        {"type": "response.content_part.added", **part, "part": {"type": "audio", "transcript": ""}},
        {"type": "response.output_audio_transcript.delta", **part, "delta": "Hi"},
        {"type": "response.output_audio.delta", **part, "delta": base64.b64encode(b"\0\0").decode()},
        {"type": "response.output_audio.done", **part},
        {"type": "response.output_audio_transcript.done", **part, "transcript": "Hi"},
        {"type": "response.content_part.done", **part, "part": {"type": "audio", "transcript": "Hi"}},
        {"type": "response.output_item.done", "response_id": resp, "output_index": 0,
         "item": rt.assistant_item(item, "Hi", "completed")},
        {"type": "response.done", "response": rt.response_object(
            resp, "completed", output=[rt.assistant_item(item, "Hi", "completed")], voice="female")},
        {"type": "response.done", "response": rt.response_object(resp, "cancelled", reason="turn_detected")},
        {"type": "response.done", "response": rt.response_object(resp, "failed", error=("TTS_FAILED", "no"))},
    ]
    for ev in events:
        server_event({"event_id": ids.new("event"), **ev})
    err = rt.error_event(ids.new("event"), "unknown_event_type", "unknown", param="type", client_event_id="c1")
    assert server_event(err).error.event_id == "c1"


def test_the_strict_check_catches_a_misspelt_field():
    with pytest.raises(AssertionError, match="audio_strat_ms"):
        server_event({"type": "input_audio_buffer.speech_started", "event_id": "e", "audio_start_ms": 1,
                      "audio_strat_ms": 1, "item_id": "i"})
