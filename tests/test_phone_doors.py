"""The telephony doors end to end: Asterisk AudioSocket and the media-stream WebSocket (Twilio's format).

A real daemon (tiny random Whisper and Spark-TTS checkpoints in their published formats, on the CPU)
with both doors open. The AudioSocket caller below is written from Asterisk's protocol text
(docs.asterisk.org, Channel Drivers / AudioSocket) and shares no code with the door; the media-stream
caller is the `websockets` library sending Twilio's documented JSON messages.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
import time
import uuid

import numpy as np
import pytest
import websockets
from websockets.asyncio.client import connect as ws_connect

from tests.daemon_harness import (
    audio_requests,
    collector_off,
    daemon_config,
    session_config,
    socket_timeout,
    start_daemon,
    stream_blocking,
    wire_audio,
)
from tests.spark_fixtures import make_spark_checkpoint
from tests.speech import RATE, layout
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.audio.ingest import Format
from voiced.core.agents import EndCall

SLIN = Format("LINEAR16", 8000)
MULAW = Format("MULAW", 8000)
REPLY_S = 1.0  # every reply's length: random LMs speak until the cap
FRAME_S = 0.02

# ----------------------------------------------------------------------------- the agent under test


class Book:
    """What the calls' agents were given (appended on the daemon's thread, read by the tests)."""

    def __init__(self):
        self.heard: list[str] = []
        self.keys: list[str] = []
        self.answers = 1_000_000  # how many transcripts get an answer


BOOK = Book()


class IvrAgent:
    """An IVR menu as an agent plug-in: echoes what it hears, answers keys, hangs up on #."""

    def __init__(self, book: Book):
        self.book = book

    async def reply(self, text):
        self.book.heard.append(text)
        if len(self.book.heard) <= self.book.answers:
            yield text

    async def on_dtmf(self, digit):
        self.book.keys.append(digit)
        if digit == "#":
            yield "Goodbye."
            yield EndCall("the caller pressed #")
        else:
            yield f"You pressed {digit}."


@pytest.fixture()
def book():
    BOOK.__init__()
    return BOOK


