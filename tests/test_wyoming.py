"""The Wyoming door end to end, with the `wyoming` package's own client (AsyncTcpClient, as Home
Assistant uses it) against a real daemon: a tiny random Whisper, a tiny random Spark-TTS, espeak-ng
speech. Random weights say nothing sensible, so a transcript is checked against what the daemon's
gRPC Recognize gives for the same audio (the same engine path), and speech against its Synthesize."""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import numpy as np
import pytest
import soxr
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc
from wyoming.asr import Transcribe, Transcript, TranscriptChunk, TranscriptStart
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe, Info
from wyoming.ping import Ping, Pong
from wyoming.tts import (
    Synthesize,
    SynthesizeChunk,
    SynthesizeStart,
    SynthesizeStop,
    SynthesizeVoice,
)

from tests.daemon_harness import FAULT_TEXT, daemon_config, engine_fault, socket_timeout, start_daemon
from tests.spark_fixtures import make_spark_checkpoint
from tests.speech import RATE, layout
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.doors.shared import split_address

REPLY_S = 1.0  # every sentence is capped at this: random LMs never stop on their own
SAMPLES_PER_CHUNK = 1024  # what Home Assistant's satellites send
READ_TIMEOUT = 120  # a safety net so a broken door fails the test instead of hanging it

SENTENCE_1 = "Hello there, this is the first sentence."
SENTENCE_2 = "And here is the second one."


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from voiced.engines.spark.engine import SparkTTSEngine

    root = tmp_path_factory.mktemp("models")
    whisper = make_openai_checkpoint(root / "whisper", seed=3)
    spark = make_spark_checkpoint(root / "Spark-TTS-0.5B", seed=0)
    config = daemon_config()
    config.tts.enabled = True
    config.tts.first_chunk_tokens = 5
    config.tts.chunk_tokens = 10
    config.tts.max_seconds = REPLY_S
    config.doors.wyoming = "tcp://127.0.0.1:0"
    tts = SparkTTSEngine.load(str(spark), device="cpu", max_batch=4, voices_dir=tmp_path_factory.mktemp("voices"))
    d = start_daemon(whisper, config, tts_engine=tts)
    yield d
    d.stop()


def client(daemon) -> AsyncTcpClient:
    host, port = split_address(daemon.services.doors["wyoming"], scheme="tcp")
    return AsyncTcpClient(host, port, read_timeout=READ_TIMEOUT)


async def read_until(c: AsyncTcpClient, *types: str) -> list:
    """Events up to and including the first of `types` (or up to the end of the connection)."""
    events = []
    while True:
        event = await c.read_event()
        if event is None:
            return events
        events.append(event)
        if event.type in types:
            return events


def run(coro):
    return asyncio.run(coro)


# ------------------------------------------------------------------------------ audio helpers


def int16_at(rate: int, texts: list[str]) -> np.ndarray:
    """espeak-ng speech with pauses, at `rate`, as int16 (what a microphone would give)."""
    audio = layout(texts, lead_s=0.3, gap_s=0.4, tail_s=0.3).audio
    if rate != RATE:
        audio = soxr.resample(audio, RATE, rate)
    return np.clip(np.rint(audio * 32768.0), -32768, 32767).astype(np.int16)


def as_pcm(x: np.ndarray, width: int, channels: int) -> bytes:
    """int16 samples as `width`-byte PCM with every channel the same (exact but for 8-bit)."""
    v = x.astype(np.int32)
    if width == 1:
        cols = ((v >> 8) + 128).astype(np.uint8)[:, None]
    elif width == 2:
        cols = x.astype("<i2").view(np.uint8).reshape(-1, 2)
    elif width == 3:
        w = v << 8
        cols = np.stack([w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF], axis=1).astype(np.uint8)
    else:
        cols = (v << 16).astype("<i4").view(np.uint8).reshape(-1, 4)
    return np.repeat(cols, channels, axis=0).tobytes()


def heard_as_int16(x: np.ndarray, width: int) -> np.ndarray:
    """What `as_pcm` keeps of the signal (8-bit keeps the top byte)."""
    return (x.astype(np.int32) >> 8 << 8).astype(np.int16) if width == 1 else x


