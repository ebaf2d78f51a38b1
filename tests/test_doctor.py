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


def _doctor(capsys, toml=None, text: str = "") -> tuple[int, str]:
    """`voiced doctor`, with `text` as its config file at `toml` (a path) where given."""
    if toml is not None:
        toml.write_text(text)
    rc = doctor.run(argparse.Namespace(config=str(toml) if toml is not None else None))
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
    rc, out = _doctor(capsys, tmp_path / "voiced.toml", "[tts]\nenabled = false\n")
    assert rc == 0, out
    assert "speech synthesis off (--no-tts or tts.enabled = false)" in out


def test_a_model_path_that_is_not_there_is_a_failure(cpu_machine, capsys, tmp_path):
    rc, out = _doctor(capsys, tmp_path / "voiced.toml",
                      f"[asr]\nmodel = \"{tmp_path / 'nowhere.pt'}\"\n[tts]\nmodel = \"{tmp_path / 'no-spark'}\"\n")
    assert rc == 1
    assert out.count("[FAIL]") == 2 and "nowhere.pt" in out and "no-spark" in out


def test_the_default_not_yet_fetched_is_no_failure(cpu_machine, capsys):
    rc, out = _doctor(capsys)
    assert rc == 0, out
    assert "[--  ] ASR model base: not in the cache yet: `voiced serve` fetches it on first run" in out


def test_spark_named_for_a_cpu_without_it_is_a_failure_as_serve_stops(cpu_machine, capsys, tmp_path):
    _pypi_base(cpu_machine)
    rc, out = _doctor(capsys, tmp_path / "voiced.toml", '[tts]\nmodel = "spark-tts-0.5b"\n')
    assert rc == 1, out
    [tts] = [line for line in out.splitlines() if "TTS model" in line]
    assert tts.startswith("[FAIL] TTS model spark-tts-0.5b") and "voiced models pull spark-tts-0.5b" in tts, tts
