"""How the engines run, resolved once from the config and the machine: `EngineRuntime.resolve(config)`.

`voiced serve`, the engine process and every benchmark read this one object instead of each settling
"auto" on its own: where the engines run (this process or one of their own), on which threads, whether
one thread overlaps their steps, and per engine its device, rows, CUDA graphs and compilation. The
engine process receives the daemon's resolution, so both processes agree on it by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from voiced.config import Config


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


@dataclass(frozen=True)
class EngineOptions:
    """How one engine loads and runs."""

    device: str  # "cpu", "cuda" or "cuda:N" (never "auto")
    max_batch: int | None  # rows stepped together; None: on a GPU the most its memory share holds
    graphs: bool  # steps replayed from CUDA graphs (a GPU)
    compile: bool  # torch.compile where the engine has it (on a GPU; tts.compile for Spark-TTS)
    memory_fraction: float  # the share of the GPU memory free at its load its caches may take
    thread: str  # the engine thread it loads, warms up and steps on ("engines", or "tts" on a thread of its own)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclass(frozen=True)
class EngineRuntime:
    process: str  # "inline": in the daemon's process; "separate": in one of their own (voiced.engine_process)
    threads: str  # "shared": one engine thread steps both; "separate": a thread each
    overlap: bool  # the shared thread launches each engine's step before waiting on any (voiced.core.scheduler)
    asr: EngineOptions
    tts: EngineOptions | None  # None: listening only (tts.enabled false)

    @property
    def engines(self) -> dict[str, EngineOptions]:
        return {name: o for name, o in (("asr", self.asr), ("tts", self.tts)) if o is not None}

    @property
    def concurrent_steps(self) -> bool:
        """Whether both engines' step transients may be held at once (two threads, or one overlapping)."""
        return self.tts is not None and (self.threads == "separate" or self.overlap)

    @classmethod
    def resolve(cls, config: Config) -> EngineRuntime:
        """The config's "auto"s settled for this machine (a GPU is what the recognizer's device resolves to)."""
        e = config.engines
        asr_device = resolve_device(config.asr.device)
        gpu = asr_device.startswith("cuda")
        # A process of their own on a GPU: the event loop's Python (every caller's frames) and the engine
        # threads then hold different GILs (docs/BENCHMARKS.md, "The engines in a process of their own").
        process = e.process if e.process != "auto" else "separate" if gpu else "inline"
        # A thread each on a GPU beside the event loop; in a process of their own one thread does better (with
        # no event loop there, two engine threads only fight over the GIL); on the CPU two would fight over cores.
        threads = e.threads if e.threads != "auto" else "separate" if gpu and process == "inline" else "shared"
        overlap = e.overlap == "on" or (e.overlap == "auto" and gpu)
        asr = EngineOptions(device=asr_device, max_batch=config.asr.max_batch or None, graphs=gpu, compile=gpu,
                            memory_fraction=config.memory.whisper_kv_fraction, thread="engines")
        tts = None
        if config.tts.enabled:
            device = resolve_device(config.tts.device)
            cuda = device.startswith("cuda")
            tts = EngineOptions(device=device, max_batch=config.tts.max_batch or None, graphs=cuda,
                                compile=cuda and config.tts.compile, memory_fraction=config.memory.tts_kv_fraction,
                                thread="tts" if threads == "separate" else "engines")
        return cls(process=process, threads=threads, overlap=overlap and threads == "shared", asr=asr, tts=tts)