def recognize(daemon, pcm: np.ndarray, rate: int) -> str:
    """The daemon's gRPC Recognize on the same audio: the reference for the door's transcript."""
    with grpc.insecure_channel(daemon.address) as channel:
        resp = pb_grpc.VoicedStub(channel).Recognize(pb.RecognizeRequest(
            audio=pcm.astype("<i2").tobytes(), format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=rate),
            recognition=pb.RecognitionConfig(language="en")))
    return " ".join(r.text.strip() for r in resp.results if r.text.strip())


async def send_audio(c: AsyncTcpClient, data: bytes, rate: int, width: int, channels: int,
                     start: bool = True, stop: bool = True) -> None:
    fmt = {"rate": rate, "width": width, "channels": channels}
    if start:
        await c.write_event(AudioStart(**fmt).event())
    step = SAMPLES_PER_CHUNK * width * channels
    for i in range(0, len(data), step):
        await c.write_event(AudioChunk(**fmt, audio=data[i : i + step]).event())
    if stop:
        await c.write_event(AudioStop().event())


def types(events) -> list[str]:
    return [e.type for e in events]


# ------------------------------------------------------------------------------ describe


@pytest.mark.parametrize("address,expected", [
    ("tcp://0.0.0.0:10300", ("0.0.0.0", 10300)), ("tcp://:10300", ("127.0.0.1", 10300)),
    ("127.0.0.1:0", ("127.0.0.1", 0)), ("tcp://[::1]:10300", ("::1", 10300)),
])
def test_the_address_is_tcp_host_and_port(address, expected):
    assert split_address(address, scheme="tcp") == expected


@pytest.mark.parametrize("address", ["unix:///run/wyoming.sock", "tcp://host", "tcp://host:port", "host:1/x"])
def test_other_addresses_say_what_to_write(address):
    with pytest.raises(ValueError, match="is not tcp://HOST:PORT"):
        split_address(address, scheme="tcp")


def test_describe_lists_the_model_its_languages_and_every_voice(daemon, tmp_path):
    from tests.speech import write_wav

    asr = daemon.services.asr.engine

    async def describe():
        async with client(daemon) as c:
            await c.write_event(Describe().event())
            info = Info.from_event((await read_until(c, "info"))[-1])
            await c.write_event(Ping(text="still there?").event())
            pong = Pong.from_event((await read_until(c, "pong"))[-1])
            return info, pong

    info, pong = run(describe())
    assert pong.text == "still there?"
    (stt,) = info.asr
    assert stt.name == "voiced" and stt.installed and stt.version and stt.supports_transcript_streaming
    assert stt.attribution.name == "voiced"
    (model,) = stt.models
    assert model.name == asr.model_name and model.installed and model.attribution.name == "OpenAI"
    assert model.languages == list(asr.languages) and "en" in model.languages and len(model.languages) == 99
    (tts,) = info.tts
    assert tts.name == "voiced" and tts.installed and tts.supports_synthesize_streaming
    names = [v.name for v in tts.voices]
    assert {"female", "male", "male-low"} <= set(names)
    assert all(v.languages == ["en", "zh"] and v.installed for v in tts.voices)

    # A voice cloned while the server runs is offered at the next describe.
    ref = write_wav(tmp_path / "ref.wav", layout(["This is my voice, recorded for the assistant."], lead_s=0.2,
                                                  tail_s=0.2).audio)
    with grpc.insecure_channel(daemon.address) as channel:
        pb_grpc.VoicedStub(channel).AddVoice(pb.AddVoiceRequest(
            name="alice", audio=ref.read_bytes(), transcript="This is my voice, recorded for the assistant."))
    info, _ = run(describe())
    alice = [v for v in info.tts[0].voices if v.name == "alice"]
    assert len(alice) == 1 and "cloned" in alice[0].description


# ------------------------------------------------------------------------------ speech to text


