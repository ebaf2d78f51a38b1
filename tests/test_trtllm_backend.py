"""Backend choice and the errors when TensorRT-LLM or an engine is missing."""

from __future__ import annotations

import json
import sys

import pytest

from voiced.engines import backend
from voiced.engines.backend import BackendError, choose_backend
from voiced.engines.trtllm import build as b
from voiced.engines.trtllm import versions


def fake_engine(root, kind="whisper", version="1.0.0", complete=True):
    opts = b.default_options(kind)
    d = root / opts.name
    for part in ("encoder", "decoder") if kind == "whisper" else ("llm",):
        (d / part).mkdir(parents=True)
        (d / part / "config.json").write_text("{}")
        if complete:
            (d / part / "rank0.engine").write_bytes(b"\0")
    b.manifest_for(opts, "0" * 64, version).write(d)
    return d


@pytest.fixture
def trtllm_installed(monkeypatch):
    monkeypatch.setattr(versions, "is_installed", lambda: True)
    monkeypatch.setattr(versions, "installed_version", lambda: "1.0.0")


@pytest.fixture
def trtllm_missing(monkeypatch):
    monkeypatch.setattr(versions, "is_installed", lambda: False)
    monkeypatch.setattr(versions, "installed_version", lambda: None)


def test_this_machine_really_has_no_tensorrt_llm_and_voiced_does_not_import_it():
    import voiced.engines.backend
    import voiced.engines.trtllm.spark_runner
    import voiced.engines.trtllm.whisper_runner  # noqa: F401

    assert "tensorrt_llm" not in sys.modules
    assert versions.is_installed() is False
    assert versions.detect().installed is False


def test_torch_is_always_allowed(tmp_path, trtllm_missing):
    assert choose_backend("torch", "whisper", tmp_path / "nothing") == "torch"


def test_auto_picks_trtllm_only_with_package_and_engine(tmp_path, trtllm_installed):
    d = fake_engine(tmp_path)
    assert choose_backend("auto", "whisper", d) == "trtllm"
    assert choose_backend("auto", "whisper", tmp_path / "missing") == "torch"
    assert choose_backend("auto", "spark-tts", d) == "torch"  # a whisper engine is no TTS engine


def test_auto_falls_back_without_the_package(tmp_path, trtllm_missing):
    d = fake_engine(tmp_path)
    assert choose_backend("auto", "whisper", d) == "torch"


def test_trtllm_without_package_says_how_to_get_it(tmp_path, trtllm_missing):
    d = fake_engine(tmp_path)
    with pytest.raises(BackendError) as e:
        choose_backend("trtllm", "whisper", d)
    msg = str(e.value)
    assert "tensorrt_llm" in msg and "not installed" in msg
    assert versions.CONTAINER_IMAGE in msg and "--backend torch" in msg


def test_trtllm_without_engine_names_the_build_command(tmp_path, trtllm_installed):
    with pytest.raises(BackendError, match=r"`voiced engines build whisper --model large-v3`"):
        choose_backend("trtllm", "whisper", tmp_path / "whisper-large-v3")
    with pytest.raises(BackendError, match=r"voiced engines build spark-tts"):
        choose_backend("trtllm", "spark-tts", None)
    with pytest.raises(BackendError, match=r"build whisper --model small"):
        choose_backend("trtllm", "whisper", tmp_path / "whisper-small")


def test_incomplete_or_foreign_engines_are_not_used(tmp_path, trtllm_installed, monkeypatch):
    d = fake_engine(tmp_path, complete=False)
    with pytest.raises(BackendError, match="missing engine files"):
        choose_backend("trtllm", "whisper", d)
    # Built by another TensorRT-LLM: TensorRT engines do not load across versions.
    other = tmp_path / "other"
    other.mkdir()
    e = fake_engine(other, version="0.17.0")
    with pytest.raises(BackendError, match="built with TensorRT-LLM 0.17.0 but 1.0.0 is installed"):
        choose_backend("trtllm", "whisper", e)
    # No manifest: an interrupted build.
    (e / b.MANIFEST).unlink()
    with pytest.raises(BackendError, match="no manifest.json"):
        choose_backend("trtllm", "whisper", e)


def test_bad_arguments(tmp_path):
    with pytest.raises(BackendError, match="unknown backend 'tensorrt'"):
        choose_backend("tensorrt", "whisper", tmp_path)
    with pytest.raises(BackendError, match="unknown model kind"):
        choose_backend("auto", "bark", tmp_path)


def test_manifest_written_by_build_is_what_the_chooser_reads(tmp_path, trtllm_installed):
    d = fake_engine(tmp_path, kind="spark-tts")
    data = json.loads((d / b.MANIFEST).read_text())
    assert data["kind"] == "spark-tts" and data["trtllm_version"] == "1.0.0"
    ok, reason = backend.engine_status("spark-tts", d)
    assert ok and "Spark-TTS-0.5B" in reason


def test_runner_loaders_fail_clearly_without_tensorrt_llm(tmp_path, trtllm_missing):
    from voiced.engines.base import EngineError
    from voiced.engines.trtllm.spark_runner import load_spark_lm
    from voiced.engines.trtllm.whisper_runner import load_whisper_engine
    from voiced.memory_plan import MemoryPlan

    with pytest.raises(EngineError, match="needs the `tensorrt_llm` package"):
        load_whisper_engine(tmp_path, MemoryPlan())
    with pytest.raises(EngineError, match="needs the `tensorrt_llm` package"):
        load_spark_lm(tmp_path, MemoryPlan())
