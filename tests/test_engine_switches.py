"""The engines' environment switches (VOICED_WHISPER_..., VOICED_SPARK_..., VOICED_PINNED_STAGING_RING): 1 on, 0 off,
unset or empty the default; a misspelt value is refused with the variable's name, where before some switches
took "on" or "true" as off and others as on, and a run measured something other than what was asked."""

from __future__ import annotations

import pytest

from tests.whisper_fixtures import make_openai_checkpoint
from voiced.engines.switches import env_switch


def test_a_switch_is_1_or_0_or_its_default(monkeypatch):
    monkeypatch.delenv("VOICED_TEST_SWITCH", raising=False)
    assert env_switch("VOICED_TEST_SWITCH", True) is True and env_switch("VOICED_TEST_SWITCH", False) is False
    for value, want in (("1", True), ("0", False), (" 1\n", True), ("", False)):
        monkeypatch.setenv("VOICED_TEST_SWITCH", value)
        assert env_switch("VOICED_TEST_SWITCH", False) is want, value
    for value in ("on", "true", "yes", "2", "off"):
        monkeypatch.setenv("VOICED_TEST_SWITCH", value)
        with pytest.raises(ValueError, match=f"VOICED_TEST_SWITCH='{value}': use 1 \\(on\\) or 0 \\(off\\)"):
            env_switch("VOICED_TEST_SWITCH", True)


@pytest.mark.parametrize("name", ["VOICED_WHISPER_PREFILL_GRAPHS", "VOICED_WHISPER_CROSS_IN_ENCODER",
                                  "VOICED_WHISPER_CHUNK_GRAPHS", "VOICED_WHISPER_ALIGN_GRAPHS",
                                  "VOICED_WHISPER_GEMV_DECODER", "VOICED_WHISPER_COMPILED_TAIL"])
def test_loading_whisper_with_a_misspelt_switch_says_which(name, monkeypatch, tmp_path):
    from voiced.engines.whisper.engine import WhisperEngine

    ckpt = make_openai_checkpoint(tmp_path, seed=4)
    monkeypatch.setenv(name, "true")
    with pytest.raises(ValueError, match=name):
        WhisperEngine.load(ckpt, max_batch=2)
    monkeypatch.setenv(name, "0")
    assert WhisperEngine.load(ckpt, max_batch=2).max_batch == 2
