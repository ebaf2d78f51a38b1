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
def valid_configs(draw) -> pb.SessionConfig:
    """Settings a careful caller would send (any of them), so the calls get somewhere."""
    c = pb.SessionConfig()
    c.input_format.encoding = draw(st.sampled_from([pb.LINEAR16, pb.MULAW, pb.ALAW]))
    c.input_format.sample_rate_hz = draw(st.sampled_from([8000, 16000, 48000]))
    c.segmentation.mode = draw(st.sampled_from([pb.AUTO, pb.PUSH_TO_TALK]))
    hangover = draw(optional(st.integers(100, 1000)))
    if hangover is not None:
        c.segmentation.hangover_ms = hangover
    c.recognition.language = draw(st.sampled_from(["", "en", "English"]))
    c.recognition.interim_results = draw(st.booleans())
    c.agent.name = draw(st.sampled_from(["", "echo", "client"]))
    return c


@st.composite
def wild_configs(draw) -> pb.SessionConfig:
    """Any value in any field: most of these are refused, each with its own message."""
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
    rec.disabled = draw(st.booleans())
    beam = draw(optional(st.integers(-1, 6)))
    if beam is not None:
        rec.beam_size = beam
    c.agent.name = draw(st.sampled_from(["", "echo", "client", "nobody"]))
    c.speech.voice = draw(st.sampled_from(["", "female", "nobody"]))
    for name, values in (("temperature", st.floats(-1, 3) | st.just(float("nan"))), ("top_p", st.floats(0, 1.5)),
                         ("top_k", st.integers(-2, 100))):
        value = draw(optional(values))
        if value is not None:
            setattr(c.speech, name, value)
    barge = draw(optional(st.integers(-5, 6000)))
    if barge is not None:
        c.barge_in.min_speech_ms = barge
    return c


CONTROLS = ["talk_start", "talk_end", "stop_speaking"]


def control(kind: str) -> pb.SessionRequest:
    return pb.SessionRequest(control=pb.Control(**{kind: getattr(pb, kind.title().replace("_", ""))()}))


@st.composite
def sequences(draw, speech: list[bytes]) -> tuple[str, list[pb.SessionRequest]]:
    """A method and what a caller sends on one stream. Three in four callers are careful (valid
    settings, messages in order: their calls get far, through turns, transcripts and replies); the
    rest send anything (wild settings, marks out of order, odd audio, empty or repeated messages).
    The mix is drawn explicitly: hypothesis does not weigh the branches of one_of."""
    method = draw(st.sampled_from(["Converse", "StreamingRecognize"]))
    careful = draw(st.integers(0, 3)) > 0
    if careful:
        first = pb.SessionRequest(config=draw(valid_configs()))
    else:
        first = draw(st.one_of(wild_configs().map(lambda c: pb.SessionRequest(config=c)), st.sampled_from(
            [pb.SessionRequest(), pb.SessionRequest(audio=speech[0]), control("talk_start")])))
    out = [first]
    ptt = first.config.segmentation.mode == pb.PUSH_TO_TALK
    words = st.text(alphabet="abcdefghij klmnop.,!?", min_size=1, max_size=40).filter(lambda t: t.strip(" .,!?"))
    for _ in range(draw(st.integers(0, 8))):
        k = draw(st.integers(0, 9 if careful else 15))
        if k < 3:  # a whole turn, as the session's mode wants it
            turn = [pb.SessionRequest(audio=b) for b in speech]
            out += [control("talk_start"), *turn, control("talk_end")] if ptt else turn
        elif k < 5:
            out.append(pb.SessionRequest(audio=speech[draw(st.integers(0, len(speech) - 1))]))
        elif k < 7:
            b = draw(st.binary(max_size=1500))
            out.append(pb.SessionRequest(audio=b[: len(b) // 2 * 2]))
        elif k < 10:
            if method == "Converse":
                out.append(pb.SessionRequest(control=pb.Control(speak=pb.Speak(text=draw(words)))) if k < 9
                           else control("stop_speaking"))
        elif k < 12:
            out.append(pb.SessionRequest(control=pb.Control(speak=pb.Speak(text=draw(st.text(max_size=40))))))
        elif k < 14:  # a mark, perhaps out of order
            out.append(control(draw(st.sampled_from(["talk_start", "talk_end", "stop_speaking"]))))
        else:  # refused: odd audio, an empty control, a second config, an empty message
            out.append(draw(st.one_of(
                st.binary(min_size=1, max_size=99).filter(lambda b: len(b) % 2).map(lambda b: pb.SessionRequest(audio=b)),
                st.just(pb.SessionRequest(control=pb.Control())),
                wild_configs().map(lambda c: pb.SessionRequest(config=c)),
                st.just(pb.SessionRequest()))))
    return method, out


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

    @given(call_=sequences(speech_bytes))
    def check(call_):
        method, requests = call_
        events, code, details = call(daemon.address, method, requests)
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
