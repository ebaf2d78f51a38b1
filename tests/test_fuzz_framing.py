"""A property-based fuzzer over the framing of the plain-TCP doors: AudioSocket (voiced.doors.audiosocket_frames)
and Wyoming (JSON-line events read by the `wyoming` package). Each example is a byte stream built from
messages (well formed, of any type, or with any length) and then mutated (bytes flipped, cut, inserted,
repeated), sent into a live door, followed by the end of the caller's side. The only outcomes allowed
are a result or a clear protocol error, then the connection's end: never an `internal` error, never an
error in the daemon's log, never a hang; and afterwards the daemon serves a well-formed call and holds
no session.

The budget is bounded and derandomized in CI (the `ci` profile in conftest.py); HYPOTHESIS_PROFILE=dev
explores more."""

from __future__ import annotations

import asyncio
import json
import logging
import struct
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncTcpClient

from tests.daemon_harness import daemon_config, start_daemon, wire_audio
from tests.speech import layout
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.audio.ingest import Format
from voiced.core.errors import ErrorKind
from voiced.doors.shared import split_address

HANG_S = 120  # a connection still open this long after the caller's side ended is a hang
CLEAR = {k.value for k in ErrorKind} - {ErrorKind.INTERNAL.value}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = daemon_config()
    config.doors.audiosocket = "127.0.0.1:0"
    config.doors.wyoming = "tcp://127.0.0.1:0"
    d = start_daemon(make_openai_checkpoint(tmp_path_factory.mktemp("fuzz"), seed=3), config)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def speech16k() -> bytes:
    return wire_audio(layout(["Can you hear me?"], lead_s=0.2, tail_s=0.4).audio, Format("LINEAR16", 16000))


@pytest.fixture()
def daemon_errors(caplog):
    """Records of the daemon's own log at ERROR and above (an exception a door did not expect)."""
    caplog.set_level(logging.ERROR, logger="voiced")
    return lambda: [r for r in caplog.records if r.name.startswith("voiced") and r.levelno >= logging.ERROR]


# ----------------------------------------------------------------------------- byte streams


def mostly(good, bad):
    """`good` seven times in eight: a stream of mostly sound messages gets deep into a call before its
    fault, where one of anything would be refused at its first message."""
    return st.integers(0, 7).flatmap(lambda n: bad if n == 0 else good)


@st.composite
def mutated(draw, stream: bytes) -> bytes:
    """`stream` with a few mutations: a byte changed, a cut, bytes inserted, a stretch repeated."""
    data = bytearray(stream)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "repeat"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
        elif op == "cut":
            del data[at:at + draw(st.integers(1, 64))]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=32))
        elif op == "repeat":
            data[at:at] = data[max(0, at - 40):at]
    return bytes(data)


async def exchange(address: str, data: bytes) -> bytes:
    """Send `data`, end our side, and read everything until the door closes the connection."""
    host, port = address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        writer.write_eof()
    except OSError:
        # the door may have closed already (a refusal before we were done): a reset or broken pipe, or,
        # when its close lands between our write and our shutdown, ENOTCONN, which is no ConnectionError
        pass
    received = bytearray()
    try:
        while chunk := await reader.read(65536):
            received += chunk
    except OSError:
        pass  # cut by the door (a caller that sent garbage it stopped reading)
    writer.close()
    return bytes(received)


def idle(d) -> bool:
    return d.services.active_sessions == 0


# ----------------------------------------------------------------------------- AudioSocket


AUDIO_KINDS = [0x10, 0x12, 0x16, 0x18]


@st.composite
def audiosocket_message(draw, speech: bytes) -> bytes:
    kind = draw(mostly(st.sampled_from([0x03, 0x12, 0x12, 0x12, 0x00, 0x01, 0xFF, *AUDIO_KINDS]), st.integers(0, 255)))
    if kind == 0x01:
        payload = draw(mostly(st.just(uuid.uuid4().bytes), st.binary(max_size=20)))
    elif kind == 0x03:
        payload = draw(mostly(st.sampled_from([b"1", b"#", b"D"]), st.binary(max_size=3)))
    elif kind in AUDIO_KINDS:
        start = draw(st.integers(0, max(0, len(speech) - 2)))
        size = draw(mostly(st.sampled_from([320, 640, 1920]), st.integers(0, 4000)))
        payload = draw(mostly(st.just(speech[start:start + size]), st.binary(max_size=size)))
    else:
        payload = draw(st.binary(max_size=300))
    length = draw(mostly(st.just(len(payload)), st.integers(0, 0xFFFF)))
    return struct.pack(">BH", kind, length) + payload


