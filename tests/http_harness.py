"""A real daemon with the HTTP door open, tiny random Whisper and Spark-TTS checkpoints, for the tests
of the OpenAI-compatible API, the Realtime WebSocket and the web page."""

from __future__ import annotations

from pathlib import Path

from tests.daemon_harness import Daemon, daemon_config, start_daemon
from tests.spark_fixtures import cached_spark_checkpoint
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.config import Config

REPLY_S = 0.6  # cap on each reply: random LMs never stop on their own
UPLOAD_LIMIT = 2 * 1024 * 1024
INPUT_CHARS = 300


_WHISPER: dict[int, Path] = {}


def make_models(tmp_path_factory) -> tuple[Path, Path]:
    """Tiny random Whisper and Spark-TTS checkpoints, built once per test session."""
    if 3 not in _WHISPER:
        _WHISPER[3] = make_openai_checkpoint(tmp_path_factory.mktemp("whisper"), seed=3)
    return _WHISPER[3], cached_spark_checkpoint(tmp_path_factory, seed=0)


def http_config(**server) -> Config:
    config = daemon_config()
    config.doors.http = "127.0.0.1:0"
    config.tts.enabled = True
    config.tts.first_chunk_tokens = 5
    config.tts.chunk_tokens = 10
    config.tts.max_seconds = REPLY_S
    config.http.max_upload_bytes = UPLOAD_LIMIT
    config.http.max_input_chars = INPUT_CHARS
    for key, value in server.items():
        setattr(config.server, key, value)
    return config


def start_http_daemon(models: tuple[Path, Path], voices_dir: Path, config: Config | None = None) -> Daemon:
    from voiced.engines.spark.engine import SparkTTSEngine

    whisper, spark = models
    tts = SparkTTSEngine.load(str(spark), device="cpu", max_batch=4, voices_dir=voices_dir)
    return start_daemon(whisper, config or http_config(), tts_engine=tts)


def base_url(daemon: Daemon, scheme: str = "http") -> str:
    return f"{scheme}://{daemon.services.doors['http']}"
