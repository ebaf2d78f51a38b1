"""Hostile clients (docs/BAD_INPUT.md, "Hostile clients"): one client must not take the daemon from
everybody. Each door's reads are bounded before they are trusted, every connection has a deadline
before it is admitted, connections have places, JSON types are checked at the edge, caller ids are
bounded, and the metrics endpoint is a bounded listener. The resource cases sample the daemon's RSS
and open descriptors (the daemon runs in this process, on its own thread and loop)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import threading
import time
import zlib
from pathlib import Path

import grpc
import httpx
import pytest
import websockets
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc
from websockets.asyncio.client import connect as ws_connect
from wyoming.audio import AudioChunk, AudioStart
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.info import Describe

from tests.daemon_harness import daemon_config, start_daemon
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.doors import wyoming as wyoming_door
from voiced.doors.shared import split_address

HANDSHAKE_S = 1.0  # server.handshake_timeout_s of this file's daemon
SLACK_S = 2.0  # what a loaded 2-core CI machine adds to a deadline
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = daemon_config()
    config.server.handshake_timeout_s = HANDSHAKE_S
    config.server.metrics_listen = "127.0.0.1:0"
    config.doors.http = "127.0.0.1:0"
    config.doors.media_ws = "127.0.0.1:0"
    config.doors.wyoming = "tcp://127.0.0.1:0"
    config.doors.audiosocket = "127.0.0.1:0"
    d = start_daemon(make_openai_checkpoint(tmp_path_factory.mktemp("whisper"), seed=3), config)
    yield d
    d.stop()


@contextlib.contextmanager
def server_limits(d, **values):
    """`[server]` values changed for the block (the doors read them at each connection)."""
    c = d.services.config.server
    old = {k: getattr(c, k) for k in values}
    for k, v in values.items():
        setattr(c, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(c, k, v)


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def address(d, door: str) -> tuple[str, int]:
    if door == "metrics":
        return "127.0.0.1", d.server._metrics_http.port
    return split_address(d.services.doors[door], scheme="tcp")


def settle(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def closed_by_server(sock: socket.socket, within: float) -> bytes | None:
    """What the server sent before closing `sock` (None: still open after `within` s)."""
    sock.settimeout(within)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
        return got
    except TimeoutError:
        return None
    except ConnectionResetError:
        return got


def serving(d) -> bool:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(d.address) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# ---------------------------------------------------------------------------- deadlines and places


@pytest.mark.parametrize("door,first_bytes", [
    ("http", b""), ("http", b"GET /readyz HTTP/1.1\r\nHost: x\r\n"),  # idle; headers never finished
    ("metrics", b"GET /metrics HTTP/1.1\r\n"),
    ("media_ws", b"GET /media HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"),
    ("wyoming", b""), ("wyoming", b'{"type": "describe"'),  # no event; an event never finished
    ("audiosocket", b""),
])
def test_idle_and_unfinished_connections_close_within_their_deadline(daemon, door, first_bytes):
    """Twenty connections that send nothing (or a header a byte at a time, slow-loris) are closed by
    the server within server.handshake_timeout_s, and the descriptors are given back."""
    fds = open_fds()
    socks = [socket.create_connection(address(daemon, door)) for _ in range(20)]
    start = time.monotonic()
    for s in socks:
        s.sendall(first_bytes)
    # One of them trickles a byte every 0.3 s: it does not buy more time.
    socks[0].setblocking(False)
    while time.monotonic() - start < HANDSHAKE_S + 0.5:
        with contextlib.suppress(OSError):
            socks[0].send(b"X")
        time.sleep(0.3)
    socks[0].setblocking(True)
    for s in socks:
        assert closed_by_server(s, HANDSHAKE_S + SLACK_S) is not None, f"{door}: still open"
        s.close()
    assert time.monotonic() - start < HANDSHAKE_S + 2 * SLACK_S
    assert settle(lambda: open_fds() <= fds + 2, 5.0), (open_fds(), fds)
    assert serving(daemon)


def _refused(daemon, door: str) -> bytes:
    s = socket.create_connection(address(daemon, door))
    with s:
        got = closed_by_server(s, 5.0)
    assert got is not None, f"{door}: the connection over the limit was left open"
    return got


@pytest.mark.parametrize("door", ["http", "metrics", "media_ws", "wyoming", "audiosocket"])
def test_a_connection_over_the_limits_is_refused_in_its_doors_protocol(daemon, door):
    with server_limits(daemon, max_connections_per_door=3):
        held = [socket.create_connection(address(daemon, door)) for _ in range(3)]
        time.sleep(0.1)
        got = _refused(daemon, door)
        for s in held:
            s.close()
    if door in ("http", "metrics", "media_ws"):
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After" in head
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and "server.max_connections_per_door" in error["message"]
    elif door == "wyoming":
        header, _, rest = got.partition(b"\n")
        data = json.loads(rest[: json.loads(header)["data_length"]])
        assert json.loads(header)["type"] == "error" and data["code"] == "over_capacity"
        assert "server.max_connections_per_door" in data["text"]
    else:
        assert got[:1] == b"\xff" and got[3:] == b"over_capacity"
    # Places are given back: a connection now is served.
    assert settle(lambda: open_connections(daemon, door) == 0, 5.0)
    with httpx.Client() as c:
        assert c.get(f"http://{daemon.services.doors['http']}/readyz").status_code == 200


def open_connections(d, door: str) -> int:
    from voiced.doors.guard import connections

    async def count():
        return connections(d.services).open[door]

    return d.call(count)


def test_the_total_limit_counts_every_door(daemon):
    with server_limits(daemon, max_connections=2):
        held = [socket.create_connection(address(daemon, "wyoming")) for _ in range(2)]
        time.sleep(0.1)
        got = _refused(daemon, "http")
        for s in held:
            s.close()
    assert got.startswith(b"HTTP/1.1 503") and b"server.max_connections" in got


def test_the_open_file_limit_is_raised_to_the_hard_limit(daemon, caplog):
    import resource

    from voiced.doors.guard import raise_open_file_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or hard == resource.RLIM_INFINITY  # the daemon's start raised it
    assert raise_open_file_limit() == (soft, hard)


# ---------------------------------------------------------------------------- Wyoming: bounded reads


def test_wyoming_a_declared_gigabyte_is_refused_without_reading_it(daemon):
    """A header declaring a 1 GB payload, then bytes at line speed: an error event, the connection
    closed while the client is still sending, the daemon's RSS unmoved."""
    before = rss_mb()
    s = socket.create_connection(address(daemon, "wyoming"))
    s.sendall(b'{"type": "audio-chunk", "data": {"rate": 16000, "width": 2, "channels": 1}, '
              b'"payload_length": 1000000000}\n')
    sent, block = 0, b"\0" * (1 << 20)
    s.settimeout(5)
    with contextlib.suppress(OSError):
        while sent < 200 << 20:  # 200 MB: far past anything the server would buffer
            sent += s.send(block)
    got = closed_by_server(s, 5.0)
    s.close()
    assert got is not None and b'"error"' in got and b"payload_length of 1000000000 bytes" in got
    assert sent < 200 << 20  # refused, not read: the socket closed under the sender
    assert rss_mb() - before < 50


