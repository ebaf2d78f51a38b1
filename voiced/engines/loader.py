"""Turning the daemon's config into running engines: device, backend and memory plan.

This is the one place that decides where a model runs. The daemon calls `load_asr` / `load_tts`
and gets objects that satisfy voiced.engines.base, whichever backend is behind them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from voiced.config import ASRConfig, Config, TTSConfig
from voiced.engines.backend import choose_backend
from voiced.engines.runtime import EngineOptions, EngineRuntime, resolve_device  # noqa: F401 (loader.resolve_device)

log = logging.getLogger(__name__)


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


def load_asr(config: Config, options: EngineOptions | None = None):
    """The recognizer `config.asr` names, run as `options` says (resolved from the config when not given)."""
    c: ASRConfig = config.asr
    o = options or EngineRuntime.resolve(config).asr
    backend = choose_backend(c.backend, "whisper", engine_dir(config, "whisper", c.model))
    if backend == "trtllm":
        from voiced.engines.trtllm.whisper_runner import TrtllmWhisperEngine

        return TrtllmWhisperEngine.load(engine_dir(config, "whisper", c.model), plan=config.memory,
                                        max_batch=o.max_batch)  # None: the engine's built batch
    from voiced.engines.whisper.engine import WhisperEngine

    # The torch engine computes what it will hold and checks it against its share of the memory free
    # now (the fraction is a cap: its caches are sized by max_batch, not by the share; no max_batch: the
    # most rows, up to 64, within it).
    mem = gpu_memory(o.device)
    limit = (mem.free, o.memory_fraction) if mem else None
    return WhisperEngine.load(c.model, device=o.device, dtype=c.dtype or None, max_batch=o.max_batch,
                              cuda_graphs=o.graphs, memory_limit=limit, window=c.window)


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


def load_tts(config: Config, options: EngineOptions | None = None):
    """The speech model `config.tts` names, run as `options` says (resolved from the config when not given)."""
    c: TTSConfig = config.tts
    o = options or EngineRuntime.resolve(config).tts
    if o is None:
        raise ValueError("tts.enabled is false: there is no speech model to load")
    model = tts_model(c.model, o.device)
    from voiced.engines.piper import registry as piper

    if piper.is_piper(model):  # Piper voices run on the CPU, with onnxruntime (c.threads threads a voice)
        from voiced.engines.piper.engine import PiperEngine

        return PiperEngine.load(model, threads=c.threads)
    backend = choose_backend(c.backend, "spark-tts", engine_dir(config, "spark-tts", model))
    mem = gpu_memory(o.device)
    from voiced.engines.spark.engine import SparkTTSEngine

    kwargs = dict(device=o.device, dtype=c.dtype or None, max_batch=o.max_batch, voices_dir=c.voices_dir or None)
    if backend == "trtllm":
        from voiced.engines.trtllm.spark_runner import TrtllmSparkEngine

        budgets = config.memory.budget_bytes(mem.free) if mem else {}
        return TrtllmSparkEngine.load(engine_dir(config, "spark-tts", model), model, plan=config.memory,
                                      kv_cache_bytes=budgets.get("tts"), **kwargs)
    # the free memory now: after the ASR engine loaded and warmed up, when it loads first
    limit = (mem.free, o.memory_fraction) if mem else None
    return SparkTTSEngine.load(model, memory_limit=limit, use_cuda_graphs=o.graphs,
                               compile_lm=None if o.compile else False, **kwargs)
