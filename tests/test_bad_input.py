"""The bad-input catalogue (docs/BAD_INPUT.md), every gRPC row of it against one real daemon: the
status and the words of the message the row promises. Then the daemon is unaffected: health SERVING,
a well-formed session on the same daemon works, no session is left open and the asyncio tasks are
back to where they were.

The rows are read from the document, so the document and the test cannot drift: a row without a
case here, or a case without a row there, fails."""

from __future__ import annotations

import asyncio
import io
import re
import struct
import threading
import wave
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc

from tests.daemon_harness import (
    Daemon,
    audio_requests,
    daemon_config,
    of_kind,
    start_daemon,
    stream_blocking,
    wire_audio,
)
from tests.speech import layout, phrase
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.audio.ingest import Format

DOC = Path(__file__).resolve().parent.parent / "docs" / "BAD_INPUT.md"
L16 = Format("LINEAR16", 16000)
L16_PB = pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000)
CODES = {c.name: c for c in grpc.StatusCode}


@dataclass
class Row:
    id: str
    where: str
    what: str
    status: str  # a gRPC status name; "OK" rows may name a notice: "OK, notice AGENT_FAILED"
    words: str  # what the message (or the notice's message) must contain
    covered_by: str = ""  # a door row: the door test that sends it, "tests/FILE.py::test_name"


def catalogue() -> list[Row]:
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) not in (5, 6) or not re.fullmatch(r"[A-Z]+\d+", cells[0]):
            continue
        words = re.search(r"`([^`]*)`", cells[4])
        rows.append(Row(cells[0], cells[1], cells[2], cells[3], words.group(1) if words else "",
                        cells[5] if len(cells) == 6 else ""))
    return rows


ROWS = catalogue()
GRPC_ROWS = [r for r in ROWS if r.id.startswith("G")]


# ---------------------------------------------------------------------------- the daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from tests.spark_fixtures import cached_spark_checkpoint
    from voiced.engines.spark.engine import SparkTTSEngine

    root = tmp_path_factory.mktemp("bad")
    config = daemon_config()
    config.tts.enabled = True
    config.tts.max_seconds = 0.4  # random weights never stop on their own
    config.agent.reply_timeout_s = 0.5
    tts = SparkTTSEngine.load(str(cached_spark_checkpoint(tmp_path_factory)), device="cpu", max_batch=2,
                              voices_dir=root / "voices")
    d = start_daemon(make_openai_checkpoint(root / "whisper", seed=3), config, tts_engine=tts)
    d.services.agents.register("crashing", lambda cfg, prompt: Crashing())
    d.services.agents.register("silent", lambda cfg, prompt: Silent())
    d.baseline_tasks = len(_daemon_tasks(d))  # before any call
    yield d
    d.stop()


class Crashing:
    async def reply(self, text):
        raise RuntimeError("the CRM is down")
        yield  # pragma: no cover


class Silent:
    async def reply(self, text):
        await asyncio.Event().wait()
        yield  # pragma: no cover


