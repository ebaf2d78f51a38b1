"""`voiced serve` keeps torch.compile's and Triton's compiled kernels in the model cache, so a restarted
daemon (a container with its cache volume) finds them instead of compiling for minutes again."""

from __future__ import annotations

import logging
import os

from voiced.cli.serve import compile_caches_beside_models

VARS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


def test_compiled_kernels_go_under_the_model_cache(tmp_path, monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VOICED_CACHE", str(tmp_path / "cache"))
    compile_caches_beside_models()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "compile" / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "compile" / "triton")
    assert all(os.path.isdir(os.environ[v]) for v in VARS)


def test_the_operator_s_own_cache_settings_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("VOICED_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/srv/inductor")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    compile_caches_beside_models()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/srv/inductor"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache" / "compile" / "triton")


def test_a_cache_that_cannot_be_written_leaves_torch_s_defaults_with_a_warning(tmp_path, monkeypatch, caplog):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder would be")
    monkeypatch.setenv("VOICED_CACHE", str(blocked))
    with caplog.at_level(logging.WARNING, logger="voiced.serve"):
        compile_caches_beside_models()
    assert not any(v in os.environ for v in VARS)
    assert "torch's default caches" in caplog.text