@pytest.mark.parametrize("rate,width,channels", [
    (16000, 2, 1),  # what Home Assistant sends
    (22050, 2, 1), (48000, 2, 2), (44100, 4, 2), (16000, 3, 1), (8000, 1, 1),
], ids=lambda v: str(v))
def test_speech_in_gives_the_transcript_recognize_gives(daemon, rate, width, channels):
    x = int16_at(rate, ["Turn on the kitchen lights."])

    async def transcribe():
        async with client(daemon) as c:
            await c.write_event(Transcribe(language="en").event())
            await send_audio(c, as_pcm(x, width, channels), rate, width, channels)
            return await read_until(c, "transcript-stop")

    events = run(transcribe())
    assert types(events) == ["transcript-start", "transcript-chunk", "transcript", "transcript-stop"]
    transcript = Transcript.from_event(events[2])
    assert transcript.text and transcript.text == recognize(daemon, heard_as_int16(x, width), rate)
    assert TranscriptChunk.from_event(events[1]).text == transcript.text
    assert TranscriptStart.from_event(events[0]).language == "en" and transcript.language == "en"


def test_long_speech_streams_a_transcript_chunk_while_audio_still_arrives(daemon):
    """Past Whisper's 30 s window the first part is transcribed while the speaker goes on."""
    x = int16_at(RATE, ["Please read me the shopping list for this week."] * 14)
    assert len(x) > 31 * RATE
    first, rest = x[: 30 * RATE], x[30 * RATE :]

    async def transcribe():
        async with client(daemon) as c:
            await c.write_event(Transcribe(language="en-US").event())
            await send_audio(c, x[: 31 * RATE].tobytes(), RATE, 2, 1, stop=False)
            early = await read_until(c, "transcript-chunk")  # no audio-stop sent yet
            await send_audio(c, x[31 * RATE :].tobytes(), RATE, 2, 1, start=False)
            return early, await read_until(c, "transcript-stop")

    early, late = run(transcribe())
    assert types(early) == ["transcript-start", "transcript-chunk"]
    assert types(late) == ["transcript-chunk", "transcript", "transcript-stop"]
    one, two = TranscriptChunk.from_event(early[1]).text, TranscriptChunk.from_event(late[0]).text
    assert one == recognize(daemon, first, RATE) and two == " " + recognize(daemon, rest, RATE)
    assert Transcript.from_event(late[1]).text == one + two


def test_an_unknown_language_is_an_error_event(daemon):
    async def transcribe():
        async with client(daemon) as c:
            await c.write_event(Transcribe(language="tlh").event())  # refused before any audio is sent
            return await read_until(c)

    events = run(transcribe())
    assert types(events) == ["error"]
    error = Error.from_event(events[0])
    assert error.code == "bad_input" and "'tlh'" in error.text and "en" in error.text


# ------------------------------------------------------------------------------ text to speech


def grpc_synthesize(daemon, text: str, voice: str) -> list[bytes]:
    with grpc.insecure_channel(daemon.address) as channel:
        stub = pb_grpc.VoicedStub(channel)
        return [r.audio.audio for r in stub.Synthesize(pb.SynthesizeRequest(
            text=text, speech=pb.SpeechConfig(voice=voice)))]


def test_synthesize_streams_every_engine_chunk(daemon):
    async def synthesize():
        async with client(daemon) as c:
            await c.write_event(Synthesize(text=SENTENCE_1, voice=SynthesizeVoice(name="male")).event())
            return await read_until(c, "audio-stop")

    events = run(synthesize())
    reference = grpc_synthesize(daemon, SENTENCE_1, "male")
    assert types(events) == ["audio-start"] + ["audio-chunk"] * len(reference) + ["audio-stop"]
    start = AudioStart.from_event(events[0])
    assert (start.rate, start.width, start.channels) == (16000, 2, 1)
    chunks = [AudioChunk.from_event(e) for e in events[1:-1]]
    # Chunk for chunk as the engine made them (random sampling: the samples differ, the sizes do not).
    assert [len(c.audio) for c in chunks] == [len(r) for r in reference]
    assert sum(len(c.audio) for c in chunks) == int(REPLY_S * RATE) * 2
    offsets = [c.timestamp for c in chunks]
    assert offsets[0] == 0 and offsets == sorted(offsets) and AudioStop.from_event(events[-1]).timestamp == 1000