def _daemon_tasks(d: Daemon) -> list[str]:
    async def names():
        return [t.get_name() for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    return d.call(names)


# ---------------------------------------------------------------------------- ways to call


Outcome = tuple[grpc.StatusCode, str, object]


def stream(d: Daemon, requests: list, method: str = "StreamingRecognize") -> Outcome:
    events, code, details = stream_blocking(d.address, requests, method)
    return code, details, events


def unary(d: Daemon, method: str, request) -> Outcome:
    with grpc.insecure_channel(d.address) as channel:
        call = getattr(pb_grpc.VoicedStub(channel), method)
        try:
            response = call(request)
            if method == "Synthesize":
                response = list(response)
            return grpc.StatusCode.OK, "", response
        except grpc.RpcError as e:
            return e.code(), e.details(), None


def raw(d: Daemon, method: str, bodies: list[bytes], streaming: bool) -> Outcome:
    """Bytes on the wire as they are: what a client with the wrong protos (or none) sends."""
    with grpc.insecure_channel(d.address) as channel:
        path = f"/voiced.v1.Voiced/{method}"
        try:
            if streaming:
                out = list(channel.stream_stream(path)(iter(bodies)))
            elif method == "Synthesize":
                out = list(channel.unary_stream(path)(bodies[0]))
            else:
                out = channel.unary_unary(path)(bodies[0])
            return grpc.StatusCode.OK, "", out
        except grpc.RpcError as e:
            return e.code(), e.details(), None


def cfg(**kw) -> pb.SessionRequest:
    kw.setdefault("input_format", L16_PB)
    return pb.SessionRequest(config=pb.SessionConfig(**kw))


def ctl(**kw) -> pb.SessionRequest:
    return pb.SessionRequest(control=pb.Control(**kw))


def ptt(**kw) -> pb.SessionRequest:
    return cfg(segmentation=pb.SegmentationConfig(mode=pb.PUSH_TO_TALK), **kw)


SILENCE = np.zeros(320, "<i2").tobytes()


def speech_requests(config: pb.SessionRequest) -> list:
    data = wire_audio(layout(["Where is my parcel?"], lead_s=0.3, tail_s=0.8).audio, L16)
    return [config] + audio_requests(config.config, data, L16)[1:]


def wav(rate=16000, channels=1, bits=16, tag=1, block_align=None, frames: bytes | None = None,
        data_size: int | None = None) -> bytes:
    """A WAV file whose header says what it is told to, whatever the data is."""
    frames = frames if frames is not None else np.zeros(1600, "<i2").tobytes()
    block_align = block_align if block_align is not None else channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, (rate * block_align) & 0xFFFFFFFF, block_align, bits)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(frames) if data_size is None else data_size) + frames
    return b"RIFF" + struct.pack("<I", len(body)) + body


def speech_wav(seconds: float | None = None) -> bytes:
    audio = phrase("Hello, this is my voice, recorded for the assistant to speak with.")
    if seconds is not None:
        audio = audio[: int(seconds * 16000)]
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def with_server(key: str, value, fn: Callable[[], Outcome]) -> Callable[[Daemon], Outcome]:
    """Run a case with one server limit changed (each session reads its limits when it starts)."""

    def run(d: Daemon) -> Outcome:
        limits = d.services.config.server
        old = getattr(limits, key)
        setattr(limits, key, value)
        try:
            return fn(d)
        finally:
            setattr(limits, key, old)

    return run


def holding(d: Daemon, first: list, method: str = "StreamingRecognize") -> Outcome:
    """Send `first`, then keep the stream open and send nothing more."""
    hold = threading.Event()

    def requests():
        yield from first
        hold.wait(120)

    try:
        return stream(d, requests(), method)
    finally:
        hold.set()


def streaming_forever(d: Daemon) -> Outcome:
    """A caller that keeps sending silence (a phone line) until the server ends the call."""
    stop = threading.Event()

    def requests():
        yield cfg()
        while not stop.wait(0.02):
            yield pb.SessionRequest(audio=SILENCE)

    try:
        return stream(d, requests())
    finally:
        stop.set()


def slow_reader(d: Daemon) -> Outcome:
    """Floods push-to-talk marks (two events each) and reads nothing until the server has given up on
    it; meanwhile another caller is served normally. A small receive window (1 KiB, no window
    growth) makes the caller's socket fill after a few dozen events."""
    errors_before = _count(d, "RESOURCE_EXHAUSTED")
    options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    requests = [ptt(recognition=pb.RecognitionConfig(disabled=True))]
    for _ in range(3000):
        requests += [ctl(talk_start=pb.TalkStart()), ctl(talk_end=pb.TalkEnd())]
    with grpc.insecure_channel(d.address, options=options) as channel:
        call = pb_grpc.VoicedStub(channel).StreamingRecognize(iter(requests))
        other = stream(d, speech_requests(cfg()))  # another caller meanwhile
        assert other[0] == grpc.StatusCode.OK and of_kind(other[2], "transcript"), other[1]
        for _ in range(1200):  # the server ends the call on its own, while nothing is read
            if _count(d, "RESOURCE_EXHAUSTED") > errors_before:
                break
            threading.Event().wait(0.05)
        events = []
        try:
            events.extend(call)
            return grpc.StatusCode.OK, "", events
        except grpc.RpcError as e:
            return e.code(), e.details(), events


