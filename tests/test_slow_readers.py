"""Callers that stop reading, at the doors that are not gRPC (gRPC's: tests/test_limits.py and case G45 of
tests/test_bad_input.py): AudioSocket, the media WebSocket, Wyoming and /v1/realtime.

One real daemon (tiny random Whisper and Spark-TTS checkpoints on the CPU) with every door open and
`server.max_outbound_bytes` at its floor (64 KiB). Each slow caller asks for far more audio than that and
reads nothing until the door has given up on it. Its connection has small kernel buffers: its own receive
buffer, and the door's send buffer, set on the door's listening socket (accepted sockets inherit it), so
that the door's writes block after tens of kilobytes rather than the megabytes Linux grows them to. The
test waits for the event, not for a time: `voiced_errors_total{front, code="over_capacity"}` counting
the slow call. Then the caller reads again, and finds a bounded amount queued for it, ending with the
protocol's error. Meanwhile another caller of the same door is served in full, and afterwards every
session's place is free again.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
import uuid

import pytest
import websockets
from websockets.asyncio.client import connect as ws_connect
from wyoming.audio import AudioChunk
from wyoming.client import AsyncTcpClient
from wyoming.event import async_read_event, async_write_event
from wyoming.tts import Synthesize

from tests.daemon_harness import daemon_config, start_daemon, wire_audio
from tests.spark_fixtures import cached_spark_checkpoint
from tests.speech import layout
from tests.test_phone_doors import AsteriskCall, hang_up_leftovers  # noqa: F401 (an autouse fixture)
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.audio.ingest import Format
from voiced.doors import shared
from voiced.doors.shared import split_address

BUDGET = 65536  # server.max_outbound_bytes, at its floor
PIECE_S = 2.0  # tts.max_seconds: random LMs speak every piece to the cap
SMALL = 4096  # the slow connection's kernel buffers (Linux doubles what it is asked for)
# What a slow caller may find queued for it when it reads again: the door's own write buffer (64 KiB
# in asyncio and aiohttp), the kernel's, the client library's, and the door's last message. The budget
# itself is not in it: what waited there is dropped when the call ends, never sent.
BOUND = 512 * 1024
LONG = 100  # pieces of the long answer ("#"): 200 s of speech
HANG_GUARD_S = 300.0  # a broken door fails the test instead of hanging it; no timing is judged
MULAW8 = Format("MULAW", 8000)
PCM24 = Format("LINEAR16", 24000)


class Keys:
    """An agent plug-in: a key is answered by voice, the hash key at length (the same sentence LONG times,
    each a TTS request of its own: the random LM speaks that one to the cap), and speech is echoed."""

    async def reply(self, text):
        yield text

    async def on_dtmf(self, digit):
        for _ in range(LONG if digit == "#" else 1):
            yield "You pressed a key."


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    from voiced.engines.spark.engine import SparkTTSEngine

    whisper = make_openai_checkpoint(tmp_path_factory.mktemp("whisper"), seed=3)
    spark = cached_spark_checkpoint(tmp_path_factory, seed=0)
    config = daemon_config()
    config.tts.enabled = True
    config.tts.first_chunk_tokens = 5
    config.tts.chunk_tokens = 10
    config.tts.max_seconds = PIECE_S
    config.server.max_outbound_bytes = BUDGET
    config.doors.audiosocket = config.doors.media_ws = config.doors.http = "127.0.0.1:0"
    config.doors.wyoming = "tcp://127.0.0.1:0"
    config.audiosocket.agent = config.media_ws.agent = "keys"
    tts = SparkTTSEngine.load(str(spark), device="cpu", max_batch=4, voices_dir=tmp_path_factory.mktemp("voices"))
    d = start_daemon(whisper, config, tts_engine=tts, agents={"keys": lambda config, prompt: Keys()})
    for door in d.server.doors:
        if door.name == "grpc":
            continue
        site = getattr(door, "_site", None)  # the aiohttp doors; the TCP doors are asyncio servers
        server = site._server if site is not None else door._server
        for listening in server.sockets:
            listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL)
    yield d
    d.stop()


@pytest.fixture(autouse=True)
def patient_last_words(monkeypatch):
    """A door's last message to a caller that stopped reading waits CLOSE_GRACE_S for it to read again;
    the test reads as soon as the door has given up, and this keeps a busy machine's delay harmless."""
    monkeypatch.setattr(shared, "CLOSE_GRACE_S", HANG_GUARD_S)


