"""The hostile-client attack on every door of a real `voiced serve --device cpu`, bounded in time and size,
as docs/BAD_INPUT.md ("Hostile clients") describes it; run once with defaults, once with a token and TLS:

    .venv/bin/python -m tests.attack_doors [--per-door 300]

Every door on loopback, max_sessions 4, idle_timeout_s 5, handshake_timeout_s 3. Meanwhile a sampler
reads the daemon's RSS and open descriptors (/proc/PID) and its gRPC health every 0.2 s, and another
caller (a Wyoming describe and a gRPC health check) is served once a second. Prints one line per case
and a verdict: each case answered as built, RSS within 150 MB of its baseline, idle and unfinished
connections closed within their deadlines, health SERVING throughout, the other caller always served.
Not a test module (no test_ prefix): it takes about a minute a configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import json
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc

HANDSHAKE_S, IDLE_S = 3.0, 5.0
TOKEN = "attack-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Daemon:
    def __init__(self, workdir: Path, tls: bool):
        from tests.real_whisper import tiny_en_dir

        self.ports = {k: free_port() for k in ("grpc", "http", "media_ws", "wyoming", "audiosocket", "metrics")}
        args = [sys.executable, "-m", "voiced", "serve", "--device", "cpu", "--no-tts", "--asr-model",
                str(tiny_en_dir()), "--turn-detection", "silence", "--max-sessions", "4",
                "--handshake-timeout", str(HANDSHAKE_S), "--listen", f"127.0.0.1:{self.ports['grpc']}",
                "--http", f"127.0.0.1:{self.ports['http']}", "--media-ws", f"127.0.0.1:{self.ports['media_ws']}",
                "--wyoming", f"tcp://127.0.0.1:{self.ports['wyoming']}",
                "--audiosocket", f"127.0.0.1:{self.ports['audiosocket']}",
                "--metrics-listen", f"127.0.0.1:{self.ports['metrics']}"]
        env = dict(os.environ, VOICED_SERVER_IDLE_TIMEOUT_S=str(IDLE_S), VOICED_CACHE=str(workdir / "cache"))
        self.tls = tls
        self.ctx: ssl.SSLContext | None = None
        if tls:
            key, cert = workdir / "key.pem", workdir / "cert.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                            str(cert), "-days", "1", "-subj", "/CN=localhost", "-addext",
                            "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
            env.update(VOICED_SERVER_AUTH_TOKEN=TOKEN, VOICED_SERVER_TLS_CERT=str(cert), VOICED_SERVER_TLS_KEY=str(key))
            self.ctx = ssl.create_default_context(cafile=str(cert))
            self.cert = cert.read_bytes()
        self.log = workdir / f"serve-{'tls' if tls else 'plain'}.log"
        self.proc = subprocess.Popen(args, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + 300
        while self.health() != health_pb2.HealthCheckResponse.SERVING:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the daemon did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.3)

    def channel(self):
        target = f"127.0.0.1:{self.ports['grpc']}"
        if self.tls:
            return grpc.secure_channel(target, grpc.ssl_channel_credentials(self.cert))
        return grpc.insecure_channel(target)

    def metadata(self):
        return [("authorization", f"Bearer {TOKEN}")] if self.tls else None

    def health(self):
        try:
            with self.channel() as ch:
                return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3).status
        except grpc.RpcError:
            return None

    def fds(self) -> int:
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def rss(self) -> float:
        return proc_rss_mb(self.proc.pid)

    def http(self, door: str = "http") -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.ports[door]}"

    def stop(self):
        self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)
        if self.proc.poll() is None:
            self.proc.kill()


class Watch:
    """RSS, descriptors, health and another caller, sampled while the attack runs."""

    def __init__(self, d: Daemon):
        self.d, self.stop_at = d, threading.Event()
        self.rss, self.fds, self.not_serving, self.other_failed, self.other_ok = [], [], 0, 0, 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        last_other = 0.0
        while not self.stop_at.is_set():
            self.rss.append(self.d.rss())
            self.fds.append(self.d.fds())
            if self.d.health() != health_pb2.HealthCheckResponse.SERVING:
                self.not_serving += 1
            if time.monotonic() - last_other > 1.0:
                last_other = time.monotonic()
                ok = asyncio.run(wyoming_describe(self.d))
                self.other_ok += ok
                self.other_failed += not ok
            time.sleep(0.2)

    def close(self):
        self.stop_at.set()
        self.thread.join(10)


async def wyoming_describe(d: Daemon) -> bool:
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe

    try:
        async with AsyncTcpClient("127.0.0.1", d.ports["wyoming"]) as c:
            await c.write_event(Describe().event())
            event = await asyncio.wait_for(c.read_event(), 5)
            return event is not None and event.type == "info"
    except (OSError, asyncio.TimeoutError):
        return False


def connect(d: Daemon, door: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", d.ports[door]), timeout=10)
    if d.tls and door in ("http", "media_ws", "metrics"):
        s = d.ctx.wrap_socket(s, server_hostname="127.0.0.1")
    return s


def wait_closed(socks: list[socket.socket], within: float) -> int:
    """How many of `socks` the server closed within `within` seconds."""
    end, closed = time.monotonic() + within, 0
    for s in socks:
        s.settimeout(max(0.01, end - time.monotonic()))
        try:
            while s.recv(65536):
                pass
            closed += 1
        except TimeoutError:
            pass
        except OSError:
            closed += 1
        s.close()
    return closed


# ---------------------------------------------------------------------------- the cases


def case_idle_and_slowloris(d: Daemon, per_door: int) -> str:
    socks, doors = [], ("http", "media_ws", "wyoming", "audiosocket", "metrics")
    for door in doors:
        for i in range(per_door):
            with contextlib.suppress(OSError):
                s = connect(d, door)
                if i % 10 == 0 and door != "audiosocket":  # a tenth: a header byte now and then
                    s.send(b"GET / HTTP/1.1\r\nHost: x\r\n" if door not in ("wyoming",) else b'{"type": "desc')
                socks.append(s)
    opened = len(socks)
    closed = wait_closed(socks, HANDSHAKE_S + 4.0)
    return f"{opened} idle/slow-loris connections over {len(doors)} doors: {closed} closed within {HANDSHAKE_S + 4:g} s"


def case_wyoming_gigabyte(d: Daemon) -> str:
    s = connect(d, "wyoming")
    s.sendall(b'{"type": "audio-chunk", "data": {"rate": 16000, "width": 2, "channels": 1}, '
              b'"payload_length": 1000000000}\n')
    sent, block = 0, b"\0" * (1 << 20)
    with contextlib.suppress(OSError):
        while sent < 300 << 20:
            sent += s.send(block)
    answer = b""
    with contextlib.suppress(OSError):
        s.settimeout(5)
        while chunk := s.recv(65536):
            answer += chunk
    s.close()
    said = "payload_length of 1000000000 bytes" in answer.decode(errors="replace")
    return f"Wyoming payload_length 1e9: error event {'yes' if said else 'NO'}, closed after {sent >> 20} MB sent"


def case_wyoming_flood(d: Daemon) -> str:
    from wyoming.audio import AudioChunk, AudioStart
    from wyoming.client import AsyncTcpClient

    async def go():
        c = AsyncTcpClient("127.0.0.1", d.ports["wyoming"])
        await c.connect()
        sent, start = 0, time.monotonic()
        try:
            await c.write_event(AudioStart(rate=16000, width=2, channels=1).event())
            chunk = AudioChunk(rate=16000, width=2, channels=1, audio=b"\1\0" * 16000).event()
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                while time.monotonic() - start < 10:
                    await asyncio.wait_for(c.write_event(chunk), 10)
                    sent += 1
            return sent
        finally:
            with contextlib.suppress(OSError):
                await c.disconnect()

    sent = asyncio.run(go())
    return (f"Wyoming audio at line speed for 10 s, no audio-stop: {sent} s of audio written before the refusal "
            "(600 s at most a stream; the rest sat in socket buffers)")


def case_uploads(d: Daemon) -> str:
    url = d.http() + "/v1/audio/transcriptions"
    headers = {"Content-Type": "multipart/form-data; boundary=b0"}
    if d.tls:
        headers["Authorization"] = f"Bearer {TOKEN}"
    body = b"".join(b'--b0\r\nContent-Disposition: form-data; name="prompt"\r\n\r\n' + b"a" * 60000 + b"\r\n"
                    for _ in range(2000)) + b"--b0--\r\n"
    statuses = []
    with httpx.Client(verify=d.ctx or True, timeout=60) as c:
        statuses.append(c.post(url, content=gzip.compress(body, compresslevel=1),
                               headers={**headers, "Content-Encoding": "gzip"}).status_code)
        statuses.append(c.post(url, content=(body[i:i + 65536] for i in range(0, len(body), 65536)),
                               headers=headers).status_code)
    return f"multipart 120 MB of fields, gzip then chunked: HTTP {statuses[0]}, {statuses[1]} (415, 400 expected)"


def case_realtime_places(d: Daemon) -> str:
    from websockets.asyncio.client import connect as ws_connect

    url = d.http().replace("http", "ws") + "/v1/realtime"
    kw = {"ssl": d.ctx} if d.tls else {}
    if d.tls:
        kw["additional_headers"] = {"Authorization": f"Bearer {TOKEN}"}

    async def one(configure: bool):
        async with ws_connect(url, **kw) as ws:
            if configure:
                await ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime"}}))
            start = time.monotonic()
            with contextlib.suppress(Exception):
                while True:
                    await asyncio.wait_for(ws.recv(), 60)
            return ws.close_code, time.monotonic() - start

    async def go():
        return await asyncio.gather(*(one(i % 2 == 1) for i in range(4)))

    start = time.monotonic()
    results = asyncio.run(go())
    with d.channel() as ch:
        try:
            pb_grpc.VoicedStub(ch).Recognize(pb.RecognizeRequest(
                audio=b"\0\0" * 16000, format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000)),
                timeout=30, metadata=d.metadata())
            after = "served"
        except grpc.RpcError as e:
            after = e.code().name
    return (f"4 silent Realtime sockets (max_sessions 4): closed {[c for c, _ in results]} after "
            f"{max(t for _, t in results):.1f} s (handshake {HANDSHAKE_S:g} s / idle {IDLE_S:g} s), "
            f"{time.monotonic() - start:.1f} s in all; a gRPC Recognize after: {after}")


def case_types_and_ids(d: Daemon) -> str:
    out = []
    headers = {"Content-Type": "application/json"}
    if d.tls:
        headers["Authorization"] = f"Bearer {TOKEN}"
    with httpx.Client(verify=d.ctx or True, timeout=30) as c:
        for body in ('{"model": "tts-1", "input": "hi", "response_format": ["mp3"]}', "[" * 100000):
            out.append(c.post(d.http() + "/v1/audio/speech", content=body, headers=headers).status_code)
    with d.channel() as ch:
        config = pb.SessionConfig(session_id="s" * 3_000_000,
                                  input_format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000))
        try:
            list(pb_grpc.VoicedStub(ch).StreamingRecognize(iter([pb.SessionRequest(config=config)]), timeout=30,
                                                            metadata=d.metadata()))
            out.append("OK")
        except grpc.RpcError as e:
            out.append(e.code().name)
    longest = max(len(line) for line in d.log.read_text().splitlines())
    return f"speech response_format list, JSON 1e5 deep, 3 MB gRPC session_id: {out}; longest log line {longest}"


def warm_up(d: Daemon) -> None:
    """Well-behaved callers first, so the baseline holds what serving them takes (the engine's first
    decodes size its buffers and thread pools): a 60 s one-shot recognition and 2 minutes over Wyoming."""
    import numpy as np
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient

    noise = (np.random.default_rng(0).normal(0, 3000, 16000 * 60)).astype("<i2").tobytes()
    with d.channel() as ch:
        pb_grpc.VoicedStub(ch).Recognize(pb.RecognizeRequest(
            audio=noise, format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000)),
            timeout=120, metadata=d.metadata())

    async def wyoming():
        async with AsyncTcpClient("127.0.0.1", d.ports["wyoming"]) as c:
            await c.write_event(AudioStart(rate=16000, width=2, channels=1).event())
            for _ in range(2):
                for i in range(60):
                    await c.write_event(AudioChunk(rate=16000, width=2, channels=1,
                                                   audio=noise[i * 32000:(i + 1) * 32000]).event())
            await c.write_event(AudioStop().event())
            while (event := await asyncio.wait_for(c.read_event(), 120)) is not None:
                if event.type == "transcript-stop":
                    break

    asyncio.run(wyoming())
    time.sleep(1.0)


def attack(workdir: Path, tls: bool, per_door: int) -> bool:
    d = Daemon(workdir, tls)
    try:
        warm_up(d)
        base_rss, base_fds = d.rss(), d.fds()
        watch = Watch(d)
        print(f"\n== {'token + TLS' if tls else 'defaults'}: daemon pid {d.proc.pid}, baseline RSS {base_rss:.0f} MB, "
              f"{base_fds} descriptors")
        cases = [lambda: case_idle_and_slowloris(d, per_door), lambda: case_wyoming_gigabyte(d),
                 lambda: case_wyoming_flood(d), lambda: case_uploads(d), lambda: case_realtime_places(d),
                 lambda: case_types_and_ids(d)]
        for case in cases:
            start, seen = time.monotonic(), len(watch.rss)
            said = case()
            peak = max(watch.rss[seen:] or [d.rss()]) - base_rss
            print(f"  {said}  [{time.monotonic() - start:.1f} s, RSS peak {peak:+.0f} MB]", flush=True)
        time.sleep(HANDSHAKE_S + 1)
        watch.close()
        end_rss, end_fds = d.rss(), d.fds()
        peak = max(watch.rss) - base_rss
        print(f"  RSS peak +{peak:.0f} MB, after +{end_rss - base_rss:.0f} MB; descriptors peak {max(watch.fds)}, "
              f"after {end_fds} (baseline {base_fds}); health not SERVING in {watch.not_serving} of "
              f"{len(watch.rss)} samples; the other caller served {watch.other_ok} times, failed {watch.other_failed}")
        errors = [line for line in d.log.read_text().splitlines() if " ERROR " in line or "Traceback" in line]
        print(f"  ERROR lines / tracebacks in the daemon's log: {len(errors)}" + (f": {errors[:3]}" if errors else ""))
        return (peak < 150 and end_fds <= base_fds + 10 and watch.not_serving == 0 and watch.other_failed == 0
                and not errors)
    finally:
        d.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-door", type=int, default=300, help="idle connections opened to each door")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        verdicts = [attack(Path(tmp), tls, args.per_door) for tls in (False, True)]
    print(f"\nverdict: {'PASS' if all(verdicts) else 'FAIL'} (defaults {verdicts[0]}, token+TLS {verdicts[1]})")
    sys.exit(0 if all(verdicts) else 1)


if __name__ == "__main__":
    main()
