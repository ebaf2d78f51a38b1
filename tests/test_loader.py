"""The daemon's engine loader: config -> running engines, and clear errors for what is missing."""

from __future__ import annotations

import pytest

from tests.spark_fixtures import cached_spark_checkpoint
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.config import load_config
from voiced.engines.backend import BackendError
from voiced.engines.loader import load_asr, load_tts, resolve_device
from voiced.hub import ModelNotFoundError


def test_config_to_torch_engines_on_the_cpu(tmp_path, tmp_path_factory):
    config = load_config(env={}, overrides={
        "asr.model": str(make_openai_checkpoint(tmp_path / "w", seed=1)), "asr.device": "auto",
        "tts.model": str(cached_spark_checkpoint(tmp_path_factory)), "tts.device": "cpu",
        "tts.voices_dir": str(tmp_path / "voices"), "engines.dir": str(tmp_path / "engines")})
    asr, tts = load_asr(config), load_tts(config)
    assert (asr.backend, asr.device) == ("torch", "cpu") and (tts.backend, tts.device) == ("torch", "cpu")
    assert [v.name for v in tts.voices.list()][:2] == ["female", "male"]


def test_missing_pieces_are_clear_errors(tmp_path):
    config = load_config(env={"VOICED_CACHE": str(tmp_path)}, overrides={
        "asr.backend": "trtllm", "engines.dir": str(tmp_path / "engines")})
    with pytest.raises(BackendError, match="tensorrt_llm|TensorRT-LLM"):
        load_asr(config)
    config.asr.backend = "auto"
    config.asr.model = str(tmp_path / "nowhere.pt")
    with pytest.raises((ModelNotFoundError, FileNotFoundError), match="nowhere.pt"):
        load_asr(config)
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda")
    with pytest.raises(ValueError, match="use auto, cpu, cuda"):
        resolve_device("tpu")