def over_capacity(d, front: str) -> float:
    return d.services.metrics.registry.get_sample_value(
        "voiced_errors_total", {"front": front, "code": "over_capacity"}) or 0.0


async def until(predicate) -> None:
    """Wait for a condition the daemon's thread makes true (the hang guard is no bound on timing)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + HANG_GUARD_S
    while not predicate():
        assert loop.time() < deadline, f"hang guard: {predicate} never became true"
        await asyncio.sleep(0.05)


def idle(d) -> bool:
    s = d.services
    return s.active_sessions == 0 and s.tts.engine.active_requests() == 0 and s.tts.pending == 0


def slow_socket(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL)
    sock.connect((host, int(port)))
    sock.setblocking(False)
    return sock


# ----------------------------------------------------------------------------- AudioSocket


async def test_audiosocket_caller_that_stops_reading(daemon):
    """Asterisk's side of a 48 kHz call (the channel driver's slin48) presses the key with the long
    answer (200 s of speech, 19 MB) and reads nothing."""
    before = over_capacity(daemon, "audiosocket")
    reader, writer = await asyncio.open_connection(sock=slow_socket(daemon.services.doors["audiosocket"]),
                                                   limit=SMALL)

    def send(kind: int, payload: bytes = b"") -> None:
        writer.write(struct.pack(">BH", kind, len(payload)) + payload)

    send(0x01, uuid.uuid4().bytes)
    send(0x16, bytes(1920))  # 20 ms of silence: the call is slin 48 kHz
    send(0x03, b"#")
    await writer.drain()
    asked = LONG * PIECE_S * 48000 * 2

    # Another call meanwhile, read as Asterisk reads: its answer comes whole, paced.
    good = await AsteriskCall.dial(daemon.services.doors["audiosocket"])
    good.send(0x03, b"5")
    await good.talk_until(lambda: good.audio_s() >= PIECE_S)
    good.hang_up()
    await good.closed.wait()
    await good.close()
    assert good.audio_s() == PIECE_S

    await until(lambda: over_capacity(daemon, "audiosocket") > before)
    audio, messages = 0, []
    while True:
        try:
            kind, length = struct.unpack(">BH", await reader.readexactly(3))
            payload = await reader.readexactly(length)
        except (asyncio.IncompleteReadError, ConnectionError):
            break
        messages.append((kind, payload))
        audio += len(payload) if kind == 0x16 else 0
    writer.close()
    assert messages and messages[-1] == (0xFF, b"over_capacity"), messages[-3:]
    assert {k for k, _ in messages[:-1]} == {0x16}
    assert audio + 3 * len(messages) <= BOUND < asked, f"{audio} bytes of audio were queued for it"
    await until(lambda: idle(daemon))


# ----------------------------------------------------------------------------- the media WebSocket


def media_start(sid: str) -> list[str]:
    return [json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}),
            json.dumps({"event": "start", "streamSid": sid, "start": {
                "streamSid": sid, "callSid": f"CA{sid}", "accountSid": "AC0", "tracks": ["inbound"],
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}}})]


def dtmf(sid: str, key: str) -> str:
    return json.dumps({"event": "dtmf", "streamSid": sid, "dtmf": {"track": "inbound_track", "digit": key}})


async def test_media_ws_caller_that_stops_reading(daemon):
    """Twilio's side of a stream presses the key with the long answer (200 s of mu-law, 2.1 MB as JSON)
    and reads nothing: the `websockets` client stops taking frames from its socket once one is waiting
    (and sends no keepalive pings, whose answers it would not read)."""
    before = over_capacity(daemon, "media_ws")
    url = f"ws://{daemon.services.doors['media_ws']}/"
    slow_sock = slow_socket(daemon.services.doors["media_ws"])
    async with ws_connect(url, sock=slow_sock, max_queue=1, ping_interval=None) as slow:
        for message in media_start("MZslow"):
            await slow.send(message)
        await slow.send(dtmf("MZslow", "#"))
        asked = LONG * PIECE_S * 8000 * 4 / 3

        # Another stream meanwhile, read as it arrives: the answer, then our mark after it.
        async with ws_connect(url) as good:
            for message in media_start("MZgood"):
                await good.send(message)
            await good.send(dtmf("MZgood", "5"))
            heard = 0
            while True:
                msg = json.loads(await good.recv())
                if msg["event"] == "media":
                    heard += len(base64.b64decode(msg["media"]["payload"]))
                elif msg["event"] == "mark":
                    break
            await good.send(json.dumps({"event": "stop", "streamSid": "MZgood", "stop": {}}))
        assert heard == PIECE_S * 8000

        await until(lambda: over_capacity(daemon, "media_ws") > before)
        received = 0
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                received += len(await slow.recv())
        assert slow.close_code == 1013 and "not reading" in slow.close_reason, (slow.close_code, slow.close_reason)
    assert received <= BOUND < asked, f"{received} bytes were queued for it"
    await until(lambda: idle(daemon))


# ----------------------------------------------------------------------------- Wyoming


async def test_wyoming_synthesis_whose_caller_stops_reading_gives_its_place_back(daemon):
    """A `synthesize` of 40 sentences (2.6 MB of 16 kHz audio) whose caller reads nothing: the synthesis
    ends with the protocol's error instead of holding its engine work and its place of
    server.max_sessions in a write that never completes."""
    before = over_capacity(daemon, "wyoming")
    text = " ".join(f"This is sentence number {i}." for i in range(40))
    asked = 40 * PIECE_S * 16000 * 2
    host, port = split_address(daemon.services.doors["wyoming"], scheme="tcp")
    reader, writer = await asyncio.open_connection(sock=slow_socket(f"{host}:{port}"), limit=SMALL)
    await async_write_event(Synthesize(text=text).event(), writer)

    # Another client meanwhile (the `wyoming` package's, as Home Assistant's): its audio comes whole.
    async with AsyncTcpClient(host, port) as good:
        await good.write_event(Synthesize(text="Hello there.").event())
        audio = 0
        while (event := await good.read_event()) is not None and event.type != "audio-stop":
            if AudioChunk.is_type(event.type):
                audio += len(AudioChunk.from_event(event).audio)
    assert audio == PIECE_S * 16000 * 2

    await until(lambda: over_capacity(daemon, "wyoming") > before)
    received, events = 0, []
    while (event := await async_read_event(reader)) is not None:
        events.append(event)
        received += len(event.payload or b"")
    writer.close()
    assert events[-1].type == "error" and events[-1].data["code"] == "over_capacity", events[-1]
    assert "not reading" in events[-1].data["text"]
    assert received <= BOUND < asked, f"{received} bytes of audio were queued for it"
    await until(lambda: idle(daemon))


# ----------------------------------------------------------------------------- /v1/realtime


def realtime_session() -> dict:
    pcm = {"type": "audio/pcm", "rate": 24000}
    return {"type": "session.update", "session": {"type": "realtime", "audio": {
        "input": {"format": pcm, "turn_detection": {"type": "server_vad", "interrupt_response": False}},
        "output": {"format": pcm}}}}


async def test_realtime_caller_that_stops_reading(daemon):
    """A Realtime client speaks sixteen phrases, each answered by the echo agent with up to 2 s of 24 kHz
    audio deltas (up to 2 MB of JSON), and reads nothing; the server's error event comes last, then the
    close."""
    before = over_capacity(daemon, "realtime")
    speech = wire_audio(layout(["Hello there, how are you today?"] * 16, lead_s=0.3, gap_s=1.0, tail_s=1.0).audio,
                        PCM24)
    step = 960  # 20 ms
    url = f"ws://{daemon.services.doors['http']}/v1/realtime?model=voiced"
    slow_sock = slow_socket(daemon.services.doors["http"])
    async with ws_connect(url, sock=slow_sock, max_queue=1, ping_interval=None) as slow:
        await slow.send(json.dumps(realtime_session()))
        for i in range(0, len(speech), step):
            await slow.send(json.dumps({"type": "input_audio_buffer.append",
                                        "audio": base64.b64encode(speech[i:i + step]).decode()}))
        asked = 16 * PIECE_S * 24000 * 2 * 4 / 3

        await until(lambda: over_capacity(daemon, "realtime") > before)
        received, last = 0, None
        with pytest.raises(websockets.ConnectionClosed):
            while True:
                message = await slow.recv()
                received += len(message)
                last = json.loads(message)
        assert last["type"] == "error" and last["error"]["code"] == "over_capacity", last
        assert slow.close_code == 1013, (slow.close_code, slow.close_reason)
    assert received <= BOUND < asked, f"{received} bytes were queued for it"
    await until(lambda: idle(daemon))