@st.composite
def audiosocket_stream(draw, speech: bytes) -> bytes:
    first = struct.pack(">BH", 0x01, 16) + uuid.uuid4().bytes if draw(st.integers(0, 9)) else b""
    body = b"".join(draw(st.lists(audiosocket_message(speech), max_size=40)))
    return draw(mutated(first + body))


def audiosocket_replies(data: bytes) -> list[tuple[int, bytes]]:
    """The door's messages, which must parse whole (a door never sends a broken frame)."""
    out, i = [], 0
    while i < len(data):
        assert i + 3 <= len(data), f"a broken header at the end: {data[i:]!r}"
        kind, length = struct.unpack(">BH", data[i:i + 3])
        assert i + 3 + length <= len(data), f"a message cut short: type 0x{kind:02x}, {length} bytes"
        out.append((kind, data[i + 3:i + 3 + length]))
        i += 3 + length
    return out


def test_audiosocket_framing(daemon, speech16k, daemon_errors):
    @given(st.data())
    def fuzz(data):
        stream = data.draw(audiosocket_stream(speech16k))
        got = asyncio.run(asyncio.wait_for(exchange(daemon.services.doors["audiosocket"], stream), HANG_S))
        for kind, payload in audiosocket_replies(got):
            # No TTS on this daemon: what may come back is a hangup or a clear error, nothing else.
            assert kind in (0x00, 0xFF), f"type 0x{kind:02x} from the door"
            if kind == 0xFF:
                assert payload.decode() in CLEAR, f"error {payload!r} for {stream[:80]!r}"
        assert not daemon_errors(), daemon_errors()[0].getMessage()

    fuzz()
    asyncio.run(wait_idle(daemon))
    check_still_serves(daemon, speech16k)


# ----------------------------------------------------------------------------- Wyoming


WYOMING_TYPES = ["describe", "ping", "transcribe", "audio-start", "audio-chunk", "audio-stop", "synthesize",
                 "synthesize-start", "synthesize-chunk", "synthesize-stop", "run-satellite", "detect"]
json_values = st.recursive(st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                        max_size=3), max_leaves=6)


@st.composite
def wyoming_data(draw, kind: str) -> dict:
    """Mostly the fields the event has, with values right or wrong, and now and then anything."""
    fields = {"rate": st.sampled_from([16000, 8000, 44100]) | st.integers(-5, 10**6),
              "width": st.sampled_from([2, 1, 4]) | st.integers(-1, 9),
              "channels": st.sampled_from([1, 2]) | st.integers(-1, 9),
              "text": st.text(max_size=40), "language": st.sampled_from(["en", "en-US", "xx"]),
              "name": st.sampled_from(["voiced", "nobody"]), "timestamp": st.integers(-1, 10**6)}
    wanted = {"audio-start": ["rate", "width", "channels"], "audio-chunk": ["rate", "width", "channels"],
              "transcribe": ["language", "name"], "synthesize": ["text"], "synthesize-chunk": ["text"],
              "ping": ["text"]}.get(kind, [])
    data = {k: draw(mostly(fields[k], json_values)) for k in wanted if draw(st.integers(0, 5))}
    if not draw(st.integers(0, 4)):
        data.update(draw(st.dictionaries(st.text(max_size=8), json_values, max_size=3)))
    return data


@st.composite
def wyoming_event(draw, speech: bytes) -> bytes:
    kind = draw(mostly(st.sampled_from(WYOMING_TYPES), st.text(max_size=12)))
    data = draw(wyoming_data(kind))
    payload = b""
    if kind == "audio-chunk" or not draw(st.integers(0, 9)):
        start = draw(st.integers(0, max(0, len(speech) - 2)))
        payload = draw(st.just(speech[start:start + 2048]) | st.binary(max_size=300))
    body = json.dumps(data).encode() if data else b""
    header: dict = {"type": kind, "version": "1.5.0"}
    if body:
        header["data_length"] = draw(mostly(st.just(len(body)), st.integers(-2, 400)))
    if payload:
        header["payload_length"] = draw(mostly(st.just(len(payload)), st.integers(-2, 4000)))
    line = json.dumps(header).encode() + b"\n"
    if not draw(st.integers(0, 14)):
        line = draw(st.binary(max_size=60)) + b"\n"  # not JSON, or JSON that is not an event
    return line + body + payload


