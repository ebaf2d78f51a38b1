"""A property-based fuzzer over what a caller can send on Converse and StreamingRecognize: any
sequence of configs (valid or not), audio (speech, garbage, odd lengths), controls (in any order)
and empty messages. The only outcomes allowed are a result or a clear status: never UNKNOWN or
INTERNAL, never a hang, never an internal-error notice, and the daemon healthy afterwards.

The budget is bounded and derandomized in CI (the `ci` profile in conftest.py); HYPOTHESIS_PROFILE=dev
explores more."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc

from tests.daemon_harness import audio_requests, daemon_config, of_kind, session_config, start_daemon, wire_audio
from tests.speech import layout
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.audio.ingest import Format

CLEAR = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED}
HANG_S = 120  # a call still open after this is a hang (each one sends at most a few seconds of audio)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(make_openai_checkpoint(tmp_path_factory.mktemp("fuzz"), seed=3), daemon_config())
    yield d
    d.stop()


@pytest.fixture(scope="module")
def speech_bytes():
    """Half a second pieces of real speech (16 kHz LINEAR16): turns, transcripts and agent replies."""
    data = wire_audio(layout(["Can you hear me?"], lead_s=0.2, tail_s=0.6).audio, Format("LINEAR16", 16000))
    return [data[i : i + 16000] for i in range(0, len(data), 16000)]


def optional(values):
    return st.none() | values


@st.composite
def configs(draw) -> pb.SessionConfig:
    c = pb.SessionConfig()
    if draw(st.booleans()) or draw(st.booleans()):  # mostly a format, sometimes none
        c.input_format.encoding = draw(st.sampled_from([pb.LINEAR16, pb.MULAW, pb.ALAW]) | st.integers(0, 9))
        c.input_format.sample_rate_hz = draw(st.sampled_from([8000, 16000, 48000]) | st.integers(-1, 200000))
    if draw(st.booleans()):
        c.output_format.encoding = draw(st.sampled_from([pb.LINEAR16, pb.MULAW]))
        c.output_format.sample_rate_hz = draw(st.sampled_from([8000, 16000, 7]))
    seg = c.segmentation
    seg.mode = draw(st.sampled_from([pb.AUTO, pb.PUSH_TO_TALK]) | st.integers(0, 5))
    for name, values in (("vad_aggressiveness", st.integers(-1, 4)), ("pre_roll_ms", st.integers(-10, 2500)),
                         ("hangover_ms", st.integers(0, 6000)), ("min_speech_ms", st.integers(0, 6000)),
                         ("max_utterance_ms", st.integers(0, 40000))):
        value = draw(optional(values))
        if value is not None:
            setattr(seg, name, value)
    rec = c.recognition
    rec.language = draw(st.sampled_from(["", "en", "de", "xx", "English"]))
    rec.disabled = draw(st.booleans()) and draw(st.booleans())
    rec.interim_results = draw(st.booleans())
    beam = draw(optional(st.integers(-1, 6)))
    if beam is not None:
        rec.beam_size = beam
    c.agent.name = draw(st.sampled_from(["", "echo", "client", "nobody"]))
    c.speech.voice = draw(st.sampled_from(["", "female", "nobody"]))
    for name, values in (("temperature", st.floats(-1, 3, allow_nan=True)), ("top_p", st.floats(0, 1.5)),
                         ("top_k", st.integers(-2, 100))):
        value = draw(optional(values))
        if value is not None:
            setattr(c.speech, name, value)
    barge = draw(optional(st.integers(-5, 6000)))
    if barge is not None:
        c.barge_in.min_speech_ms = barge
    return c


def messages(speech: list[bytes]):
    control = st.one_of(
        st.just(pb.Control(talk_start=pb.TalkStart())), st.just(pb.Control(talk_end=pb.TalkEnd())),
        st.just(pb.Control(stop_speaking=pb.StopSpeaking())), st.just(pb.Control()),
        st.builds(lambda t: pb.Control(speak=pb.Speak(text=t)), st.text(max_size=40)),
    )
    return st.one_of(
        st.builds(lambda b: pb.SessionRequest(audio=b), st.binary(max_size=1500)),
        st.sampled_from(speech).map(lambda b: pb.SessionRequest(audio=b)),
        control.map(lambda c: pb.SessionRequest(control=c)),
        configs().map(lambda c: pb.SessionRequest(config=c)),
        st.just(pb.SessionRequest()),
    )


def call(address: str, method: str, requests: list) -> tuple[list, grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as channel:
        rpc = getattr(pb_grpc.VoicedStub(channel), method)(iter(requests), timeout=HANG_S)
        events = []
        try:
            events.extend(rpc)
            return events, grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return events, e.code(), e.details()


def test_any_message_sequence_gets_a_result_or_a_clear_status(daemon, speech_bytes):
    seen = set()

    @given(method=st.sampled_from(["Converse", "StreamingRecognize"]),
           first=st.one_of(configs().map(lambda c: pb.SessionRequest(config=c)), messages(speech_bytes)),
           rest=st.lists(messages(speech_bytes), max_size=25))
    def check(method, first, rest):
        events, code, details = call(daemon.address, method, [first, *rest])
        assert code in CLEAR, f"{code.name}: {details}"  # DEADLINE_EXCEEDED here would be our hang limit
        if code != grpc.StatusCode.OK:
            assert details and "Traceback" not in details and "internal error" not in details, details
        for n in of_kind(events, "notice"):
            assert "internal error" not in n.notice.message, n.notice
        seen.add(code)

    check()
    assert grpc.StatusCode.OK in seen and grpc.StatusCode.INVALID_ARGUMENT in seen  # the search got somewhere

    # Healthy afterwards: SERVING, nothing left open, and a well-formed session works.
    with grpc.insecure_channel(daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    fmt = Format("LINEAR16", 16000)
    data = b"".join(speech_bytes)
    events, code, details = call(daemon.address, "StreamingRecognize", audio_requests(session_config(fmt), data, fmt))
    assert code == grpc.StatusCode.OK, details
    assert [e.transcript.is_final for e in of_kind(events, "transcript")] == [True]
    for _ in range(400):  # calls finish on the server a moment after their callers see the status
        if daemon.services.active_sessions == 0 and not daemon.session_tasks():
            break
        time.sleep(0.05)
    assert daemon.services.active_sessions == 0 and daemon.session_tasks() == []
    assert daemon.services.asr.pending == 0 and daemon.services.asr.engine.active_requests() == 0