def test_streaming_synthesis_speaks_each_sentence_as_its_text_arrives(daemon):
    one_sentence = int(REPLY_S * RATE) * 2  # bytes of audio a sentence makes

    async def stream():
        async with client(daemon) as c:
            await c.write_event(SynthesizeStart(voice=SynthesizeVoice(name="female")).event())
            await c.write_event(SynthesizeChunk(text=SENTENCE_1[:10]).event())
            await c.write_event(SynthesizeChunk(text=SENTENCE_1[10:] + " And").event())
            # The first sentence is complete: its audio comes before any more text is sent.
            first = [await c.read_event()]
            got = 0
            while got < one_sentence:
                first.append(await c.read_event())
                got += len(AudioChunk.from_event(first[-1]).audio)
            await c.write_event(SynthesizeChunk(text=SENTENCE_2[3:]).event())
            # Streaming clients also send the whole text for servers that do not stream: not spoken twice.
            await c.write_event(Synthesize(text=f"{SENTENCE_1} {SENTENCE_2}",
                                           voice=SynthesizeVoice(name="female")).event())
            await c.write_event(SynthesizeStop().event())
            return first, await read_until(c, "synthesize-stopped")

    first, rest = run(stream())
    assert types(first)[0] == "audio-start" and set(types(first)[1:]) == {"audio-chunk"}
    assert types(rest)[-2:] == ["audio-stop", "synthesize-stopped"]
    assert set(types(rest)[:-2]) == {"audio-chunk"}
    assert sum(len(AudioChunk.from_event(e).audio) for e in rest[:-2]) == one_sentence
    assert AudioStop.from_event(rest[-2]).timestamp == 2000


def test_an_unknown_voice_is_an_error_event_and_ends_that_connection(daemon):
    async def synthesize():
        async with client(daemon) as c:
            await c.write_event(Synthesize(text="Hello.", voice=SynthesizeVoice(name="nobody")).event())
            return await read_until(c)  # up to the end of the connection

    events = run(synthesize())
    assert types(events) == ["error"]
    error = Error.from_event(events[0])
    assert "nobody" in error.text and "female" in error.text and error.code in ("bad_input", "not_found")


@pytest.mark.parametrize("request_kind", ["transcribe", "synthesize"])
def test_an_engine_fault_is_the_servers_error_event_without_its_text(daemon, request_kind):
    pcm = int16_at(RATE, [SENTENCE_1])

    async def ask():
        async with client(daemon) as c:
            if request_kind == "transcribe":
                await c.write_event(Transcribe(language="en").event())
                await send_audio(c, as_pcm(pcm, 2, 1), RATE, 2, 1)
            else:
                await c.write_event(Synthesize(text=SENTENCE_1, voice=SynthesizeVoice(name="male")).event())
            return await read_until(c, "error", "transcript-stop", "audio-stop")

    engine = daemon.services.asr.engine if request_kind == "transcribe" else daemon.services.tts.engine
    with engine_fault(engine):
        events = run(ask())
    assert types(events)[-1] == "error", types(events)
    error = Error.from_event(events[-1])
    assert error.code == "internal" and "server log" in error.text and FAULT_TEXT not in error.text
    # The fault was the engine's with that request: the next one is served.
    after = run(ask())
    assert "error" not in types(after) and types(after)[-1] in ("transcript-stop", "audio-stop"), types(after)


# ------------------------------------------------------------------------------ misbehaving callers


async def raw_exchange(daemon, data: bytes) -> list[dict]:
    """Send raw bytes, read what comes back until the server closes: the events' headers (+ data)."""
    host, port = split_address(daemon.services.doors["wyoming"], scheme="tcp")
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(data)
    await writer.drain()
    out = []
    while line := await asyncio.wait_for(reader.readline(), READ_TIMEOUT):
        header = json.loads(line)
        if header.get("data_length"):
            header.setdefault("data", {}).update(json.loads(await reader.readexactly(header["data_length"])))
        if header.get("payload_length"):
            await reader.readexactly(header["payload_length"])
        out.append(header)
    writer.close()
    return out