def wyoming_recognition(speech: bytes) -> list[bytes]:
    """A well-formed transcription: what the random events are mixed into, so some get that far."""
    fmt = {"rate": 16000, "width": 2, "channels": 1}
    events = [Transcribe(language="en").event(), AudioStart(**fmt).event()]
    events += [AudioChunk(**fmt, audio=speech[i:i + 4096]).event() for i in range(0, len(speech), 4096)]
    events.append(AudioStop().event())
    out = []
    for e in events:
        data = json.dumps(e.data).encode() if e.data else b""
        header = {"type": e.type, "version": "1.5.0", **({"data_length": len(data)} if data else {}),
                  **({"payload_length": len(e.payload)} if e.payload else {})}
        out.append(json.dumps(header).encode() + b"\n" + data + (e.payload or b""))
    return out


@st.composite
def wyoming_stream(draw, speech: bytes) -> bytes:
    events = draw(st.lists(wyoming_event(speech), max_size=10))
    if draw(st.booleans()):
        sound = wyoming_recognition(speech)
        for e in events:  # the random events land anywhere in it
            sound.insert(draw(st.integers(0, len(sound))), e)
        events = sound
    return draw(mutated(b"".join(events)))


WYOMING_REPLIES = {"info", "pong", "transcript-start", "transcript-chunk", "transcript", "transcript-stop",
                   "audio-start", "audio-chunk", "audio-stop", "synthesize-stopped", "error"}


async def wyoming_replies(data: bytes) -> list:
    """The door's events, read by the `wyoming` package as Home Assistant reads them: all of them whole."""
    from wyoming.event import async_read_event

    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    events = []
    while (event := await async_read_event(reader)) is not None:
        events.append(event)
    assert reader.at_eof(), f"bytes the wyoming package could not read: {data[-200:]!r}"
    return events


def test_wyoming_framing(daemon, speech16k, daemon_errors):
    host, port = split_address(daemon.services.doors["wyoming"], scheme="tcp")

    @given(st.data())
    def fuzz(data):
        stream = data.draw(wyoming_stream(speech16k))
        got = asyncio.run(asyncio.wait_for(exchange(f"{host}:{port}", stream), HANG_S))
        for event in asyncio.run(wyoming_replies(got)):
            assert event.type in WYOMING_REPLIES, f"{event.type} from the door"
            if event.type == "error":
                assert event.data.get("code") in CLEAR, f"{event.data} for {stream[:120]!r}"
                assert event.data.get("text"), "an error without a message"
        assert not daemon_errors(), daemon_errors()[0].getMessage()

    fuzz()
    asyncio.run(wait_idle(daemon))
    check_still_serves(daemon, speech16k)


# ----------------------------------------------------------------------------- afterwards


async def wait_idle(d) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_S  # a hang guard, not a bound on timing
    while not idle(d):
        assert loop.time() < deadline, f"{d.services.active_sessions} sessions still open after the fuzzing"
        await asyncio.sleep(0.05)


def check_still_serves(d, speech: bytes) -> None:
    """A well-formed Wyoming transcription on the same daemon gets its transcript."""
    host, port = split_address(d.services.doors["wyoming"], scheme="tcp")

    async def go():
        async with AsyncTcpClient(host, port) as c:
            await c.write_event(Transcribe(language="en").event())
            fmt = {"rate": 16000, "width": 2, "channels": 1}
            await c.write_event(AudioStart(**fmt).event())
            for i in range(0, len(speech), 2048):
                await c.write_event(AudioChunk(**fmt, audio=speech[i:i + 2048]).event())
            await c.write_event(AudioStop().event())
            while (event := await c.read_event()) is not None:
                if Transcript.is_type(event.type):
                    return Transcript.from_event(event)

    transcript = asyncio.run(asyncio.wait_for(go(), HANG_S))
    assert transcript is not None and transcript.text.strip()