async def until(predicate, timeout: float = 120.0, every: float = 0.02, tick=None):
    """Wait for a condition the daemon's thread makes true (`tick` runs meanwhile: a caller's audio)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {predicate}")
        if tick is not None:
            await tick()
        await asyncio.sleep(every)


# ----------------------------------------------------------------------------- the daemon


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_openai_checkpoint(root / "whisper", seed=3), make_spark_checkpoint(root / "Spark-TTS-0.5B", seed=0)


def phone_config(tts: bool = True):
    config = daemon_config()
    config.tts.enabled = tts
    config.tts.first_chunk_tokens = 5
    config.tts.chunk_tokens = 10
    config.tts.max_seconds = REPLY_S
    config.doors.audiosocket = "127.0.0.1:0"
    config.doors.media_ws = "127.0.0.1:0"
    config.audiosocket.agent = "ivr"
    config.media_ws.agent = "ivr"
    return config


def start_phone_daemon(models, voices_dir, tts: bool = True):
    whisper, spark = models
    engine = None
    if tts:
        from voiced.engines.spark.engine import SparkTTSEngine

        engine = SparkTTSEngine.load(str(spark), device="cpu", max_batch=4, voices_dir=voices_dir)
    return start_daemon(whisper, phone_config(tts), tts_engine=engine,
                        agents={"ivr": lambda config, prompt: IvrAgent(BOOK)})


@pytest.fixture(scope="module")
def daemon(models, tmp_path_factory):
    d = start_phone_daemon(models, tmp_path_factory.mktemp("voices"))
    yield d
    d.stop()


@pytest.fixture()
def reply_seconds(daemon):
    """Replies of another length for one test (the spec reads the cap when a call starts)."""
    tts = daemon.services.config.tts

    def set_to(seconds: float):
        tts.max_seconds = seconds

    yield set_to
    tts.max_seconds = REPLY_S


def idle(daemon) -> bool:
    s = daemon.services
    return s.active_sessions == 0 and (s.tts is None or (s.tts.engine.active_requests() == 0 and s.tts.pending == 0))


def transcripts_over_grpc(daemon, audio16k: np.ndarray, fmt: Format) -> list[str]:
    """What the same audio gives through StreamingRecognize: the text an agent must be handed."""
    data = wire_audio(np.concatenate([audio16k, np.zeros(RATE, np.float32)]), fmt)
    events, _, details = stream_blocking(daemon.address, audio_requests(session_config(fmt), data, fmt))
    return [e.transcript.text for e in events if e.WhichOneof("event") == "transcript" and e.transcript.is_final]


QUESTION = ["Hello, I would like to book a table for two."]
INTERRUPTION = ["No wait, stop, I meant on Sunday."]

# ----------------------------------------------------------------------------- an Asterisk stand-in


class AsteriskCall:
    """Asterisk's side of an AudioSocket connection, written from the protocol text: a 3-byte header
    (type, big-endian payload length), then the payload. 0x01 UUID (16 bytes), 0x10 slin 8 kHz
    little-endian, 0x03 DTMF (one ASCII digit), 0x00 hangup, 0xff error."""

    live: set[AsteriskCall] = set()  # calls not closed yet (`hang_up_leftovers` ends them after a test)

    def __init__(self, reader, writer, kind: int = 0x10, rate: int = 8000):
        self.reader, self.writer = reader, writer
        self.kind, self.rate = kind, rate  # 0x10 slin 8 kHz; the channel driver's 0x11..0x18 up to 192 kHz
        self.frame_bytes = rate // 50 * 2
        self.messages: list[tuple[float, int, bytes]] = []  # (arrival time, type, payload)
        self.closed = asyncio.Event()
        self._task = asyncio.create_task(self._read())
        AsteriskCall.live.add(self)

    @classmethod
    async def dial(cls, address: str, call_uuid: uuid.UUID | None = None, send_uuid: bool = True,
                   kind: int = 0x10, rate: int = 8000):
        host, port = address.rsplit(":", 1)
        reader, writer = await asyncio.open_connection(host, int(port))
        call = cls(reader, writer, kind, rate)
        if send_uuid:
            call.send(0x01, (call_uuid or uuid.uuid4()).bytes)
        return call

    def send(self, kind: int, payload: bytes = b"") -> None:
        self.writer.write(struct.pack(">BH", kind, len(payload)) + payload)

    async def say(self, pcm: bytes, realtime: bool = False) -> None:
        t0 = time.monotonic()
        for i, k in enumerate(range(0, len(pcm), self.frame_bytes)):
            self.send(self.kind, pcm[k : k + self.frame_bytes])
            await self.writer.drain()
            if realtime:
                await asyncio.sleep(max(0.0, t0 + (i + 1) * FRAME_S - time.monotonic()))

    async def silence(self) -> None:
        """One 20 ms frame of silence (Asterisk sends audio all through a call)."""
        if not self.writer.is_closing():
            self.send(self.kind, bytes(self.frame_bytes))
            await self.writer.drain()

    async def talk_until(self, predicate, timeout: float = 120.0) -> None:
        await until(predicate, timeout, every=FRAME_S, tick=self.silence)

    def hang_up(self) -> None:
        self.send(0x00)

    async def _read(self) -> None:
        try:
            while True:
                kind, length = struct.unpack(">BH", await self.reader.readexactly(3))
                payload = await self.reader.readexactly(length)
                self.messages.append((time.monotonic(), kind, payload))
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed.set()

    def audio(self) -> list[tuple[float, bytes]]:
        return [(t, p) for t, k, p in self.messages if k == self.kind]

    def audio_s(self) -> float:
        return sum(len(p) for _, p in self.audio()) / 2 / self.rate

    async def close(self) -> None:
        AsteriskCall.live.discard(self)
        self.writer.close()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


@pytest.fixture(autouse=True)
async def hang_up_leftovers():
    """A test that fails midway leaves its calls open, and the daemon serving them: hang them up, so the
    failure stays that test's and the next one does not wait for a daemon that never goes idle."""
    yield
    for call in list(AsteriskCall.live):
        if not call.writer.is_closing():
            call.hang_up()
        await call.close()