def test_wyoming_audio_is_read_no_faster_than_recognized_and_one_stream_is_bounded(daemon, monkeypatch):
    """Audio at line speed without audio-stop: the door reads it as the recognition takes it (RSS
    bounded), and past MAX_STREAM_S of audio the stream is refused with an error event."""
    monkeypatch.setattr(wyoming_door, "MAX_STREAM_S", 40)
    before = rss_mb()

    async def flood():
        host, port = address(daemon, "wyoming")
        c = AsyncTcpClient(host, port)
        await c.connect()
        try:
            await c.write_event(AudioStart(rate=16000, width=2, channels=1).event())
            chunk = AudioChunk(rate=16000, width=2, channels=1, audio=b"\1\0" * 16000).event()  # 1 s
            sent = 0
            with contextlib.suppress(ConnectionError):
                for _ in range(60):
                    await asyncio.wait_for(c.write_event(chunk), 30)
                    sent += 1
            event = await asyncio.wait_for(c.read_event(), 30)
            while event is not None and event.type != "error":
                event = await asyncio.wait_for(c.read_event(), 30)
            return sent, event
        finally:
            with contextlib.suppress(ConnectionError):
                await c.disconnect()

    sent, event = asyncio.run(flood())
    assert event is not None and Error.from_event(event).code == "bad_input"
    assert "over 40 s" in Error.from_event(event).text
    assert rss_mb() - before < 100
    assert settle(lambda: daemon.services.active_sessions == 0, 10)


