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
    # max_batch unset (0): the engines' CPU rows; set, exactly that
    assert (config.asr.max_batch, config.tts.max_batch) == (0, 0)
    assert (asr.max_batch, tts.max_batch) == (8, 16)
    config.asr.max_batch, config.tts.max_batch = 3, 5
    assert (load_asr(config).max_batch, load_tts(config).max_batch) == (3, 5)


def large_v3_turbo_need(rows: int):
    """What the torch engine holds on a GPU for large-v3-turbo in float16 with `rows` decoder rows, with the
    engine's GPU defaults (cross keys/values in the encoder's pass, prefill and word-timing graphs)."""
    import torch

    from voiced.engines.random_weights import WHISPER_DIMS, random_whisper
    from voiced.engines.whisper.memory import memory_need
    from voiced.memory_plan import tensor_bytes

    dims = WHISPER_DIMS["large-v3-turbo"]
    with torch.device("meta"):
        weights = tensor_bytes(random_whisper(dims, "meta", torch.float16), torch.float16)
    return memory_need(dims, torch.float16, weights, rows, cuda=True, alignment_heads=6, workspace_bytes=32 << 20)


GIB = 1 << 30


@pytest.mark.parametrize("free_gib, rows", [(139, 64), (22, 64), (15, 32), (12.5, 16), (10, 8)])
def test_unset_rows_on_a_gpu_are_the_most_its_memory_share_holds(free_gib, rows):
    """max_batch 0 on a GPU: 64 rows where the ASR share (whisper_kv_fraction 0.25) holds them, as on the
    H200 the capacity was measured on; a smaller GPU starts with fewer rows instead of refusing to start."""
    from voiced.memory_plan import AUTO_GPU_ROWS, rows_that_fit

    limit = (int(free_gib * GIB), 0.25)
    got, need = rows_that_fit(AUTO_GPU_ROWS, large_v3_turbo_need, limit, "ASR decoder")
    assert got == rows and need.fits(*limit)
    assert got == AUTO_GPU_ROWS or not large_v3_turbo_need(2 * got).fits(*limit)  # the most that fit


def test_a_gpu_too_small_for_one_row_is_refused_saying_what_to_change():
    from voiced.engines.base import EngineError
    from voiced.memory_plan import AUTO_GPU_ROWS, check_memory_limit, rows_that_fit

    limit = (4 * GIB, 0.25)
    got, need = rows_that_fit(AUTO_GPU_ROWS, large_v3_turbo_need, limit, "ASR decoder")
    assert got == 1
    with pytest.raises(EngineError, match="raise whisper_kv_fraction .* or lower max_batch"):
        check_memory_limit(need, limit)


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
