"""Turning the daemon's config into running engines: device, backend and memory plan.

This is the one place that decides where a model runs. The daemon calls `load_asr` / `load_tts`
and gets objects that satisfy voiced.engines.base, whichever backend is behind them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from voiced.config import ASRConfig, Config, TTSConfig
from voiced.engines.backend import choose_backend

log = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when torch sees a GPU, else "cpu"."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but torch sees no CUDA GPU; use --device cpu or auto")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device {device!r}: use auto, cpu, cuda or cuda:N")
    return device


@dataclass
class GpuMemory:
    free: int
    total: int


def gpu_memory(device: str) -> GpuMemory | None:
    if not device.startswith("cuda"):
        return None
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return GpuMemory(free, total)


def engine_dir(config: Config, kind: str, model: str):
    from pathlib import Path

    root = Path(config.engines.dir).expanduser()
    name = Path(model).name if "/" in model else model
    return root / (f"whisper-{name}" if kind == "whisper" and not name.startswith("whisper") else name)


def load_asr(config: Config):
    c: ASRConfig = config.asr
    backend = choose_backend(c.backend, "whisper", engine_dir(config, "whisper", c.model))
    device = resolve_device(c.device)
    if backend == "trtllm":
        from voiced.engines.trtllm.whisper_runner import TrtllmWhisperEngine

        return TrtllmWhisperEngine.load(engine_dir(config, "whisper", c.model), plan=config.memory,
                                        max_batch=c.max_batch or None)  # 0: the engine's built batch
    from voiced.engines.whisper.engine import WhisperEngine

    # The torch engine computes what it will hold and checks it against its share of the memory free
    # now (the fraction is a cap: its caches are sized by max_batch, not by the share; max_batch 0: the
    # most rows, up to 64, within it).
    mem = gpu_memory(device)
    limit = (mem.free, config.memory.whisper_kv_fraction) if mem else None
    return WhisperEngine.load(c.model, device=device, dtype=c.dtype or None, max_batch=c.max_batch or None,
                              memory_limit=limit)


def load_turn_model(config: Config):
    """The end-of-turn model for smart turn detection (voiced.core.turns), on the CPU; None, with one
    log line on how to add it, where it is not on disk (turns then end on silence)."""
    c = config.segmentation
    if c.turn_detection != "smart":
        return None
    from voiced.engines import smart_turn
    from voiced.hub import ModelNotFoundError

    try:
        path = smart_turn.resolve(c.turn_model) if c.turn_model else smart_turn.find()
    except ModelNotFoundError as e:
        log.warning("turn detection: silence (segmentation.hangover_ms): %s", e)
        return None
    if path is None:
        log.warning("turn detection: silence (segmentation.hangover_ms), since the end-of-turn model is not in the "
                    "cache; `voiced models pull %s` (or %s) adds it, then restart voiced.",
                    smart_turn.HUB_NAME, smart_turn.PYPI_NAME)
        return None
    model = smart_turn.load_smart_turn(path)
    log.info("turn detection: smart, %s eagerness by default (end-of-turn model %s)", c.eagerness, path)
    return model


def tts_model(model: str, device: str) -> str:
    """`tts.model` with "auto" settled as it is on disk (voiced.engines.provision fetches what is missing first):
    Spark-TTS on a GPU, the Piper voice in the cache on a CPU (the PyPI voice's name where there is none)."""
    if model != "auto":
        return model
    if device.startswith("cuda"):
        return "spark-tts-0.5b"
    from voiced.engines.piper import registry as piper

    return piper.find() or piper.PYPI_NAME


def load_tts(config: Config):
    c: TTSConfig = config.tts
    device = resolve_device(c.device)
    model = tts_model(c.model, device)
    from voiced.engines.piper import registry as piper

    if piper.is_piper(model):  # Piper voices run on the CPU, with onnxruntime (c.threads threads a voice)
        from voiced.engines.piper.engine import PiperEngine

        return PiperEngine.load(model, threads=c.threads)
    backend = choose_backend(c.backend, "spark-tts", engine_dir(config, "spark-tts", model))
    mem = gpu_memory(device)
    from voiced.engines.spark.engine import SparkTTSEngine

    kwargs = dict(device=device, dtype=c.dtype or None, max_batch=c.max_batch or None, voices_dir=c.voices_dir or None)
    if backend == "trtllm":
        from voiced.engines.trtllm.spark_runner import TrtllmSparkEngine

        budgets = config.memory.budget_bytes(mem.free) if mem else {}
        return TrtllmSparkEngine.load(engine_dir(config, "spark-tts", model), model, plan=config.memory,
                                      kv_cache_bytes=budgets.get("tts"), **kwargs)
    # the free memory now: after the ASR engine loaded and warmed up, when it loads first
    limit = (mem.free, config.memory.tts_kv_fraction) if mem else None
    return SparkTTSEngine.load(model, memory_limit=limit, compile_lm=None if c.compile else False, **kwargs)
