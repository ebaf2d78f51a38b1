"""The real Smart Turn v3.2 model for tests (BSD-2-Clause, Daily; the ONNX file inside PyPI's pipecat-ai
1.14.0 wheel), pulled once into `.devdata/voiced-cache` (`VOICED_TEST_CACHE` moves it) as
`voiced models pull smart-turn-v3-pypi` pulls it."""

from __future__ import annotations

from pathlib import Path

from tests.real_whisper import CACHE


def smart_turn_path() -> Path:
    from voiced.engines import smart_turn

    smart_turn.pull(smart_turn.PYPI_NAME, CACHE)  # a no-op when the file is there
    return smart_turn.resolve(smart_turn.PYPI_NAME, CACHE)
