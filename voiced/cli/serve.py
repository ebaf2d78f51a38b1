"""`voiced serve`: run the daemon."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from voiced.cli import CliError
from voiced.config import ASR_WINDOWS

log = logging.getLogger("voiced.serve")


def register(sub) -> None:
    p = sub.add_parser("serve", help="run the daemon", description=(
        "Serve voiced.v1 over gRPC, and the front doors configured under [doors]. Settings come from the config file, then VOICED_<SECTION>_<KEY> "
        "environment variables, then these flags."))
    p.add_argument("--config", help="TOML config file (default: $VOICED_CONFIG)")
    p.add_argument("--listen", help="address to listen on (default 127.0.0.1:50051)")
    p.add_argument("--asr-model", help="Whisper model: auto (the default: fits the machine), a name (see "
                   "`voiced models list`) or a path")
    p.add_argument("--asr-window", choices=ASR_WINDOWS, help="Whisper's encoder window: auto (the default: "
                   "on a CPU sized to the clip, ~30 %% faster, approximate; 30 s on a GPU) or full (30 s everywhere, "
                   "as openai-whisper)")
    p.add_argument("--tts-model", help="speech model: auto (the default: Spark-TTS on a GPU, a Piper voice on a "
                   "CPU), spark-tts-0.5b or a Spark-TTS folder, or a Piper voice (piper:en_US-joe-medium, "
                   "piper-joe-pypi, or a .onnx file)")
    p.add_argument("--tts-threads", type=int, help="onnxruntime threads of a Piper voice (default 1: recognition "
                   "keeps the other cores)")
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N for both models (default auto)")
    p.add_argument("--backend", choices=["auto", "torch", "trtllm"], help="engine backend for both models")
    p.add_argument("--no-tts", action="store_true", help="listening only: no speech synthesis (transcription users)")
    p.add_argument("--no-tts-compile", action="store_true",
                   help="run the TTS LM uncompiled on a GPU: ~20 s faster start-up, ~2.5x slower decode steps "
                        "([tts] compile = false)")
    p.add_argument("--turn-detection", choices=["smart", "silence"], help="how a caller's turn ends: smart (the "
                   "default, where the end-of-turn model is: the words, the model and the silence decide at each "
                   "short pause) or silence (segmentation.hangover_ms of it)")
    p.add_argument("--turn-eagerness", choices=["low", "medium", "high"], help="smart turn detection: how soon "
                   "it answers; waits at most 8 / 4 / 2 s of silence (default medium)")
    p.add_argument("--agent", help="default agent for sessions that name none: echo, openai, client or a plug-in")
    p.add_argument("--max-sessions", type=int, help="concurrent streaming sessions before RESOURCE_EXHAUSTED")
    p.add_argument("--metrics-listen", help="serve Prometheus metrics on HOST:PORT (default: off)")
    p.add_argument("--allow-unauthenticated-network", action="store_true", default=None,
                   help="let --listen or --http bind beyond loopback with no server.auth_token (refused otherwise): "
                        "only where the network is your own (server.allow_unauthenticated_network)")
    p.add_argument("--handshake-timeout", type=float, metavar="SECONDS",
                   help="a connection's TLS handshake, HTTP headers and first message must arrive within this "
                        "(default 10)")
    p.add_argument("--max-connections", type=int, help="open connections of all doors but gRPC before new ones "
                   "are refused (default 2000)")
    p.add_argument("--max-connections-per-door", type=int, help="the same for each door (default 1000)")
    p.add_argument("--audiosocket", metavar="HOST:PORT", help="open the Asterisk AudioSocket door there")
    p.add_argument("--media-ws", metavar="HOST:PORT", help="open the telephony media-stream WebSocket door there")
    p.add_argument("--wyoming", metavar="tcp://HOST:PORT", help="open the Wyoming (Home Assistant) door there")
    p.add_argument("--http", metavar="HOST:PORT", help="open the HTTP listener there")
    p.add_argument("--engine-process", choices=["auto", "inline", "separate"],
                   help="run the engines in the daemon's process (inline) or in a process of their own "
                        "(separate: the doors' and sessions' Python no longer shares a GIL with the engine "
                        "threads); auto (the default): separate on a GPU, inline on the CPU (engines.process)")
    p.add_argument("--engine-threads", choices=["auto", "shared", "separate"],
                   help="step both engines on one thread (shared) or one each (separate); auto (the default): "
                        "separate on a GPU with the engines in the daemon's process, else shared")
    p.add_argument("--engine-overlap", choices=["auto", "on", "off"],
                   help="with both engines on one thread, launch each one's GPU work before waiting on any (on) "
                        "or step them one after the other (off); auto (the default): on with a GPU "
                        "(engines.overlap)")
    p.add_argument("--event-loop", choices=["uvloop", "asyncio"],
                   help="the event loop every door runs in: uvloop (the default: less CPU per caller frame) or "
                        "asyncio (the standard library's)")
    p.set_defaults(func=run)


def overrides(args: argparse.Namespace) -> dict:
    out = {
        "server.listen": args.listen,
        "asr.model": args.asr_model,
        "asr.window": args.asr_window,
        "tts.model": args.tts_model,
        "tts.threads": args.tts_threads,
        "asr.device": args.device,
        "tts.device": args.device,
        "asr.backend": args.backend,
        "tts.backend": args.backend,
        "agent.default": args.agent,
        "segmentation.turn_detection": args.turn_detection,
        "segmentation.eagerness": args.turn_eagerness,
        "server.max_sessions": args.max_sessions,
        "server.metrics_listen": args.metrics_listen,
        "server.allow_unauthenticated_network": args.allow_unauthenticated_network,
        "server.handshake_timeout_s": args.handshake_timeout,
        "server.max_connections": args.max_connections,
        "server.max_connections_per_door": args.max_connections_per_door,
        "doors.audiosocket": args.audiosocket,
        "doors.media_ws": args.media_ws,
        "doors.wyoming": args.wyoming,
        "doors.http": args.http,
        "engines.threads": args.engine_threads,
        "engines.process": args.engine_process,
        "engines.overlap": args.engine_overlap,
        "server.event_loop": args.event_loop,
    }
    if args.no_tts:
        out["tts.enabled"] = False
    if args.no_tts_compile:
        out["tts.compile"] = False
    return out


def passive_openmp_waits() -> None:
    """torch's CPU kernels run on OpenMP threads (one per core), which by default spin for the next parallel
    region instead of sleeping. Where the cores are busy (callers, another job), a spinning thread holds a
    core its partner in the same region needs, so each region waits for the scheduler: with a job filling
    one of two cores, 4 callers' decodes run at half speed and a caller's hang-up takes 13-30 s to drain
    (passive: 2-5 s); idle, passive waits cost nothing measurable. libgomp reads the
    policy when torch loads, so this runs first; an operator's own OMP_WAIT_POLICY is kept."""
    if "torch" in sys.modules:
        log.debug("torch was loaded before OMP_WAIT_POLICY could be set; OpenMP keeps its default waits")
        return
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # inherited by an engine process (engines.process)