def _count(d: Daemon, code: str) -> float:
    return d.services.metrics.registry.get_sample_value("voiced_errors_total", {"front": "grpc", "code": code}) or 0


GARBAGE = b"\xff\xff\xff\xff"


CASES: dict[str, Callable[[Daemon], Outcome]] = {
    # the stream's messages, and their order
    "G1": lambda d: stream(d, [pb.SessionRequest(audio=SILENCE)]),
    "G2": lambda d: stream(d, [pb.SessionRequest()]),
    "G3": lambda d: stream(d, [cfg(), cfg()]),
    "G4": lambda d: stream(d, [cfg(), pb.SessionRequest()]),
    "G5": lambda d: stream(d, [cfg(), ctl()]),
    "G6": lambda d: stream(d, [cfg(), ctl(talk_start=pb.TalkStart())]),
    "G7": lambda d: stream(d, [ptt(), ctl(talk_end=pb.TalkEnd())]),
    "G8": lambda d: stream(d, [ptt(), ctl(talk_start=pb.TalkStart()), ctl(talk_start=pb.TalkStart())]),
    "G9": lambda d: stream(d, [cfg(), ctl(speak=pb.Speak(text="Hello."))]),
    "G10": lambda d: stream(d, [cfg(), ctl(stop_speaking=pb.StopSpeaking())]),
    # every config field out of range
    "G11": lambda d: stream(d, [pb.SessionRequest(config=pb.SessionConfig())]),
    "G12": lambda d: stream(d, [cfg(input_format=pb.AudioFormat(sample_rate_hz=16000))]),
    "G13": lambda d: stream(d, [cfg(input_format=pb.AudioFormat(encoding=7, sample_rate_hz=16000))]),
    "G14": lambda d: stream(d, [cfg(input_format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=0))]),
    "G15": lambda d: stream(d, [cfg(input_format=pb.AudioFormat(encoding=pb.MULAW, sample_rate_hz=96000))]),
    "G16": lambda d: stream(d, [cfg(output_format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=4000))],
                            "Converse"),
    "G17": lambda d: stream(d, [cfg(segmentation=pb.SegmentationConfig(mode=9))]),
    "G18": lambda d: stream(d, [cfg(segmentation=pb.SegmentationConfig(vad_aggressiveness=5))]),
    "G19": lambda d: stream(d, [cfg(segmentation=pb.SegmentationConfig(pre_roll_ms=5000))]),
    "G20": lambda d: stream(d, [cfg(segmentation=pb.SegmentationConfig(hangover_ms=0))]),
    "G21": lambda d: stream(d, [cfg(segmentation=pb.SegmentationConfig(min_speech_ms=9000))]),
    "G22": lambda d: stream(d, [cfg(segmentation=pb.SegmentationConfig(max_utterance_ms=60000))]),
    "G23": lambda d: stream(d, [cfg(recognition=pb.RecognitionConfig(beam_size=9))]),
    "G24": lambda d: stream(d, [cfg(recognition=pb.RecognitionConfig(task=7))]),
    "G25": lambda d: stream(d, [cfg(recognition=pb.RecognitionConfig(language="klingon"))]),
    "G26": lambda d: stream(d, [cfg(recognition=pb.RecognitionConfig(initial_prompt="word " * 600))]),
    "G27": lambda d: stream(d, [cfg(recognition=pb.RecognitionConfig(no_speech_threshold=float("nan")))]),
    "G28": lambda d: stream(d, [cfg(recognition=pb.RecognitionConfig(disabled=True))], "Converse"),
    "G29": lambda d: stream(d, [cfg(agent=pb.AgentConfig(name="nobody"))], "Converse"),
    "G30": lambda d: stream(d, [cfg(barge_in=pb.BargeInConfig(min_speech_ms=1))], "Converse"),
    "G31": lambda d: stream(d, [cfg(speech=pb.SpeechConfig(temperature=5))], "Converse"),
    "G32": lambda d: stream(d, [cfg(speech=pb.SpeechConfig(top_p=0))], "Converse"),
    "G33": lambda d: stream(d, [cfg(speech=pb.SpeechConfig(top_k=-1))], "Converse"),
    "G34": lambda d: stream(d, [cfg(speech=pb.SpeechConfig(max_seconds=-1))], "Converse"),
    "G35": lambda d: stream(d, [cfg(speech=pb.SpeechConfig(voice="nobody"))], "Converse"),
    # audio
    "G36": lambda d: stream(d, [cfg(), pb.SessionRequest(audio=b"\0" * 321)]),
    "G37": lambda d: stream(d, [cfg(), pb.SessionRequest(audio=b"\0" * (2 * 1024 * 1024))]),
    # text to speak
    "G38": lambda d: stream(d, [cfg(), ctl(speak=pb.Speak(text=" \t "))], "Converse"),
    "G39": lambda d: stream(d, [cfg(), ctl(speak=pb.Speak(text="word " * 20000))], "Converse"),
    "G40": lambda d: stream(d, [cfg(), ctl(speak=pb.Speak(text="😀🎉👍🔥"))], "Converse"),
    "G41": lambda d: stream(d, [cfg(), ctl(speak=pb.Speak(text="\x00\x07\x1b\x7f\u200b\r\n"))], "Converse"),
    # limits
    "G42": with_server("idle_timeout_s", 0.3, lambda d: holding(d, [])),
    "G43": with_server("idle_timeout_s", 0.3, lambda d: holding(d, [cfg()])),
    "G44": with_server("max_session_s", 0.5, streaming_forever),
    "G45": with_server("max_outbound_bytes", 65536, slow_reader),
    # agents
    "G46": lambda d: stream(d, speech_requests(cfg(agent=pb.AgentConfig(name="crashing"))), "Converse"),
    "G47": lambda d: stream(d, speech_requests(cfg(agent=pb.AgentConfig(name="silent"))), "Converse"),
    # Recognize: headers that lie, and clips
    "G48": lambda d: unary(d, "Recognize", pb.RecognizeRequest(audio=wav(rate=0))),
    "G49": lambda d: unary(d, "Recognize", pb.RecognizeRequest(audio=wav(channels=0, block_align=2))),
    "G50": lambda d: unary(d, "Recognize", pb.RecognizeRequest(audio=wav(
        frames=(phrase("Good morning.") * 32767).astype("<i2").tobytes(), data_size=10_000_000))),
    "G51": lambda d: unary(d, "Recognize", pb.RecognizeRequest(audio=wav(tag=0x55, bits=0, block_align=1))),
    "G52": lambda d: unary(d, "Recognize", pb.RecognizeRequest(audio=wav(block_align=1))),
    "G53": lambda d: unary(d, "Recognize", pb.RecognizeRequest(audio=wav()[:36])),
    "G54": lambda d: unary(d, "Recognize", pb.RecognizeRequest(audio=SILENCE * 10)),
    "G55": lambda d: unary(d, "Recognize", pb.RecognizeRequest()),
    "G56": lambda d: unary(d, "Recognize", pb.RecognizeRequest(audio=wav(rate=1000, bits=8, tag=7,
                                                                           frames=b"\xff" * 700_000))),
    "G57": lambda d: unary(d, "Recognize", pb.RecognizeRequest(audio=wav(rate=1_000_000_000))),
    "G58": lambda d: unary(d, "Recognize", pb.RecognizeRequest(audio=wav(),
                                                               recognition=pb.RecognitionConfig(disabled=True))),
    # Synthesize
    "G59": lambda d: unary(d, "Synthesize", pb.SynthesizeRequest(text="")),
    "G60": lambda d: unary(d, "Synthesize", pb.SynthesizeRequest(text="word " * 20000)),
    "G61": lambda d: unary(d, "Synthesize", pb.SynthesizeRequest(text="🙂🙂🙂")),
    "G62": lambda d: unary(d, "Synthesize", pb.SynthesizeRequest(text="\x01\x02\x03")),
    "G63": lambda d: unary(d, "Synthesize", pb.SynthesizeRequest(text="Hello.", speech=pb.SpeechConfig(voice="nobody"))),
    "G64": lambda d: unary(d, "Synthesize", pb.SynthesizeRequest(
        text="Hello.", output_format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=100))),
    # AddVoice
    "G65": lambda d: unary(d, "AddVoice", pb.AddVoiceRequest(name="short", transcript="Hello.",
                                                             audio=speech_wav(0.1))),
    "G66": lambda d: unary(d, "AddVoice", pb.AddVoiceRequest(name="quiet", transcript="Hello.",
                                                             audio=wav(frames=np.zeros(48000, "<i2").tobytes()))),
    "G67": lambda d: unary(d, "AddVoice", pb.AddVoiceRequest(name="hiss", transcript="Hello.", audio=wav(
        frames=(np.random.default_rng(0).normal(0, 0.3, 48000).clip(-1, 1) * 32767).astype("<i2").tobytes()))),
    "G68": lambda d: unary(d, "AddVoice", pb.AddVoiceRequest(name="", transcript="Hello.", audio=speech_wav())),
    "G69": lambda d: unary(d, "AddVoice", pb.AddVoiceRequest(name="../etc/passwd", transcript="Hello.",
                                                             audio=speech_wav())),
    "G70": lambda d: unary(d, "AddVoice", pb.AddVoiceRequest(name="female", transcript="Hello.", audio=speech_wav())),
    "G71": lambda d: unary(d, "AddVoice", pb.AddVoiceRequest(name="mine", transcript=" ", audio=speech_wav())),
    # bytes that are not protobuf
    "G72": lambda d: raw(d, "Recognize", [GARBAGE], streaming=False),
    "G73": lambda d: raw(d, "Converse", [GARBAGE], streaming=True),
    "G74": lambda d: raw(d, "StreamingRecognize", [cfg().SerializeToString(), GARBAGE], streaming=True),
    "G75": lambda d: raw(d, "Synthesize", [GARBAGE], streaming=False),
    "G76": lambda d: raw(d, "AddVoice", [GARBAGE], streaming=False),
    # typed user text
    "G77": lambda d: stream(d, [cfg(), pb.SessionRequest(text="What time is it?")]),
    "G78": lambda d: stream(d, [cfg(), pb.SessionRequest(text=" \t ")], "Converse"),
    "G79": lambda d: stream(d, [cfg(), pb.SessionRequest(text="word " * 20000)], "Converse"),
    # caller-supplied ids
    "G80": lambda d: stream(d, [cfg(session_id="s" * 300_000)]),
}


