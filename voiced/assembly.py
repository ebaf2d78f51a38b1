"""The engines assembled as the daemon serves with them: loaded and warmed up on the threads that will step
them, in this process or in one of their own, as `EngineRuntime` resolved it from the config.

`voiced serve`, the engine process and the benchmarks all come through here: `load_engines` (the daemon's
loader: the engines, then the end-of-turn model) starts `build_engines` here or in an `EngineProcess`. What
differs between them is only where the engines' weights come from (`EngineSpec.source`: the models the
config names, or the benchmarks' random weights at full size) and, for a benchmark, what it wraps around
the built engines (its own builder, which calls `build_engines`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from voiced.config import Config
from voiced.core.scheduler import EngineThread, EngineWorker
from voiced.core.services import Engines
from voiced.engine_process import Built, EngineProcess, voice_calls
from voiced.engines.runtime import EngineOptions, EngineRuntime

log = logging.getLogger("voiced.engines")


class EngineSource(Protocol):
    """Makes each engine for `build_engines` (on the thread that will step it)."""

    def asr(self, config: Config, options: EngineOptions) -> Any: ...

    def tts(self, config: Config, options: EngineOptions) -> Any: ...


class Checkpoints:
    """The models the config names, from the cache or a path (voiced.engines.loader)."""

    def asr(self, config: Config, options: EngineOptions):
        from voiced.engines.loader import load_asr

        return load_asr(config, options)

    def tts(self, config: Config, options: EngineOptions):
        from voiced.engines.loader import load_tts

        return load_tts(config, options)


@dataclass(frozen=True)
class EngineSpec:
    """All a builder needs, resolved in the daemon's process (and pickled to the engines' own)."""

    config: Config
    runtime: EngineRuntime
    source: EngineSource = dataclasses.field(default_factory=Checkpoints)

    @classmethod
    def resolve(cls, config: Config, source: EngineSource | None = None) -> EngineSpec:
        return cls(config, EngineRuntime.resolve(config), source or Checkpoints())


def build_engines(spec: EngineSpec) -> Built:
    """Load and warm up the engines on the threads that will step them; their workers, not started."""
    from voiced.engines.loader import gpu_memory
    from voiced.heap import freeze_heap

    rt, config = spec.runtime, spec.config
    # Both engines step on one thread unless runtime.threads says otherwise (voiced.core.scheduler says why).
    # They load on it too: PyTorch keeps a cuBLAS workspace per (thread, stream), and the memory plan's probe
    # of its size (voiced.memory_plan.stream_workspace_bytes) then makes the one the engines use anyway.
    threads = {"engines": EngineThread("engines", overlap=rt.overlap)}
    if rt.threads == "separate":
        threads["tts"] = EngineThread("tts")
    mem = gpu_memory(rt.asr.device)
    free = mem.free if mem else None
    built = Built({})
    engines = []
    for name, options in rt.engines.items():
        thread = threads[options.thread]
        make = spec.source.asr if name == "asr" else spec.source.tts
        engine = thread.call(lambda make=make, options=options: make(config, options))
        if name == "asr" and rt.threads == "separate":
            _workspace_of_its_own(engine)
        _log_need(engine)
        _warm(engine, thread)
        built.workers[name] = EngineWorker(engine, name, thread=thread)
        log.info("%s: %s on %s (%s backend)", name.upper(), engine.model_name, engine.device, engine.backend)
        if name == "tts":
            built.voices = engine.voices
            built.calls.update(voice_calls(engine.voices))
        engines.append(engine)
    _log_plan(engines, free, concurrent=rt.concurrent_steps)
    freeze_heap()
    return built


def start_engines(spec: EngineSpec, builder: Callable[[EngineSpec], Built] = build_engines) -> Engines:
    """`builder(spec)` here, or in a process of the engines' own (runtime.process), as the daemon serves with."""
    if spec.runtime.process == "separate":
        return EngineProcess(builder, spec).engines()
    built = builder(spec)
    return Engines(asr=built.workers.get("asr"), tts=built.workers.get("tts"), voices=built.voices,
                   call=lambda name, *args: built.calls[name](*args))


def load_engines(spec: EngineSpec, builder: Callable[[EngineSpec], Built] = build_engines) -> Engines:
    """The daemon's loader (voiced.daemon.Daemon's `load`): the engines, then the end-of-turn model here."""
    from voiced.engines.loader import load_turn_model
    from voiced.heap import freeze_heap

    engines = dataclasses.replace(start_engines(spec, builder), turn_model=load_turn_model(spec.config))
    # This process's own start-up too (the doors, the turn model; the engines' objects, where they load here,
    # were frozen already): with the engines in a process of their own, the daemon's process otherwise ran full
    # collections of ~100 ms over what its imports made, in the middle of serving.
    freeze_heap()
    return engines


def _workspace_of_its_own(asr) -> None:
    """The plan's workspace probe ran on the shared thread's default stream: one thread stepping both engines
    has Spark-TTS use that workspace; with a thread each nothing does, and it is held all the same."""
    if getattr(asr, "memory_need", None) is None or not str(asr.device).startswith("cuda"):
        return
    from voiced.memory_plan import Need, stream_workspace_bytes

    asr.memory_need.items.append(Need("cuBLAS workspace (this thread's default stream: engines on a thread each)",
                                      stream_workspace_bytes(str(asr.device))))


def _log_need(engine) -> None:
    need = getattr(engine, "memory_need", None)
    if need is not None and str(engine.device).startswith("cuda"):
        from voiced.memory_plan import plan_table

        log.info("%s: planned before loading\n%s", engine.model_name, plan_table([need]))


def _log_plan(engines, free: int | None, concurrent: bool = False) -> None:
    """The torch engines' plan (what `test_daemon_gpu` reads), and beside it what PyTorch's allocator
    holds now and its peak since the TTS warm-up's last phase began."""
    needs = [e.memory_need for e in engines
             if getattr(e, "memory_need", None) is not None and str(e.device).startswith("cuda")]
    if not needs:
        return
    import torch

    from voiced.memory_plan import plan_table, plan_total

    log.info("\n%s\n", plan_table(needs, free, concurrent))
    total = plan_total(needs, concurrent)
    used, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
    log.info("GPU memory after warm-up: plan %.1f MiB, allocated %.1f MiB (%+.1f %%), peak %.1f MiB (%+.1f %%)",
             total / 2**20, used / 2**20, 100 * (used - total) / total, peak / 2**20, 100 * (peak - total) / total)


def _warm(engine, thread: EngineThread) -> None:
    """Capture CUDA graphs and first-use kernels before health says SERVING, not on a caller's time,
    on the thread that will step the engine (see EngineThread.call)."""
    warmup = getattr(engine, "warmup", None)
    if warmup is not None:
        t0 = time.perf_counter()
        thread.call(warmup)
        log.info("%s warmed up in %.1f s", engine.model_name, time.perf_counter() - t0)