def compile_caches_beside_models() -> None:
    """Keep torch.compile's and Triton's compiled kernels in the model cache (`VOICED_CACHE`, default
    ~/.cache/voiced, under compile/), which deployments keep across restarts (a mounted volume), where
    their defaults (/tmp/torchinductor_USER, ~/.triton) are often lost with the container. A GPU daemon's
    start-up compiles for a minute or more: 140 s on a machine new to the kernels, about 60 s with them
    cached. Both
    settings are read at the first compile, which is in the engines' warm-up, after this; an operator's
    own settings are kept, and a cache that cannot be written leaves torch's defaults."""
    from voiced.hub import cache_dir

    wanted = {var: cache_dir() / "compile" / sub for var, sub in
              (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")) if var not in os.environ}
    try:
        for path in wanted.values():
            path.mkdir(parents=True, exist_ok=True)
            if not os.access(path, os.W_OK):
                raise PermissionError(f"{path} is not writable")
    except OSError as e:
        log.warning("compiled kernels stay in torch's default caches: %s", e)
        return
    for var, path in wanted.items():
        os.environ[var] = str(path)  # inherited by an engine process (engines.process)


def run(args: argparse.Namespace) -> int:
    passive_openmp_waits()
    compile_caches_beside_models()
    from voiced.config import ConfigError, load_config

    try:
        config = load_config(args.config, overrides=overrides(args))
        config.validate()
    except ConfigError as e:
        raise CliError(str(e)) from None
    from voiced.engines.backend import BackendError
    from voiced.engines.provision import prepare
    from voiced.hub import DownloadError, ModelNotFoundError

    try:
        provisioned = prepare(config)  # models that fit this machine; fetched on first run (voiced.engines.provision)
    except (ModelNotFoundError, DownloadError, BackendError, ValueError) as e:
        raise CliError(str(e)) from None
    from voiced.assembly import EngineSpec
    from voiced.engines.loader import gpu_memory

    try:
        spec = EngineSpec.resolve(config)  # how the engines run: settled once, here (voiced.engines.runtime)
    except ValueError as e:
        raise CliError(str(e)) from None
    mem = gpu_memory(spec.runtime.asr.device)
    if mem is not None and "torch" not in (config.asr.backend, config.tts.backend):
        log.info("\n%s", config.memory.table(mem.free))
    from voiced import event_loop

    return event_loop.run(_serve(spec, provisioned.tts_missing), config.server.event_loop)


async def _serve(spec, tts_missing: str = "") -> int:
    from voiced.assembly import load_engines
    from voiced.core.agents import AgentRegistry
    from voiced.core.services import Services
    from voiced.daemon import Daemon, catch_stop_signals, drain_on_signal
    from voiced.doors import DoorError
    from voiced.hub import DownloadError, ModelNotFoundError

    config = spec.config
    # Listening only because no voice could be had, not because the user said --no-tts: speech requests say why.
    off = {"tts_off": f"this server only listens: it has no speech synthesis model. {tts_missing}"} if tts_missing else {}
    services = Services(config=config, agents=AgentRegistry(config.agent), **off)
    daemon = Daemon(config, load=lambda: load_engines(spec), services=services)
    stop = catch_stop_signals()  # (a Ctrl-C while the models load drains as soon as they are up)
    try:
        await daemon.start()
    except (ModelNotFoundError, DownloadError, DoorError, FileNotFoundError, ValueError, OSError) as e:
        await daemon.drain_and_stop(grace=0)
        raise CliError(str(e)) from None
    except Exception as e:  # engine errors and the like: one clear line, then out
        from voiced.engines.base import EngineError

        await daemon.drain_and_stop(grace=0)
        if isinstance(e, EngineError):
            raise CliError(str(e)) from None
        raise
    await drain_on_signal(daemon, stop)
    log.info("stopped")
    return 0
