"""Scale-out behind a real gRPC-aware balancer: the shipped HAProxy configuration, unchanged, in front
of two `voiced serve` processes on the CPU.

What an operator of a call center relies on, checked end to end: calls spread over both daemons
(least connections), a daemon drained mid-run cuts none of its live calls while new calls go to the
other one, and a daemon that comes back is put back into rotation by the health check.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc

from tests.daemon_harness import frames_of, session_config, wire_audio
from tests.speech import layout
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.audio.ingest import Format

ROOT = Path(__file__).resolve().parent.parent
HAPROXY_CFG = ROOT / "deploy" / "haproxy" / "haproxy.cfg"
CALLS = 40
# Only a guard against a hang: a call held open and then streamed in real time can take minutes on a
# loaded 2-core machine; an unfinished call fails the test with its status (None).
GUARD_S = 300
FMT = Format("LINEAR16", 16000)

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None,
                                reason="haproxy is not installed (make test installs it with apt)")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_free_on(port: int, *hosts: str) -> bool:
    for host in hosts:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def common_port(*hosts: str) -> int:
    """A port free on every host: the shipped config gives both daemons the same ports."""
    while True:
        port = free_port(hosts[0])
        if port_free_on(port, *hosts):
            return port


class Daemon:
    def __init__(self, host: str, grpc_port: int, http_port: int, checkpoint: Path, log_dir: Path):
        self.host, self.grpc_port, self.http_port = host, grpc_port, http_port
        self.address = f"{host}:{grpc_port}"
        self.checkpoint, self.log_dir = checkpoint, log_dir
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        log = open(self.log_dir / f"voiced-{self.host}.log", "a")  # noqa: SIM115 - the process keeps it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "voiced", "serve", "--asr-model", str(self.checkpoint), "--no-tts",
             "--device", "cpu", "--listen", self.address, "--http", f"{self.host}:{self.http_port}",
             "--max-sessions", "100"],
            # A drain lets live calls finish for this long (the Kubernetes manifest gives 600 s); the
            # default 30 s can run out on a loaded 2-core machine while the test holds calls open.
            env=dict(os.environ, VOICED_SERVER_DRAIN_SECONDS="300"),
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://{self.host}:{self.http_port}/readyz", timeout=2).status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready():
            assert self.proc.poll() is None, f"voiced serve on {self.address} exited; see {self.log_dir}"
            assert time.monotonic() < deadline, f"voiced serve on {self.address} not ready in {timeout} s"
            time.sleep(0.2)

    def active_sessions(self) -> int:
        with grpc.insecure_channel(self.address) as channel:
            return pb_grpc.VoicedStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=5).active_sessions

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Balancer:
    def __init__(self, env: dict[str, str], tmp: Path):
        self.sock = tmp / "haproxy.sock"
        # The shipped file unchanged, plus an admin socket to read the servers' state.
        extra = tmp / "test-admin.cfg"
        extra.write_text(f"global\n    stats socket {self.sock} level admin\n")
        subprocess.run(["haproxy", "-c", "-q", "-f", str(HAPROXY_CFG), "-f", str(extra)], env=env, check=True)
        self.proc = subprocess.Popen(["haproxy", "-f", str(HAPROXY_CFG), "-f", str(extra)], env=env,
                                     stdout=open(tmp / "haproxy.log", "w"), stderr=subprocess.STDOUT)

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.sock))
            s.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def status(self, server: str) -> str:
        """UP, DOWN, ... of one server of the gRPC backend."""
        for row in self.command("show stat").splitlines():
            fields = row.split(",")
            if len(fields) > 17 and fields[0] == "voiced_grpc" and fields[1] == server:
                return fields[17].split()[0]
        return "?"

    def wait_status(self, server: str, want: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        now = "not started"
        while True:
            assert self.proc.poll() is None, f"haproxy exited with {self.proc.returncode}; see haproxy.log"
            if os.path.exists(self.sock):
                now = self.status(server)
                if now == want:
                    return
            assert time.monotonic() < deadline, f"HAProxy never saw {server} {want} (now {now})"
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


class Call(threading.Thread):
    """One caller through the balancer: config, then real-time 20 ms frames; the events and status."""

    def __init__(self, address: str, frames: list[bytes], hold: threading.Event | None = None):
        super().__init__(daemon=True)
        self.address, self.frames, self.hold = address, frames, hold
        self.events: list[pb.SessionEvent] = []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.started = threading.Event()

    def requests(self):
        yield pb.SessionRequest(config=session_config(FMT))
        for i, frame in enumerate(self.frames):
            if i == len(self.frames) // 2 and self.hold is not None:
                self.hold.wait(60)  # keep the call open mid-utterance while the test acts
            yield pb.SessionRequest(audio=frame)
            time.sleep(0.02)

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            try:
                for ev in pb_grpc.VoicedStub(channel).StreamingRecognize(self.requests()):
                    if ev.WhichOneof("event") == "started":
                        self.started.set()
                    self.events.append(ev)
                self.code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                self.code, self.details = e.code(), e.details()
            finally:
                self.started.set()

    def finals(self) -> int:
        return sum(1 for e in self.events if e.WhichOneof("event") == "transcript" and e.transcript.is_final)


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


@pytest.mark.slow
def test_two_daemons_behind_haproxy_spread_drain_and_return(tmp_path):
    ckpt = make_openai_checkpoint(tmp_path, seed=3)
    hosts = ("127.0.0.1", "127.0.0.2")
    grpc_port, http_port = common_port(*hosts), common_port(*hosts)
    lb_port = free_port()
    a, b = (Daemon(h, grpc_port, http_port, ckpt, tmp_path) for h in hosts)
    env = dict(os.environ, VOICED_1=hosts[0], VOICED_2=hosts[1], VOICED_GRPC_PORT=str(grpc_port),
               VOICED_HTTP_PORT=str(http_port), VOICED_LB_GRPC=f"127.0.0.1:{lb_port}",
               VOICED_AUDIOSOCKET_PORT=str(common_port(*hosts)), VOICED_WYOMING_PORT=str(common_port(*hosts)),
               VOICED_LB_AUDIOSOCKET=f"127.0.0.1:{free_port()}", VOICED_LB_WYOMING=f"127.0.0.1:{free_port()}")
    lb = None
    calls: list[Call] = []
    try:
        a.wait_ready()
        b.wait_ready()
        lb = Balancer(env, tmp_path)
        lb.wait_status("voiced1", "UP")
        lb.wait_status("voiced2", "UP")
        front = f"127.0.0.1:{lb_port}"
        frames = frames_of(wire_audio(layout(["Please call me back tomorrow morning."], lead_s=0.3, tail_s=0.8).audio,
                                      FMT), FMT)

        # 40 live calls, all held open mid-utterance: least connections spreads them over both.
        hold = threading.Event()
        calls = [Call(front, frames, hold) for _ in range(CALLS)]
        for c in calls:
            c.start()
        for c in calls:
            assert c.started.wait(60)
        wait_until(lambda: a.active_sessions() + b.active_sessions() == CALLS, 30,
                   "the daemons never held all 40 calls")
        on_a, on_b = a.active_sessions(), b.active_sessions()
        assert min(on_a, on_b) >= CALLS // 4, f"calls not spread: {on_a} on one daemon, {on_b} on the other"

        # Drain A mid-run: health turns it away, its live calls go on.
        a.proc.send_signal(signal.SIGTERM)
        lb.wait_status("voiced1", "DOWN")
        newcomers = [Call(front, frames) for _ in range(10)]
        for c in newcomers:
            c.start()
        for c in newcomers:
            c.join(GUARD_S)
        assert [c.code for c in newcomers] == [grpc.StatusCode.OK] * 10, [c.details for c in newcomers]
        assert all(c.finals() == 1 for c in newcomers)
        assert a.active_sessions() == on_a, "the drained daemon took new calls"
        hold.set()
        for c in calls:
            c.join(GUARD_S)
        cut = [(c.code, c.details) for c in calls if c.code != grpc.StatusCode.OK or c.finals() != 1]
        assert not cut, f"{len(cut)} live calls were cut by the drain: {cut[:3]}"
        assert a.proc.wait(60) == 0, "the drained daemon did not exit cleanly"

        # A comes back: the health check returns it to rotation and it takes calls again.
        a.start()
        a.wait_ready()
        lb.wait_status("voiced1", "UP")
        hold2 = threading.Event()
        again = [Call(front, frames, hold2) for _ in range(6)]
        for c in again:
            c.start()
        for c in again:
            assert c.started.wait(60)
        wait_until(lambda: a.active_sessions() + b.active_sessions() == 6, 30, "the returning calls never arrived")
        assert a.active_sessions() >= 2, "the returned daemon got no calls"
        hold2.set()
        for c in again:
            c.join(GUARD_S)
        assert all(c.code == grpc.StatusCode.OK for c in again), [(c.code, c.details) for c in again]
    finally:
        for c in calls:
            if c.hold is not None:
                c.hold.set()
        if lb is not None:
            lb.stop()
        a.stop()
        b.stop()