def slin(audio16k: np.ndarray) -> bytes:
    return wire_audio(audio16k, SLIN)


# ----------------------------------------------------------------------------- AudioSocket


async def test_audiosocket_speech_reaches_the_agent_and_the_reply_comes_back_paced(daemon, book, reply_seconds):
    reply_seconds(3.0)  # a reply the tiny TTS writes far faster than it plays
    speech = layout(QUESTION, tail_s=0.0).audio
    expected = transcripts_over_grpc(daemon, speech, SLIN)
    assert expected and expected[0].strip()
    call = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
    await call.say(slin(speech))  # as fast as the socket takes it
    said = time.monotonic()  # the reply cannot start before the question has been sent
    await call.talk_until(lambda: call.audio_s() >= 3.0)
    call.hang_up()
    await call.closed.wait()
    await call.close()

    assert book.heard == expected
    frames = call.audio()
    assert [len(p) for _, p in frames] == [320] * 150  # 3 s in 20 ms frames of slin 8 kHz, type 0x10
    # Paced: frame k cannot leave before k * 20 ms after the first, which cannot leave before the
    # question was sent. (Load only delays frames, so this bound cannot fail from a slow machine; a
    # burst would break it, as the whole reply is written in well under its 3 s.)
    assert frames[-1][0] - said >= 149 * FRAME_S
    gaps = np.diff([t for t, _ in frames]) * 1000
    logging.getLogger(__name__).info("AudioSocket reply pacing: gaps p50 %.1f ms, p99 %.1f ms, span %.2f s",
                                     np.percentile(gaps, 50), np.percentile(gaps, 99), frames[-1][0] - frames[0][0])
    await until(lambda: idle(daemon))