def test_the_catalogue_has_enough_rows_and_every_grpc_row_a_case():
    assert len(ROWS) >= 25 and len({r.id for r in ROWS}) == len(ROWS)
    assert {r.id for r in GRPC_ROWS} == set(CASES)
    door_rows = [r for r in ROWS if not r.id.startswith("G")]
    doors = {r.where.split()[0] for r in door_rows}
    assert {"AudioSocket", "Wyoming", "media-ws", "HTTP", "Realtime"} <= doors


@pytest.mark.parametrize("row", [r for r in ROWS if not r.id.startswith("G")], ids=lambda r: r.id)
def test_each_door_row_names_the_door_test_that_sends_it(row):
    """The doors' rows are tested by the doors' own suites (a live door each): the row must name a
    test that exists, so a renamed or deleted test leaves no row pointing at nothing."""
    path, sep, name = row.covered_by.partition("::")
    assert sep and path.startswith("tests/"), f"{row.id}: the last column must be tests/FILE.py::test_name"
    source = DOC.parent.parent / path
    assert source.is_file(), f"{row.id}: {path} does not exist"
    assert re.search(rf"^(async )?def {re.escape(name)}\(", source.read_text(), re.M), \
        f"{row.id}: {path} has no test {name}"


@pytest.mark.parametrize("row", GRPC_ROWS, ids=[r.id for r in GRPC_ROWS])
def test_each_bad_input_gets_its_status_and_says_what_to_fix(daemon, row):
    code, details, result = CASES[row.id](daemon)
    status, _, notice = row.status.partition(", notice ")
    assert code == CODES[status], f"{row.id} {row.what}: got {code.name}: {details}"
    if notice:
        notices = [e.notice for e in of_kind(result, "notice") if e.notice.code == notice]
        assert notices and row.words in notices[0].message, (row.id, [e.notice for e in of_kind(result, "notice")])
    elif status != "OK":
        assert row.words and row.words in details, f"{row.id}: {details!r} lacks {row.words!r}"
        assert "Traceback" not in details and "Exception" not in details


