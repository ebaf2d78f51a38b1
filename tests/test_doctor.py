"""`voiced doctor` on a machine like a newcomer's: no GPU, a cache holding only what PyPI gives, no
Spark-TTS. It is a healthy listening-only set-up, so the doctor exits 0, reports the PyPI copy as the
model `voiced serve` runs, and prints no GPU memory table."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from voiced.cli import doctor


@pytest.fixture
def cpu_machine(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("VOICED_CACHE", str(tmp_path / "cache"))
    for name in [n for n in os.environ if n.startswith("VOICED_") and n != "VOICED_CACHE"]:
        monkeypatch.delenv(name)
    return tmp_path / "cache"


def _doctor(capsys, config: str | None = None) -> tuple[int, str]:
    rc = doctor.run(argparse.Namespace(config=config))
    return rc, capsys.readouterr().out


def _pypi_base(cache):
    base = cache / "whisper" / "base-pypi"
    base.mkdir(parents=True)
    (base / "model.bin").touch()  # resolve() only asks whether the directory is there
    return base


def test_a_listening_only_cpu_with_the_pypi_whisper_is_healthy(cpu_machine, capsys):
    base = _pypi_base(cpu_machine)
    rc, out = _doctor(capsys)
    assert rc == 0, out
    assert "[FAIL]" not in out
    asr = next(line for line in out.splitlines() if "ASR model" in line)
    assert asr.startswith("[ok  ] ASR model base:") and "base-pypi" in asr and str(base) in asr, asr
    assert "not in the cache" not in asr
    tts = next(line for line in out.splitlines() if "TTS model" in line)
    # A CPU speaks with a Piper voice, fetched on first run; the licences are stated.
    assert tts.startswith("[--  ]") and "voiced models pull piper:en_US-joe-medium" in tts, tts
    assert "espeak-ng is GPL" not in out and "the espeak-ng program (GPL-3.0-or-later) as a separate process" in out
    assert "GPU memory shares" not in out and "kv_cache_free_gpu_memory_fraction" not in out
    assert "no GPU: nothing to share out" in out


def test_no_tts_is_said_as_the_users_choice(cpu_machine, capsys, tmp_path):
    _pypi_base(cpu_machine)
    toml = tmp_path / "voiced.toml"
    toml.write_text("[tts]\nenabled = false\n")
    rc, out = _doctor(capsys, str(toml))
    assert rc == 0, out
    assert "speech synthesis off (--no-tts or tts.enabled = false)" in out


def test_a_model_path_that_is_not_there_is_a_failure(cpu_machine, capsys, tmp_path):
    toml = tmp_path / "voiced.toml"
    toml.write_text(f"[asr]\nmodel = \"{tmp_path / 'nowhere.pt'}\"\n[tts]\nmodel = \"{tmp_path / 'no-spark'}\"\n")
    rc, out = _doctor(capsys, str(toml))
    assert rc == 1
    assert out.count("[FAIL]") == 2 and "nowhere.pt" in out and "no-spark" in out


def test_the_default_not_yet_fetched_is_no_failure(cpu_machine, capsys):
    rc, out = _doctor(capsys)
    assert rc == 0, out
    assert "[--  ] ASR model base: not in the cache yet: `voiced serve` fetches it on first run" in out