@pytest.mark.parametrize("data,words", [
    (b"this is not JSON\n", "the header is not JSON"),
    (b'["an", "array"]\n', "unreadable event"),
    (b"[" * 50000 + b"\n", "unreadable event"),  # nested past the parser's recursion limit
    (b"{" * 70000 + b"\n", "header line is over 65536 bytes"),
    # A declared length over server.max_message_bytes is refused before a byte of it is read.
    (b'{"type": "audio-chunk", "payload_length": 1000000000}\n', "payload_length of 1000000000 bytes"),
    (b'{"type": "synthesize", "data_length": 1000000000}\n', "data_length of 1000000000 bytes"),
    (b'{"type": "audio-chunk", "payload_length": "many"}\n', "payload_length must be a byte count"),
    (b'{"data": {"text": "no type"}}\n', "unreadable event"),
    (b'{"type": "audio-chunk", "data": {"rate": 16000, "width": 2, "channels": 1}, "payload_length": 2}\n\0\0',
     "audio-chunk arrived outside an audio stream"),
    (b'{"type": "audio-start", "data": {"rate": 16000, "channels": 1}}\n', "missing field 'width'"),
    (b'{"type": "audio-start", "data": {"rate": 16000, "width": 7, "channels": 1}}\n', "width 7"),
    (b'{"type": "synthesize", "data": {"text": "  "}}\n', "text is empty"),
    (b'{"type": "synthesize-chunk", "data": {"text": "hi"}}\n', "outside a synthesis stream"),
], ids=["not-json", "array", "deep", "long-line", "payload-1GB", "data-1GB", "payload-text", "no-type", "chunk-before-start", "no-width", "width-7", "empty-text", "chunk-no-stream"])
def test_a_malformed_event_ends_that_connection_only(daemon, data, words):
    x = int16_at(RATE, ["Turn on the kitchen lights."])

    async def both():
        async with client(daemon) as good:
            # A transcription in flight on another connection while the bad one arrives.
            await good.write_event(Transcribe(language="en").event())
            await send_audio(good, x[: len(x) // 2].tobytes(), RATE, 2, 1, stop=False)
            assert types(await read_until(good, "transcript-start")) == ["transcript-start"]
            bad = await raw_exchange(daemon, data)
            await send_audio(good, x[len(x) // 2 :].tobytes(), RATE, 2, 1, start=False)
            return bad, await read_until(good, "transcript-stop")

    bad, good = run(both())
    if words is None:
        assert bad == []
    else:
        assert [e["type"] for e in bad] == ["error"]
        assert words in bad[0]["data"]["text"] and bad[0]["data"]["code"] == "bad_input"
    assert types(good) == ["transcript-chunk", "transcript", "transcript-stop"]
    assert Transcript.from_event(good[1]).text == recognize(daemon, x, RATE)


def test_a_socket_fault_ends_that_connection_as_lost_not_as_an_unreadable_event(daemon, caplog):
    """A fault of the connection's socket while reading (here the kernel's keepalive timeout, ETIMEDOUT) ends
    that connection as lost: no error event answered on it, not logged as an unreadable event; the next
    connection is served."""
    from voiced.doors import wyoming as door

    async def describe(*until: str):
        async with client(daemon) as c:
            await c.write_event(Describe().event())
            return await read_until(c, *until)  # (none: up to the end of the connection)

    with socket_timeout(door, "first_byte", on_call=2), \
            caplog.at_level(logging.INFO, logger="voiced.doors.wyoming"):
        events = run(describe())
    assert types(events) == ["info"]  # its answer, then the end: no error event
    said = [r.getMessage() for r in caplog.records]
    assert any("connection lost: TimeoutError" in m for m in said), said
    assert not any("unreadable" in m for m in said), said
    assert types(run(describe("info"))) == ["info"]


def test_a_caller_hanging_up_mid_reply_cancels_its_synthesis(daemon):
    door = next(d for d in daemon.server.doors if d.name == "wyoming")
    tts, limits = daemon.services.tts, daemon.services.config.tts
    before = (tts.stats.cancelled, tts.stats.finished)
    old, limits.max_seconds = limits.max_seconds, 30.0  # a long reply: still being written at the hang-up

    async def hang_up():
        async with client(daemon) as c:
            await c.write_event(Synthesize(text=SENTENCE_1).event())
            assert (await c.read_event()).type == "audio-start"

    try:
        run(hang_up())
    finally:
        limits.max_seconds = old

    async def settled():
        # Wait, on the server's loop, until the door has finished with every connection.
        while door._connections:
            await asyncio.gather(*door._connections, return_exceptions=True)
        return daemon.services.active["wyoming"], tts.pending

    assert daemon.call(settled) == (0, 0)  # its place is free and nobody waits on the engine
    # The engine thread takes commands in order: by this call it has applied the cancellation.
    assert tts.thread.call(tts.engine.active_requests) == 0
    assert (tts.stats.cancelled, tts.stats.finished) == (before[0] + 1, before[1])


# ------------------------------------------------------------------------------ capacity and drain


def test_a_full_server_refuses_with_an_error_event(daemon):
    limits = daemon.services.config.server
    x = int16_at(RATE, ["Turn on the kitchen lights."])
    old, limits.max_sessions = limits.max_sessions, daemon.services.active_sessions + 1

    async def full():
        async with client(daemon) as holder, client(daemon) as refused:
            await holder.write_event(Transcribe(language="en").event())
            await send_audio(holder, x[:RATE].tobytes(), RATE, 2, 1, stop=False)
            assert types(await read_until(holder, "transcript-start")) == ["transcript-start"]  # admitted
            await refused.write_event(Synthesize(text=SENTENCE_1).event())
            no = await read_until(refused)
            await send_audio(holder, x[RATE:].tobytes(), RATE, 2, 1, start=False)
            yes = await read_until(holder, "transcript-stop")
        async with client(daemon) as later:  # the place is free again
            await later.write_event(Synthesize(text=SENTENCE_1).event())
            again = await read_until(later, "audio-stop")
        return no, yes, again

    metrics = daemon.services.metrics
    refusals = metrics.errors.labels("wyoming", "over_capacity")._value.get()
    try:
        no, yes, again = run(full())
    finally:
        limits.max_sessions = old
    assert metrics.errors.labels("wyoming", "over_capacity")._value.get() == refusals + 1
    assert metrics.sessions_total.labels("wyoming", "ok")._value.get() >= 2
    assert types(no) == ["error"]
    error = Error.from_event(no[0])
    assert error.code == "over_capacity" and "limit of" in error.text
    assert types(yes)[-1] == "transcript-stop" and types(again)[-1] == "audio-stop"


def test_drain_stops_accepting_and_lets_the_live_request_finish(tmp_path):
    d = start_daemon(make_openai_checkpoint(tmp_path / "whisper", seed=3), _drain_config())
    door = next(door for door in d.server.doors if door.name == "wyoming")
    host, port = split_address(d.services.doors["wyoming"], scheme="tcp")
    x = int16_at(RATE, ["Turn on the kitchen lights."])

    async def begin_drain():
        task = asyncio.create_task(d.server.drain_and_stop(grace=600))
        while door._server.is_serving():
            await asyncio.sleep(0)  # let the drain run up to the point where this door stops accepting
        return task

    async def scenario():
        async with AsyncTcpClient(host, port, read_timeout=READ_TIMEOUT) as live, \
                AsyncTcpClient(host, port, read_timeout=READ_TIMEOUT) as idle:
            await idle.write_event(Describe().event())
            info = Info.from_event((await read_until(idle, "info"))[-1])
            assert len(info.asr) == 1 and info.tts == []  # a listening-only server offers no voices
            await live.write_event(Transcribe(language="en").event())
            await send_audio(live, x[: len(x) // 2].tobytes(), RATE, 2, 1, stop=False)
            assert types(await read_until(live, "transcript-start")) == ["transcript-start"]
            drain = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(begin_drain(), d.loop))
            drain_task = await drain
            with pytest.raises(ConnectionRefusedError):
                await asyncio.open_connection(host, port)
            # A new request on a connection opened before the drain is refused: the server is going away.
            await idle.write_event(Transcribe(language="en").event())
            refused = await read_until(idle)
            assert not drain_task.done()  # it waits for the live request
            await send_audio(live, x[len(x) // 2 :].tobytes(), RATE, 2, 1, start=False)
            finished = await read_until(live, "transcript-stop")

        async def drained():
            await drain_task

        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(drained(), d.loop))  # nothing left open
        assert d.services.doors == {} and d.services.active_sessions == 0
        return finished, refused

    try:
        finished, refused = asyncio.run(scenario())
        assert types(finished) == ["transcript-chunk", "transcript", "transcript-stop"]
        assert types(refused) == ["error"]
        error = Error.from_event(refused[0])
        assert error.code == "unavailable" and "shutting down" in error.text
    finally:
        d.stop()


def _drain_config():
    config = daemon_config()
    config.doors.wyoming = "tcp://127.0.0.1:0"
    return config