def test_the_daemon_is_unaffected_after_the_whole_catalogue(daemon):
    d = daemon
    with grpc.insecure_channel(d.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    code, details, events = stream(d, speech_requests(cfg()))
    assert code == grpc.StatusCode.OK, details
    assert [e.transcript.is_final for e in of_kind(events, "transcript")] == [True]
    for _ in range(400):  # calls finish on the server a moment after their callers see the status
        if d.services.active_sessions == 0 and len(_daemon_tasks(d)) <= d.baseline_tasks:
            break
        threading.Event().wait(0.05)
    assert d.services.active_sessions == 0
    assert len(_daemon_tasks(d)) <= d.baseline_tasks, _daemon_tasks(d)
    assert d.services.asr.pending == 0 and d.services.tts.pending == 0
    assert d.services.asr.engine.active_requests() == 0 and d.services.tts.engine.active_requests() == 0


def test_a_wav_header_fuzzer_only_ever_gets_a_result_or_invalid_argument():
    """Random RIFF headers (every field of the format chunk, lying sizes, odd chunk orders) through the
    daemon's clip decoder: a clip, or BAD_INPUT with a message; never another exception."""
    from hypothesis import given
    from hypothesis import strategies as st

    from voiced.core.errors import ErrorKind, SessionError
    from voiced.core.speech import decode_clip

    u16, u32 = st.integers(0, 0xFFFF), st.integers(0, 0xFFFFFFFF)

    @given(tag=st.sampled_from([0, 1, 2, 3, 6, 7, 0x55, 0xFFFE]) | u16,
           channels=st.integers(0, 9) | u16, rate=st.sampled_from([0, 1, 8000, 44100]) | u32,
           block_align=st.integers(0, 16) | u16, bits=st.sampled_from([0, 4, 8, 12, 16, 24, 32, 64]) | u16,
           frames=st.binary(max_size=4096), data_size=st.none() | u32, cut=st.none() | st.integers(0, 80))
    def check(tag, channels, rate, block_align, bits, frames, data_size, cut):
        data = wav(rate=rate, channels=channels, bits=bits, tag=tag, block_align=block_align, frames=frames,
                   data_size=data_size)
        if cut is not None:
            data = data[:cut]
        try:
            pcm, duration = decode_clip(data, None)
        except SessionError as e:
            assert e.kind is ErrorKind.BAD_INPUT and e.message
            return
        assert pcm.dtype == np.int16 and len(pcm) > 0 and duration > 0

    check()
