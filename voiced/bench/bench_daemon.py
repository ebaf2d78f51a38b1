"""The daemon the serving benchmarks call: `voiced serve`'s own, started the way `voiced serve` starts it
(voiced.assembly: the same runtime resolution, builder, engine process and loader), in this process on a
thread of its own, with random full-size weights (Whisper large-v3-turbo's dimensions, Spark-TTS-0.5B) made
to behave as trained ones: forced transcript and reply lengths, one voice, the echo agent.

Only two things differ from `voiced serve`: where the weights come from (`BenchEngines`, an EngineSource), and
what the benchmark's builder adds around `build_engines` (its step and request timers, and a "bench.level_stats"
call that reads and restarts them, wherever the engines run).
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from voiced.assembly import EngineSpec, build_engines, load_engines
from voiced.bench.steps import STEP_PARTS, LoopLag, RequestTimer, StepTimer
from voiced.config import Config
from voiced.engine_process import Built
from voiced.engines.runtime import EngineOptions

log = logging.getLogger("voiced.bench")
MEMORY: dict[str, dict] = {}  # GPU memory at each point `gpu_memory` is read, by its label


def gpu_memory(after: str) -> dict | None:
    """Log what is allocated now and the peak since the last call (where a transient peak comes from), and
    what the allocator reserves (what the GPU's other users cannot have); None without a GPU in use."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    now, peak = torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30
    reserved = torch.cuda.memory_reserved() / 2**30
    log.info("GPU memory after %s: %.2f GiB allocated, peak %.2f GiB, reserved %.2f GiB", after, now, peak, reserved)
    MEMORY[after] = {"allocated_gib": round(now, 2), "peak_gib": round(peak, 2), "reserved_gib": round(reserved, 2)}
    torch.cuda.reset_peak_memory_stats()
    return MEMORY[after]


def turn_detection(args) -> str:
    """How turns end: with a real Whisper (--asr-model) as --turn-detection says (smart unless told), with
    random weights on silence (their words are noise)."""
    if getattr(args, "asr_model", None) is None:
        return "silence"
    return getattr(args, "turn_detection", None) or "smart"


def bench_config(args) -> Config:
    """The daemon's config for a run: what `voiced serve` would read from a file with these settings. A
    benchmark's namespace has --tiny-cpu, --asr-batch, --tts-batch, --asr-tokens, --reply-seconds,
    --first-chunk-tokens, --chunk-tokens and --front; --asr-model, --engine-* where it offers them."""
    config = Config()
    config.server.listen = "127.0.0.1:0"
    config.server.max_sessions = 1000
    config.asr.language = "en"
    config.asr.device = config.tts.device = "cpu" if args.tiny_cpu else "cuda"
    config.asr.max_batch, config.tts.max_batch = args.asr_batch, args.tts_batch
    asr_model = getattr(args, "asr_model", None)
    if asr_model is None:
        config.asr.max_new_tokens = args.asr_tokens
        config.asr.no_speech_threshold, config.asr.logprob_threshold = 1.0, -1e9  # random weights: keep all
        config.asr.compression_ratio_threshold = 1e9
    else:
        config.asr.model = asr_model
    config.segmentation.turn_detection = turn_detection(args)
    config.tts.first_chunk_tokens = args.first_chunk_tokens
    config.tts.chunk_tokens = args.chunk_tokens
    config.tts.max_seconds = args.reply_seconds
    config.barge_in.enabled = False  # as the gRPC callers ask: every utterance gets its reply
    for key in ("process", "threads", "overlap"):
        setattr(config.engines, key, getattr(args, f"engine_{key}", "auto"))
    if getattr(args, "serve", False):  # a daemon of its own, for `voiced bench e2e --target` to call
        config.server.listen, config.doors.http = args.listen, args.http or ""
        return config
    for front in args.front:
        if front == "realtime":
            config.doors.http = "127.0.0.1:0"  # /v1/realtime, beside gRPC
        elif front != "grpc":
            setattr(config.doors, front, "127.0.0.1:0")
    return config


@dataclass(frozen=True)
class BenchEngines:
    """The engines' weights: random at full size (tiny widths with `tiny`), or, with `asr_dims` None, the
    Whisper the config names, loaded as `voiced serve` loads it (Spark-TTS stays random)."""

    asr_dims: str | None
    tiktoken_dir: Path | None
    tiny: bool

    def asr(self, config: Config, options: EngineOptions):
        if self.asr_dims is None:
            from voiced.engines.loader import load_asr

            return load_asr(config, options)
        import torch

        from voiced.engines.random_weights import WHISPER_DIMS, random_whisper
        from voiced.engines.whisper.engine import WhisperEngine
        from voiced.engines.whisper.tokenizer import WhisperTokenizer

        dims = WHISPER_DIMS[self.asr_dims]
        dirs = [self.tiktoken_dir] if self.tiktoken_dir else None  # else the copy voiced ships
        tok = WhisperTokenizer.load(dims.multilingual, dims.num_languages, dirs)
        model = random_whisper(dims, options.device, torch.float32 if self.tiny else torch.float16)
        return WhisperEngine(model, tok, model_name=f"{self.asr_dims} (random)", max_batch=options.max_batch or 64,
                             cuda_graphs=options.graphs)

    def tts(self, config: Config, options: EngineOptions):
        import torch

        from voiced.engines.random_weights import random_spark

        dtype = torch.float32 if self.tiny else torch.bfloat16
        tts = random_spark(options.device, dtype, dtype, options.max_batch or 64, 2048, Path(tempfile.mkdtemp()),
                           tiny=self.tiny)
        # Random weights: made to do what a trained model does (speak until the length cap, in one voice).
        tts.force_reply_lengths()
        tts.use_random_voice(seed=0)
        if options.compile:
            tts.lm.compile_decode()  # what SparkTTSEngine.load does on a GPU (tts.compile)
        return tts


def bench_spec(args) -> EngineSpec:
    config = bench_config(args)
    source = BenchEngines(None if getattr(args, "asr_model", None) else args.asr_dims,
                          getattr(args, "tiktoken_dir", None), args.tiny_cpu)
    return EngineSpec.resolve(config, source)


def bench_build(spec: EngineSpec) -> Built:
    """`build_engines`, then the engines' steps and requests timed, and "bench.level_stats" registered:
    a level's steps, step times, request times and GPU memory (each restarted), and, in a process of the
    engines' own, its garbage collections (they stall the steps)."""
    built = build_engines(spec)
    gpu_memory("the engines' load and warm-up")
    workers = built.workers
    for worker in workers.values():
        worker.engine.step = StepTimer(worker.engine, STEP_PARTS[worker.name])
    requests = {name: RequestTimer(worker) for name, worker in workers.items()}
    collections = None
    if spec.runtime.process == "separate":
        import gc

        collections = GcPauses()
        gc.callbacks.append(collections)

    def level_stats(label: str) -> dict:
        out = {"steps": {n: w.stats.steps for n, w in workers.items()},
               "step_ms": {n: w.engine.step.take() for n, w in workers.items()},
               "engine_ms": {n: t.take() for n, t in requests.items()}}
        if collections is not None:
            out["gc"] = collections.take()
        if gpu_memory(label):
            out["gpu_memory"] = MEMORY.pop(label)
        return out

    built.calls["bench.level_stats"] = level_stats
    return built


@dataclass
class BenchServer:
    """A started daemon and what the benchmark reads of it."""

    daemon: object  # voiced.daemon.Daemon
    loop: object  # its event loop (on a thread of its own)
    spec: EngineSpec
    addresses: dict[str, str]  # door -> bound address ("realtime": the HTTP listener's)
    engine_pids: list[int]  # the engines' own process (none: they run in this one)
    loop_lag: LoopLag  # how late the daemon's event loop runs (every caller's frames wait as long)
    asr_worker: RequestTimer | None  # with the engines in a process of their own: each request there and back
    level_stats: object  # label -> the engines' "bench.level_stats"

    @property
    def services(self):
        return self.daemon.services

    def start_level(self) -> None:
        """Restart every server-side figure, so that each level's are its own."""
        self.level_stats("the level's start")
        if self.asr_worker is not None:
            self.asr_worker.take()
        self.loop_lag.take()

    def level_figures(self, label: str) -> dict:
        """The server side of a level since `start_level`: engine steps and their times, each request's time in
        the engines (and through the pipe, with the engines in a process of their own), the event loop's lag,
        the engines' process's garbage collections and its GPU memory."""
        engines = self.level_stats(label)
        out = {"asr_steps": engines["steps"]["asr"], "step_ms": engines["step_ms"]}
        if "gc" in engines:
            out["engine_gc"] = engines["gc"]
        for name in ("asr", "tts"):  # a request's wait for a row, and its time in one
            if name in engines.get("engine_ms", {}):
                out[f"{name}_engine_ms"] = engines["engine_ms"][name]
        if self.asr_worker is not None:
            out["asr_worker_ms"] = self.asr_worker.take()  # ... and with the pipe there and back
        out["loop_lag_ms"] = self.loop_lag.take()
        if "gpu_memory" in engines:
            out["gpu_memory"] = engines["gpu_memory"]
        return out

    def stop(self) -> None:
        import asyncio
        import gc

        asyncio.run_coroutine_threadsafe(self.daemon.drain_and_stop(grace=0), self.loop).result(60)
        # What the engines' start-up froze goes back to the collector, as `voiced serve` does at its end, so the
        # interpreter's exit frees it (frozen, triton's bindings report their objects as leaks on the way out).
        gc.unfreeze()


def start_server(args) -> BenchServer:
    """The daemon on its own thread here, serving once its engines are loaded and warm."""
    from voiced.core.agents import AgentRegistry
    from voiced.core.services import Services
    from voiced.daemon import Daemon, start_in_thread

    spec = bench_spec(args)
    loaded = {}

    def load():
        loaded["engines"] = engines = load_engines(spec, bench_build)
        return engines

    services = Services(config=spec.config, agents=AgentRegistry(spec.config.agent))
    daemon = Daemon(spec.config, load=load, services=services)
    _, loop, _ = start_in_thread(daemon, timeout=1800)  # (a GPU's first start compiles for minutes)
    if spec.config.segmentation.turn_detection == "smart" and services.turn_model is None:
        import asyncio

        asyncio.run_coroutine_threadsafe(daemon.drain_and_stop(grace=0), loop).result(60)
        raise SystemExit("the benchmark runs smart turn detection with --asr-model, and no end-of-turn model is "
                         "in the cache: voiced models pull smart-turn-v3-pypi")
    engines = loaded["engines"]
    pids = [engines.process.pid] if engines.process is not None else []
    lag = LoopLag(loop)
    lag.start()
    addresses = dict(services.doors)
    if "http" in addresses:
        addresses["realtime"] = addresses["http"]
    return BenchServer(daemon, loop, spec, addresses, pids, lag, RequestTimer(services.asr) if pids else None,
                       lambda label: engines.call("bench.level_stats", label))


def serve(args) -> int:
    """`voiced bench e2e --serve`: this run's daemon alone, in the foreground, as `voiced serve` runs (the
    same loader, signals and drain), serving the benchmark's engines until SIGTERM or Ctrl-C."""
    from voiced import event_loop
    from voiced.core.agents import AgentRegistry
    from voiced.core.services import Services
    from voiced.daemon import Daemon, catch_stop_signals, drain_on_signal

    spec = bench_spec(args)

    async def run() -> None:
        services = Services(config=spec.config, agents=AgentRegistry(spec.config.agent))
        daemon = Daemon(spec.config, load=lambda: load_engines(spec), services=services)
        stop = catch_stop_signals()
        try:
            await daemon.start()
        except BaseException:
            await daemon.drain_and_stop(grace=0)
            raise
        log.info("serving the benchmark's engines: gRPC %s%s", spec.config.server.listen,
                 f", HTTP {spec.config.doors.http}" if spec.config.doors.http else "")
        await drain_on_signal(daemon, stop)

    event_loop.run(run(), spec.config.server.event_loop)
    log.info("stopped")
    return 0


class GcPauses:
    """Records every garbage collection of the process: generation and pause in ms. After a full collection
    of `census_ms` or longer it also counts what the collector still tracks, by type (the largest few), and
    what that collection freed: what made the pause long."""

    def __init__(self, census_ms: float = 50.0, top: int = 12):
        self._t0, self.pauses, self.census_ms, self.top, self.censuses = 0.0, [], census_ms, top, []

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        ms = (time.perf_counter() - self._t0) * 1e3
        self.pauses.append((info["generation"], ms))
        if info["generation"] == 2 and ms >= self.census_ms:
            import gc
            from collections import Counter

            t0 = time.perf_counter()
            kinds = Counter(type(o).__qualname__ for o in gc.get_objects())
            self.censuses.append({"pause_ms": round(ms, 1), "collected": info["collected"],
                                  "uncollectable": info["uncollectable"], "tracked": kinds.total(),
                                  "frozen": gc.get_freeze_count(), "top": dict(kinds.most_common(self.top)),
                                  "census_ms": round((time.perf_counter() - t0) * 1e3, 1)})

    def take(self) -> dict:
        p, self.pauses = self.pauses, []
        out = {}
        for gen in (0, 1, 2):
            ms = [m for g, m in p if g == gen]
            out[f"gen{gen}"] = {"n": len(ms), "max_ms": round(max(ms), 1) if ms else 0.0,
                                "total_ms": round(sum(ms), 1)}
        if self.censuses:
            out["slow_full"], self.censuses = self.censuses, []
        return out


def target_info(address: str) -> dict:
    """What a daemon already running says it serves (GetServerInfo), for a report on it (`--target`)."""
    import grpc
    from voiced_client.proto import voiced_pb2 as pb
    from voiced_client.proto import voiced_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        info = pb_grpc.VoicedStub(channel).GetServerInfo(pb.GetServerInfoRequest(), timeout=30)
    return {"target": address, "version": info.version, "max_sessions": info.max_sessions,
            **{name: {"model": m.name, "backend": m.backend, "device": m.device}
               for name, m in (("asr", info.asr), ("tts", info.tts)) if m.name}}


def runtime_report(spec: EngineSpec) -> dict:
    """How the engines ran, for the report (voiced.engines.runtime, as `voiced serve` resolved it)."""
    rt = spec.runtime
    return {"engine_process": rt.process, "engine_threads": rt.threads, "engine_overlap": rt.overlap,
            "engines": {name: dataclasses.asdict(o) for name, o in rt.engines.items()}}