@pytest.mark.parametrize("kind, rate", [(0x12, 16000), (0x17, 96000)])
async def test_audiosocket_channel_driver_rates_are_answered_in_the_call_s_own_type(daemon, book, kind, rate):
    call = await AsteriskCall.dial(daemon.services.doors["audiosocket"], kind=kind, rate=rate)
    await call.say(wire_audio(layout(QUESTION, tail_s=0.0).audio, Format("LINEAR16", rate)))
    await call.talk_until(lambda: call.audio_s() >= REPLY_S)
    call.hang_up()
    await call.closed.wait()
    await call.close()
    assert len(book.heard) == 1 and book.heard[0].strip()
    assert {k for _, k, _ in call.messages} == {kind}
    assert [len(p) for _, p in call.audio()] == [rate // 50 * 2] * int(REPLY_S / FRAME_S)  # 20 ms frames
    await until(lambda: idle(daemon))


async def test_audiosocket_greeting_is_spoken_when_the_call_starts(daemon, book):
    settings = daemon.services.config.audiosocket
    settings.greeting = "Welcome to the shop."
    try:
        call = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
        await call.talk_until(lambda: call.audio_s() >= REPLY_S)
        call.hang_up()
        await call.closed.wait()
        await call.close()
    finally:
        settings.greeting = ""
    assert book.heard == []  # the caller said nothing: the greeting came first, unasked
    assert call.audio_s() == REPLY_S


async def test_audiosocket_barge_in_stops_the_reply(daemon, book, reply_seconds, caplog):
    reply_seconds(8.0)
    book.answers = 1  # the interruption is heard but not answered: every frame that came is the first reply's
    call = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
    await call.say(slin(layout(QUESTION, tail_s=0.0).audio))
    await call.talk_until(lambda: call.audio_s() >= 0.2)
    with caplog.at_level(logging.INFO, logger="voiced.doors.audiosocket"):
        await call.say(slin(layout(INTERRUPTION, lead_s=0.0, tail_s=0.0).audio), realtime=True)
        await call.talk_until(lambda: len(book.heard) == 2)
        call.hang_up()
        await call.closed.wait()
    await call.close()
    assert call.audio_s() < 8.0 - 1.0  # cut short, not played to its end
    assert any("barge-in: reply 1 cut" in r.getMessage() for r in caplog.records)
    await until(lambda: idle(daemon))


async def test_audiosocket_dtmf_reaches_the_agent_and_the_agent_hangs_up_after_its_goodbye(daemon, book):
    call = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
    await call.silence()
    call.send(0x03, b"5")
    await call.talk_until(lambda: call.audio_s() >= REPLY_S)  # "You pressed 5." played in full
    call.send(0x03, b"#")
    await call.talk_until(lambda: call.closed.is_set())
    await call.close()
    assert book.keys == ["5", "#"]
    kinds = [k for _, k, _ in call.messages]
    # Both replies in full, then the hangup message, then the socket closed.
    assert kinds == [0x10] * int(2 * REPLY_S / FRAME_S) + [0x00]
    await until(lambda: idle(daemon))


@pytest.mark.parametrize("how", ["hangup message", "socket closed"])
async def test_audiosocket_caller_hangup_ends_the_session_and_its_engine_work(daemon, book, reply_seconds, how):
    reply_seconds(8.0)
    call = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
    await call.say(slin(layout(QUESTION, tail_s=0.0).audio))
    await call.talk_until(lambda: call.audio_s() >= 0.1)  # the reply is playing and still being written
    if how == "hangup message":
        call.hang_up()
        await call.closed.wait()  # the daemon closes its end
    await call.close()
    await until(lambda: idle(daemon))  # the session is gone and its TTS request cancelled


MALFORMED = [
    ("unknown type", lambda u: _msg(0x01, u) + _msg(0x42, b"xx"), "unknown message type 0x42"),
    ("UUID of 15 bytes", lambda u: _msg(0x01, u[:15]), "UUID message of 15 bytes"),
    ("audio over the limit", lambda u: _msg(0x01, u) + struct.pack(">BH", 0x10, 20000), "over the limit of 16000"),
    ("audio before the UUID", lambda u: _msg(0x10, bytes(320)), "before the call's UUID"),
    ("odd-length audio", lambda u: _msg(0x01, u) + _msg(0x10, bytes(321)), "even number of bytes"),
    ("a second UUID", lambda u: _msg(0x01, u) + _msg(0x10, bytes(320)) + _msg(0x01, u), "a second UUID"),
    ("DTMF that is no digit", lambda u: _msg(0x01, u) + _msg(0x10, bytes(320)) + _msg(0x03, b"x"), "not a digit"),
    ("closed inside a message", lambda u: _msg(0x01, u) + _msg(0x10, bytes(320))[:100], "closed inside"),
]


def _msg(kind: int, payload: bytes) -> bytes:
    return struct.pack(">BH", kind, len(payload)) + payload


async def test_audiosocket_malformed_messages_end_only_their_own_call(daemon, book, caplog):
    live = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
    await live.silence()
    host, port = daemon.services.doors["audiosocket"].rsplit(":", 1)
    with caplog.at_level(logging.WARNING, logger="voiced.doors.audiosocket"):
        for name, data, fault in MALFORMED:
            call_uuid = uuid.uuid4()
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(data(call_uuid.bytes))
            writer.write_eof()  # nothing more from this caller
            answer = await asyncio.wait_for(reader.read(), 60)  # until the daemon closes the socket
            writer.close()
            assert answer == _msg(0xFF, b"bad_input"), name
            line = next(r.getMessage() for r in caplog.records if fault in r.getMessage())
            assert "malformed message" in line
            if name not in ("UUID of 15 bytes", "audio before the UUID"):
                assert str(call_uuid) in line  # the call is named by its UUID
            await live.silence()
    # The live call noticed nothing: it is still heard and answered.
    await live.say(slin(layout(QUESTION, tail_s=0.0).audio))
    await live.talk_until(lambda: live.audio_s() >= REPLY_S)
    assert len(book.heard) == 1
    live.hang_up()
    await live.closed.wait()
    await live.close()
    await until(lambda: idle(daemon))


async def test_audiosocket_a_socket_fault_ends_the_call_as_a_lost_connection(daemon, book, caplog):
    """A fault of the call's socket that is not a reset (here the kernel's keepalive timeout, ETIMEDOUT, on a
    read) ends that call as a lost connection: logged as one, no internal error sent to Asterisk or logged
    with a traceback, the session and its work gone; the next call is served."""
    import contextlib

    from voiced.doors import audiosocket_frames as wire

    with socket_timeout(wire, "read_message", on_call=5) as reads, \
            caplog.at_level(logging.INFO, logger="voiced.doors.audiosocket"):
        call = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
        with contextlib.suppress(ConnectionError):  # (the daemon may close before the last frames)
            for _ in range(8):
                await call.silence()
        await asyncio.wait_for(call.closed.wait(), 60)  # the daemon closed its end
        await call.close()
    assert reads["n"] == 5
    assert not [k for _, k, _ in call.messages if k == 0xFF], call.messages  # no error message
    assert any("connection lost" in r.getMessage() and "TimeoutError" in r.getMessage() for r in caplog.records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    await until(lambda: idle(daemon))
    after = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
    await after.say(slin(layout(QUESTION, tail_s=0.0).audio))
    await after.talk_until(lambda: after.audio_s() >= REPLY_S)
    after.hang_up()
    await after.closed.wait()
    await after.close()
    await until(lambda: idle(daemon))


async def test_audiosocket_refuses_a_call_over_the_limit_with_an_error_message(daemon, book):
    first = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
    await first.talk_until(lambda: daemon.services.active_sessions == 1)
    limit = daemon.services.config.server.max_sessions
    daemon.services.config.server.max_sessions = 1
    try:
        refused = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
        await refused.silence()
        await asyncio.wait_for(refused.closed.wait(), 60)
    finally:
        daemon.services.config.server.max_sessions = limit
    assert [(k, p) for _, k, p in refused.messages] == [(0xFF, b"over_capacity")]
    await refused.close()
    first.hang_up()
    await first.closed.wait()
    await first.close()
    await until(lambda: idle(daemon))


# ----------------------------------------------------------------------------- media stream (Twilio's format)


class TwilioStream:
    """The far end of a bidirectional Media Stream, sending Twilio's documented messages."""

    def __init__(self, ws, stream_sid: str):
        self.ws = ws
        self.stream_sid = stream_sid
        self.received: list[tuple[float, dict]] = []
        self.answer_marks = True  # as Twilio does once the audio before a mark has played
        self.sequence = 0
        self._task = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str, call_sid: str | None = None, token: str | None = None, headers=None,
                   start: bool = True):
        ws = await ws_connect(url, additional_headers=headers)
        stream = cls(ws, "MZ" + uuid.uuid4().hex)
        stream.call_sid = call_sid or "CA" + uuid.uuid4().hex
        await stream.send({"event": "connected", "protocol": "Call", "version": "1.0.0"})
        if start:
            params = {"token": token} if token is not None else {}
            await stream.send({"event": "start", "sequenceNumber": "1", "streamSid": stream.stream_sid, "start": {
                "accountSid": "AC" + "0" * 32, "streamSid": stream.stream_sid, "callSid": stream.call_sid,
                "tracks": ["inbound"], "customParameters": params,
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})
        return stream

    async def send(self, message: dict) -> None:
        self.sequence += 1
        await self.ws.send(json.dumps(message))

    async def say(self, mulaw: bytes, realtime: bool = False) -> None:
        t0 = time.monotonic()
        for i, k in enumerate(range(0, len(mulaw), 160)):
            await self.send({"event": "media", "sequenceNumber": str(self.sequence + 1), "streamSid": self.stream_sid,
                             "media": {"track": "inbound", "chunk": str(i + 1), "timestamp": str(20 * i),
                                       "payload": base64.b64encode(mulaw[k : k + 160]).decode()}})
            if realtime:
                await asyncio.sleep(max(0.0, t0 + (i + 1) * FRAME_S - time.monotonic()))

    async def silence(self) -> None:
        if self.ws.close_code is None:
            await self.say(b"\xff" * 160)

    async def talk_until(self, predicate, timeout: float = 120.0) -> None:
        await until(predicate, timeout, every=FRAME_S, tick=self.silence)

    async def _read(self) -> None:
        try:
            async for text in self.ws:
                msg = json.loads(text)
                self.received.append((time.monotonic(), msg))
                if msg["event"] == "mark" and self.answer_marks:
                    await self.ws.send(json.dumps({"event": "mark", "streamSid": self.stream_sid,
                                                   "sequenceNumber": str(self.sequence + 1), "mark": msg["mark"]}))
        except websockets.ConnectionClosed:
            pass

    def events(self) -> list[str]:
        return [m["event"] for _, m in self.received]

    def audio_s(self) -> float:
        return sum(len(base64.b64decode(m["media"]["payload"])) for _, m in self.received
                   if m["event"] == "media") / 8000

    async def stop(self) -> None:
        await self.send({"event": "stop", "sequenceNumber": str(self.sequence + 1), "streamSid": self.stream_sid,
                         "stop": {"accountSid": "AC" + "0" * 32, "callSid": self.call_sid}})

    async def closed(self) -> tuple[int, str]:
        await self.ws.wait_closed()
        await self._task
        return self.ws.close_code, self.ws.close_reason


def ws_url(daemon) -> str:
    return f"ws://{daemon.services.doors['media_ws']}/media"


def mulaw(audio16k: np.ndarray) -> bytes:
    return wire_audio(audio16k, MULAW)


async def test_media_stream_speech_reaches_the_agent_and_each_reply_ends_with_a_mark(daemon, book):
    speech = layout(QUESTION, tail_s=0.0).audio
    expected = transcripts_over_grpc(daemon, speech, MULAW)
    stream = await TwilioStream.open(ws_url(daemon))
    await stream.say(mulaw(speech))
    await stream.talk_until(lambda: "mark" in stream.events())
    await stream.stop()
    assert await stream.closed() == (1000, "")
    assert book.heard == expected
    media = [m for _, m in stream.received if m["event"] == "media"]
    assert all(m["streamSid"] == stream.stream_sid for m in media)
    assert stream.audio_s() == REPLY_S  # mu-law 8 kHz, one byte a sample
    assert stream.events()[-1] == "mark" and stream.received[-1][1]["mark"] == {"name": "reply-1"}
    await until(lambda: idle(daemon))


async def test_media_stream_barge_in_clears_the_far_end(daemon, book, reply_seconds):
    reply_seconds(8.0)
    book.answers = 1
    stream = await TwilioStream.open(ws_url(daemon))
    await stream.say(mulaw(layout(QUESTION, tail_s=0.0).audio))
    await stream.talk_until(lambda: stream.audio_s() > 0)
    await stream.say(mulaw(layout(INTERRUPTION, lead_s=0.0, tail_s=0.0).audio), realtime=True)
    await stream.talk_until(lambda: "clear" in stream.events())
    await stream.talk_until(lambda: len(book.heard) == 2)
    await stream.stop()
    await stream.closed()
    events = stream.events()
    # The far end was told to drop what it buffered, and no audio of the cut reply came after.
    assert events.count("clear") == 1 and "media" in events[: events.index("clear")]
    assert "media" not in events[events.index("clear"):]
    await until(lambda: idle(daemon))


async def test_media_stream_dtmf_reaches_the_agent_and_the_agent_hangs_up(daemon, book):
    stream = await TwilioStream.open(ws_url(daemon))
    await stream.silence()
    await stream.send({"event": "dtmf", "streamSid": stream.stream_sid, "sequenceNumber": "3",
                       "dtmf": {"track": "inbound_track", "digit": "7"}})
    await stream.talk_until(lambda: stream.events().count("mark") == 1)
    await stream.send({"event": "dtmf", "streamSid": stream.stream_sid, "sequenceNumber": "9",
                       "dtmf": {"track": "inbound_track", "digit": "#"}})
    code, reason = await asyncio.wait_for(stream.closed(), 120)
    assert (code, reason) == (1000, "the agent ended the call")
    assert book.keys == ["7", "#"]
    assert stream.events().count("mark") == 2 and stream.audio_s() == 2 * REPLY_S
    await until(lambda: idle(daemon))


@pytest.mark.parametrize("how", ["stop", "socket closed"])
async def test_media_stream_caller_hangup_ends_the_session(daemon, book, reply_seconds, how):
    reply_seconds(8.0)
    stream = await TwilioStream.open(ws_url(daemon))
    await stream.say(mulaw(layout(QUESTION, tail_s=0.0).audio))
    await stream.talk_until(lambda: stream.audio_s() > 0)
    if how == "stop":
        await stream.stop()
    else:
        await stream.ws.close()
    await stream.closed()
    await until(lambda: idle(daemon))


@pytest.mark.parametrize("door", ["audiosocket", "media stream"])
async def test_a_finished_phone_call_is_freed_when_it_ends_not_by_the_collector(daemon, book, door):
    """As over gRPC (tests/test_conversation.py): a phone call answered and hung up leaves none of its
    session's objects in a reference cycle for the collector's next full pass to find."""
    speech = layout(QUESTION, tail_s=0.0).audio
    with collector_off() as new_call_objects:
        if door == "audiosocket":
            call = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
            await call.say(slin(speech))
            await call.talk_until(lambda: call.audio_s() >= REPLY_S)
            call.hang_up()
            await call.closed.wait()
            await call.close()
        else:
            stream = await TwilioStream.open(ws_url(daemon))
            await stream.say(mulaw(speech))
            await stream.talk_until(lambda: "mark" in stream.events())
            await stream.stop()
            await stream.closed()
        await until(lambda: idle(daemon))
        assert book.heard and book.heard[0].strip()  # the call was heard and answered
        await until(lambda: not new_call_objects(), timeout=10)


async def test_media_stream_protocol_errors_close_only_that_stream(daemon, book, caplog):
    live = await TwilioStream.open(ws_url(daemon))
    await live.silence()
    def start(stream, encoding="audio/x-mulaw"):
        return json.dumps({"event": "start", "streamSid": stream.stream_sid, "start": {
            "callSid": stream.call_sid, "mediaFormat": {"encoding": encoding, "sampleRate": 8000, "channels": 1}}})

    def media(stream, payload):
        return json.dumps({"event": "media", "streamSid": stream.stream_sid, "media": {"payload": payload}})

    cases = [  # (what, messages after `connected`, close code, the fault named in the reason and the log)
        ("not JSON", lambda s: [start(s), "{nope"], 1007, "not JSON"),
        ("binary", lambda s: [start(s), b"\x00\x01"], 1003, "binary messages"),
        ("media before start", lambda s: [media(s, "")], 1008, "'media' before start"),
        ("payload not base64", lambda s: [start(s), media(s, "*!*")], 1007, "not base64"),
        ("unsupported format", lambda s: [start(s, "audio/L16")], 1008, "audio/L16"),
        ("a second start", lambda s: [start(s), start(s)], 1008, "a second start"),
    ]
    with caplog.at_level(logging.WARNING, logger="voiced.doors.media_ws"):
        for name, messages, code, fault in cases:
            stream = await TwilioStream.open(ws_url(daemon), start=False)
            for message in messages(stream):
                await stream.ws.send(message)
            got_code, reason = await asyncio.wait_for(stream.closed(), 60)
            assert got_code == code and fault in reason, (name, got_code, reason)
            assert any(fault in r.getMessage() for r in caplog.records), name
            await live.silence()
    await live.say(mulaw(layout(QUESTION, tail_s=0.0).audio))
    await live.talk_until(lambda: "mark" in live.events())
    assert len(book.heard) == 1
    await live.stop()
    await live.closed()
    await until(lambda: idle(daemon))


async def test_media_stream_refused_over_the_limit_with_close_1013(daemon, book):
    first = await TwilioStream.open(ws_url(daemon))
    await first.talk_until(lambda: daemon.services.active_sessions == 1)
    limit = daemon.services.config.server.max_sessions
    daemon.services.config.server.max_sessions = 1
    try:
        refused = await TwilioStream.open(ws_url(daemon))
        code, reason = await asyncio.wait_for(refused.closed(), 60)
    finally:
        daemon.services.config.server.max_sessions = limit
    assert code == 1013 and "limit of 1 concurrent sessions" in reason
    await first.stop()
    await first.closed()
    await until(lambda: idle(daemon))


async def test_media_stream_token_in_the_header_or_the_start_parameters(daemon, book):
    server = daemon.services.config.server
    server.auth_token = "s3cret"
    try:
        with pytest.raises(websockets.InvalidStatus) as e:
            await ws_connect(ws_url(daemon), additional_headers={"Authorization": "Bearer wrong"})
        assert e.value.response.status_code == 401
        denied = await TwilioStream.open(ws_url(daemon))  # no header, no token parameter
        code, reason = await asyncio.wait_for(denied.closed(), 60)
        assert code == 1008 and "token" in reason
        for kwargs in ({"headers": {"Authorization": "Bearer s3cret"}}, {"token": "s3cret"}):
            stream = await TwilioStream.open(ws_url(daemon), **kwargs)
            await stream.talk_until(lambda: daemon.services.active_sessions == 1)
            await stream.stop()
            assert await stream.closed() == (1000, "")
            await until(lambda: idle(daemon))
    finally:
        server.auth_token = ""


# ----------------------------------------------------------------------------- drain


async def test_drain_stops_accepting_on_both_doors_and_lets_live_calls_finish(models, book, tmp_path):
    d = start_phone_daemon(models, tmp_path, tts=False)  # listening only: the agent's text is the reply
    try:
        phone = await AsteriskCall.dial(d.services.doors["audiosocket"])
        stream = await TwilioStream.open(ws_url(d))
        await phone.talk_until(lambda: d.services.active_sessions == 2)
        drained = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(d.server.drain_and_stop(grace=20), d.loop))
        await phone.talk_until(lambda: d.services.draining)
        host, port = d.services.doors["audiosocket"].rsplit(":", 1)

        async def refused_audiosocket() -> bool:
            try:
                late = await AsteriskCall.dial(f"{host}:{port}")
            except ConnectionRefusedError:
                return True
            await late.silence()
            await late.closed.wait()
            await late.close()
            return [(k, p) for _, k, p in late.messages] == [(0xFF, b"unavailable")]

        async def refused_media_ws() -> bool:
            try:
                late = await TwilioStream.open(ws_url(d))
            except OSError:
                return True
            code, _ = await late.closed()
            return code == 1001

        # Refused either way: the listener is closed, or (a connection that raced it) it is told to go.
        assert await refused_audiosocket() and await refused_media_ws()
        # Both live calls are still heard.
        speech = layout(QUESTION, tail_s=1.0).audio  # with the silence that ends the utterance
        await phone.say(slin(speech))
        await stream.say(mulaw(speech))
        await phone.talk_until(lambda: len(book.heard) == 2)
        assert not drained.done()
        phone.hang_up()
        await stream.stop()
        await phone.closed.wait()
        await stream.closed()
        await asyncio.wait_for(drained, 60)  # the drain ends when the last call does, not at the grace
        await phone.close()
    finally:
        d.loop.call_soon_threadsafe(d.loop.stop)
        d.thread.join(10)


# ----------------------------------------------------------------------------- settings


def test_phone_door_settings_from_file_and_environment(tmp_path):
    from voiced.config import load_config

    cfg = tmp_path / "v.toml"
    cfg.write_text('[doors]\naudiosocket = "127.0.0.1:9092"\n\n[audiosocket]\nagent = "ivr"\ngreeting = "Hello."\n')
    config = load_config(cfg, env={"VOICED_MEDIA_WS_VOICE": "female", "VOICED_MEDIA_WS_GREETING": "Hi there."})
    assert (config.audiosocket.agent, config.audiosocket.voice, config.audiosocket.greeting) == ("ivr", "", "Hello.")
    assert (config.media_ws.agent, config.media_ws.voice, config.media_ws.greeting) == ("", "female", "Hi there.")


@pytest.mark.parametrize("door", ["audiosocket", "media_ws"])
async def test_a_door_with_an_unknown_agent_does_not_open(door):
    from voiced.config import Config
    from voiced.core.services import Services
    from voiced.doors import DoorError, build

    config = Config()
    getattr(config, door).agent = "nobody"
    with pytest.raises(DoorError, match=rf"{door}.agent 'nobody' is not an agent of this server; agents: client, echo"):
        await build(door, Services(config=config), "127.0.0.1:0").start()
    with pytest.raises(DoorError, match=f"doors.{door}: 'nowhere' is not HOST:PORT"):
        await build(door, Services(config=Config()), "nowhere").start()