# ---------------------------------------------------------------------------- HTTP: bounded bodies


def _multipart(parts, boundary: str = "b0undary"):
    """A multipart body of `parts` (name, bytes or an iterable of byte chunks), chunk by chunk, sent chunked (no
    Content-Length): the test never holds a large body, so this process's RSS growth is the daemon's."""
    for name, value in parts:
        yield (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\""
               + ("; filename=\"a.wav\"" if name == "file" else "") + "\r\n\r\n").encode()
        yield from ([value] if isinstance(value, bytes) else value)
        yield b"\r\n"
    yield f"--{boundary}--\r\n".encode()


def _repeat(byte: bytes, n: int, chunk: int = 1 << 20):
    """`n` bytes of `byte`, a chunk at a time."""
    for start in range(0, n, chunk):
        yield byte * min(chunk, n - start)


def _gzip(chunks) -> bytes:
    z = zlib.compressobj(1, zlib.DEFLATED, 31)  # 31: gzip's header and trailer
    return b"".join(z.compress(c) for c in chunks) + z.flush()


def test_uploads_are_bounded_by_what_is_read_whatever_the_headers_say(daemon):
    url = f"http://{daemon.services.doors['http']}/v1/audio/transcriptions"
    limit = daemon.services.config.http.max_upload_bytes
    ctype = {"Content-Type": "multipart/form-data; boundary=b0undary"}
    before = rss_mb()
    with httpx.Client(timeout=30) as c:
        # Compressed: refused before a byte is unpacked (this one unpacks to 30 MB).
        bomb = _gzip(_multipart([("prompt", _repeat(b"a", 30 << 20))]))
        r = c.post(url, content=bomb, headers={**ctype, "Content-Encoding": "gzip"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_content_encoding"
        # Chunked (no Content-Length): many fields, each within the field limit.
        r = c.post(url, content=_multipart([("prompt", b"a" * 60000)] * 100), headers=ctype)
        assert r.status_code == 400 and "http.max_form_fields" in r.json()["error"]["message"]
        # Chunked: a file over the limit, counted as it is read.
        r = c.post(url, content=_multipart([("file", _repeat(b"\0", limit + 1))]), headers=ctype)
        assert r.status_code == 413 and "http.max_upload_bytes" in r.json()["error"]["message"]
        # Chunked: a text field over its limit.
        r = c.post(url, content=_multipart([("prompt", _repeat(b"a", 1 << 20))]), headers=ctype)
        assert r.status_code == 413 and "'prompt' is over 65536 bytes" in r.json()["error"]["message"]
        # A compressed part inside an uncompressed body.
        body = (b"--b0undary\r\nContent-Disposition: form-data; name=\"prompt\"\r\nContent-Encoding: gzip\r\n\r\n"
                + _gzip(_repeat(b"a", 5 << 20)) + b"\r\n--b0undary--\r\n")
        r = c.post(url, content=body, headers=ctype)
        assert r.status_code == 415 and "send it uncompressed" in r.json()["error"]["message"]
        assert c.get(f"http://{daemon.services.doors['http']}/readyz").status_code == 200
    assert rss_mb() - before < 100


def test_a_body_that_trickles_past_its_deadline_is_408(daemon):
    url = f"http://{daemon.services.doors['http']}/v1/audio/speech"
    daemon.services.config.http.body_timeout_s, old = 1.0, daemon.services.config.http.body_timeout_s

    async def slow():
        yield b'{"model": "tts-1",'
        await asyncio.sleep(3)
        yield b'"input": "hi"}'

    async def go():
        async with httpx.AsyncClient(timeout=10) as c:
            return await c.post(url, content=slow(), headers={"Content-Type": "application/json"})

    try:
        r = asyncio.run(go())
    finally:
        daemon.services.config.http.body_timeout_s = old
    assert r.status_code == 408 and "http.body_timeout_s" in r.json()["error"]["message"]


# ---------------------------------------------------------------------------- types at the edge


@pytest.mark.parametrize("body,words", [
    ({"model": "tts-1", "input": "hi", "response_format": ["mp3"]}, "response_format must be a string, not an array"),
    ({"model": "tts-1", "input": "hi", "response_format": {"a": 1}}, "response_format must be a string"),
    ({"model": "tts-1", "input": ["hi"]}, "input must be a string"),
    ({"model": "tts-1", "input": "hi", "speed": "fast"}, "speed must be a number"),
    ({"model": 7, "input": "hi"}, "model must be a string"),
    ("[" * 50000, "not valid JSON (nested too deeply)"),
])
def test_speech_fields_of_the_wrong_type_are_a_400(daemon, caplog, body, words):
    url = f"http://{daemon.services.doors['http']}/v1/audio/speech"
    content = body if isinstance(body, str) else json.dumps(body)
    with caplog.at_level(logging.INFO):
        r = httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


def _start(sid: str = "MZ1", **start) -> str:
    return json.dumps({"event": "start", "streamSid": sid, "start": {"streamSid": sid, "callSid": "CA1", **start}})


@pytest.mark.parametrize("message,words", [
    (_start(mediaFormat="audio/x-mulaw"), "start.mediaFormat must be an object"),
    (_start(mediaFormat={"encoding": ["audio/x-mulaw"]}), "mediaFormat.encoding must be a string"),
    (_start(mediaFormat={"encoding": "audio/x-mulaw", "sampleRate": "8000"}), "mediaFormat.sampleRate must be"),
    (_start(customParameters=["token"]), "missing or wrong token"),  # before authentication
    (_start(customParameters="token"), "missing or wrong token"),
    (_start(sid="MZ" + "x" * 400_000), "streamSid is 400002 characters; send at most 128"),
    ("[" * 50000, "not JSON"),
])
def test_media_ws_fields_of_the_wrong_type_close_1008_without_an_error_in_the_log(daemon, caplog, message, words):
    url = f"ws://{daemon.services.doors['media_ws']}/media"

    async def go():
        async with ws_connect(url, max_size=None) as ws:
            await ws.send(message)
            with contextlib.suppress(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            return ws.close_code, ws.close_reason

    with server_limits(daemon, auth_token="secret" if "token" in words else ""), caplog.at_level(logging.INFO):
        code, reason = asyncio.run(go())
    assert code in (1007, 1008) and words in reason, (code, reason)
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert all(len(rec.getMessage()) < 2000 for rec in caplog.records)  # ids are cut in log lines


def test_media_ws_without_a_start_message_closes_1008(daemon):
    async def go():
        async with ws_connect(f"ws://{daemon.services.doors['media_ws']}/media") as ws:
            await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            start = time.monotonic()
            with contextlib.suppress(websockets.ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            return ws.close_code, ws.close_reason, time.monotonic() - start

    code, reason, took = asyncio.run(go())
    assert code == 1008 and "no start message within 1 s (server.handshake_timeout_s)" in reason
    assert took < HANDSHAKE_S + SLACK_S


def test_a_grpc_session_id_over_its_bound_is_refused(daemon, caplog):
    with grpc.insecure_channel(daemon.address) as ch, caplog.at_level(logging.INFO):
        stub = pb_grpc.VoicedStub(ch)
        config = pb.SessionConfig(session_id="s" * 500_000,
                                  input_format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.StreamingRecognize(iter([pb.SessionRequest(config=config)]), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "config.session_id is 500000 characters; send at most 128" in e.value.details()
    assert all(len(rec.getMessage()) < 2000 for rec in caplog.records)


# ---------------------------------------------------------------------------- Realtime: the place is held to limits


def _realtime(daemon) -> str:
    return f"ws://{daemon.services.doors['http']}/v1/realtime"


async def _until_closed(ws) -> list[dict]:
    events = []
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            events.append(json.loads(await asyncio.wait_for(ws.recv(), 30)))
    return events


def test_realtime_a_silent_connection_gives_its_place_back_within_the_idle_limit(daemon):
    """Four sockets that send nothing but pings held every place for minutes: now the first message is
    due within the handshake limit and each next within server.idle_timeout_s, or error and close 1008."""

    async def go():
        async with ws_connect(_realtime(daemon)) as silent, ws_connect(_realtime(daemon)) as configured:
            await configured.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
            start = time.monotonic()
            first, second = await asyncio.gather(_until_closed(silent), _until_closed(configured))
            return first, second, silent.close_code, configured.close_code, time.monotonic() - start

    with server_limits(daemon, idle_timeout_s=1.5):
        first, second, code1, code2, took = asyncio.run(go())
    errors = [e for e in first + second if e["type"] == "error"]
    assert [e["error"]["code"] for e in errors] == ["idle_timeout", "idle_timeout"]
    assert any("server.handshake_timeout_s" in e["error"]["message"] for e in errors)
    assert any("server.idle_timeout_s" in e["error"]["message"] for e in errors)
    assert code1 == code2 == 1008 and took < 1.5 + 2 * SLACK_S
    assert settle(lambda: daemon.services.active_sessions == 0, 5)


def test_realtime_a_format_of_the_wrong_type_is_an_error_event_and_the_connection_goes_on(daemon, caplog):
    async def go():
        async with ws_connect(_realtime(daemon)) as ws:
            await ws.recv()  # session.created
            await ws.send(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"format": {"type": ["audio/pcm"]}}}}}))
            bad = json.loads(await ws.recv())
            await ws.send("[" * 50000)
            deep = json.loads(await ws.recv())
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
            good = json.loads(await ws.recv())
            return bad, deep, good

    with caplog.at_level(logging.INFO):
        bad, deep, good = asyncio.run(go())
    assert bad["type"] == "error" and bad["error"]["code"] == "invalid_type"
    assert bad["error"]["param"] == "session.audio.input.format.type"
    assert deep["type"] == "error" and deep["error"]["code"] == "invalid_json"
    assert good["type"] == "session.updated"
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


# ---------------------------------------------------------------------------- metrics, drain, manifest


def test_metrics_are_served_by_the_bounded_listener(daemon):
    threads = threading.active_count()
    socks = [socket.create_connection(address(daemon, "metrics")) for _ in range(50)]
    with httpx.Client() as c:
        r = c.get(f"http://127.0.0.1:{address(daemon, 'metrics')[1]}/metrics")
    assert r.status_code == 200 and "voiced_sessions_active" in r.text
    assert threading.active_count() <= threads + 2  # no thread per connection
    for s in socks:
        s.close()


def test_the_k8s_manifest_exposes_no_door_without_the_token():
    import tomllib
    import yaml

    docs = list(yaml.safe_load_all((ROOT / "deploy" / "k8s" / "voiced.yaml").read_text()))
    config = tomllib.loads(docs[0]["data"]["voiced.toml"])
    assert not config["server"]["metrics_listen"].startswith("0.0.0.0")
    assert "audiosocket" not in config["doors"] and "wyoming" not in config["doors"]  # no auth in their protocols
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    env = {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    token = env["VOICED_SERVER_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert not token.get("optional", False)


def test_during_a_drain_readyz_answers_503_and_a_live_call_finishes(tmp_path):
    config = daemon_config()
    config.doors.http = "127.0.0.1:0"
    d = start_daemon(make_openai_checkpoint(tmp_path / "whisper", seed=3), config)
    url = f"http://{d.services.doors['http']}"

    async def go():
        async with ws_connect(url.replace("http", "ws") + "/v1/realtime") as live:
            await live.recv()
            drain = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(d.server.drain_and_stop(grace=60), d.loop))
            while not d.services.draining:
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient() as c:
                ready = await c.get(url + "/readyz")
                health = await c.get(url + "/healthz")
                work = await c.get(url + "/v1/models")
        await drain
        return ready, health, work

    try:
        ready, health, work = asyncio.run(go())
    finally:
        d.stop()
    assert ready.status_code == 503 and ready.json() == {"status": "draining"}
    assert health.status_code == 200
    assert work.status_code == 200  # reading the model list is no new work; new sessions are refused


def test_the_wyoming_describe_of_another_caller_is_served_meanwhile(daemon):
    """While connections are refused and closed around it, a well-behaved caller is served."""
    async def go():
        host, port = address(daemon, "wyoming")
        async with AsyncTcpClient(host, port) as c:
            await c.write_event(Describe().event())
            return await asyncio.wait_for(c.read_event(), 10)

    assert asyncio.run(go()).type == "info"
    assert serving(daemon)


def test_the_drains_end_transcribes_the_utterance_in_progress_before_closing_the_call(tmp_path):
    """A call still talking when the drain's grace runs out: its input is ended as a hang-up would end it,
    so the words in progress come back as a final transcript and the call ends OK, not UNAVAILABLE."""
    from tests.daemon_harness import frames_of, session_config, wire_audio
    from tests.speech import phrase
    from voiced.audio.ingest import Format

    d = start_daemon(make_openai_checkpoint(tmp_path / "whisper", seed=3), daemon_config())
    fmt = Format("LINEAR16", 16000)
    speech = wire_audio(phrase("Turn on the kitchen lights please."), fmt)  # no trailing silence: in progress
    held = threading.Event()

    def requests():
        yield pb.SessionRequest(config=session_config(fmt))
        for frame in frames_of(speech, fmt):
            yield pb.SessionRequest(audio=frame)
        held.set()
        time.sleep(30)  # the caller keeps the stream open: only the drain's end can end its input

    result: dict = {}

    def call():
        with grpc.insecure_channel(d.address) as ch:
            stream = pb_grpc.VoicedStub(ch).StreamingRecognize(requests(), timeout=60)
            events = []
            try:
                for ev in stream:
                    events.append(ev)
                result["status"] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                result["status"] = e.code()
            result["events"] = events

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    try:
        assert held.wait(30)
        assert settle(lambda: d.services.active_sessions == 1, 10)
        asyncio.run_coroutine_threadsafe(d.server.drain_and_stop(grace=0.3), d.loop).result(60)
        caller.join(30)
    finally:
        d.stop()
    finals = [e for e in result["events"] if e.WhichOneof("event") == "transcript" and e.transcript.is_final]
    assert result["status"] == grpc.StatusCode.OK and len(finals) == 1 and finals[0].transcript.text.strip()


def test_what_a_wyoming_caller_sends_is_cut_in_the_log(daemon, caplog):
    """A 500 KB language name: refused with an error event; no log line holds it whole."""
    data = json.dumps({"language": "x" * 500_000}).encode()
    s = socket.create_connection(address(daemon, "wyoming"))
    with caplog.at_level(logging.DEBUG, logger="voiced.doors"):
        s.sendall(json.dumps({"type": "transcribe", "data_length": len(data)}).encode() + b"\n" + data)
        got = closed_by_server(s, 10)
    s.close()
    assert got is not None and b'"error"' in got
    assert caplog.records and all(len(rec.getMessage()) < 2000 for rec in caplog.records)


def test_metrics_are_behind_the_token_where_one_is_set(tmp_path):
    config = daemon_config()
    config.server.auth_token = "t0ken"
    config.server.metrics_listen = "127.0.0.1:0"
    d = start_daemon(make_openai_checkpoint(tmp_path / "whisper", seed=3), config)
    try:
        url = f"http://127.0.0.1:{d.server._metrics_http.port}/metrics"
        refused = httpx.get(url)
        served = httpx.get(url, headers={"Authorization": "Bearer t0ken"})
    finally:
        d.stop()
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert served.status_code == 200 and "voiced_sessions_active" in served.text
