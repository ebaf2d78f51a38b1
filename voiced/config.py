"""Daemon configuration: one TOML file, then `VOICED_*` environment variables, then flags.

Every setting lives in a dataclass below; the TOML table is the section name and the environment
variable is `VOICED_<SECTION>_<KEY>` (e.g. `VOICED_SERVER_LISTEN=0.0.0.0:50051`,
`VOICED_ASR_MODEL=large-v3-turbo`). Unknown keys are errors, so a typo never silently does nothing.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from voiced.memory_plan import MemoryPlan, MemoryPlanError

BACKENDS = ("auto", "torch", "trtllm")
# Whisper's encoder window: "full" is Whisper's 30 s (results as openai-whisper's); "auto" sizes it to the clip
# on a CPU, ~30 % faster (voiced/engines/whisper/clip_window.py), and keeps 30 s on a GPU.
ASR_WINDOWS = ("auto", "full")

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and what to set."""


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:50051"
    max_sessions: int = 200
    max_message_bytes: int = 4 * 1024 * 1024  # audio frames are tiny; AddVoice uploads are not
    keepalive_time_ms: int = 20000
    keepalive_timeout_ms: int = 10000
    drain_seconds: float = 30.0  # how long SIGTERM waits for sessions to finish
    auth_token: str = ""  # when set, callers send `authorization: Bearer <token>`
    # gRPC or HTTP bound beyond loopback with no auth_token is refused at start unless this says the network
    # is the operator's own (a container whose ports are published to the host's loopback, a private LAN).
    allow_unauthenticated_network: bool = False
    tls_cert: str = ""  # PEM files; both set: TLS
    tls_key: str = ""
    metrics_listen: str = ""  # e.g. 127.0.0.1:9090; empty: no metrics endpoint
    # Limits on one stream, enforced by the session core for every door (0: no limit).
    # Idle: a push-to-talk client sends nothing between turns, and a user may pause for minutes; a
    # dead peer is found by keepalive within seconds anyway, so this only catches a live client that
    # forgot its stream. Telephony streams send audio all the time and never trip it.
    idle_timeout_s: float = 600.0
    max_session_s: float = 7200.0  # longer than any call; frees a line a gateway never hung up
    max_outbound_bytes: int = 2 * 1024 * 1024  # responses waiting for a caller that does not read them
    # Before a caller is let in (voiced.doors.guard): its TLS handshake, an HTTP request's line and headers
    # (WebSocket upgrades too) and a connection's first message (media-ws, Wyoming, Realtime) within this.
    # Field clients send all of them at once; a slow-loris client sends a header byte every 10 s.
    handshake_timeout_s: float = 10.0
    # Open connections of every door but gRPC (whose HTTP/2 server bounds its own): past either limit a
    # new one is refused in its door's protocol. Each is a descriptor; both are held under the open-file limit.
    max_connections: int = 2000
    max_connections_per_door: int = 1000
    # The daemon's event loop, where every door and the session core run: "uvloop" (less of the loop's
    # CPU per caller frame: voiced.event_loop) or "asyncio" (the standard library's).
    event_loop: str = "uvloop"


@dataclass
class SegmentationConfig:
    """Defaults for sessions that leave these unset (see voiced.core.segmenter)."""

    vad_aggressiveness: int = 2
    pre_roll_ms: int = 300
    hangover_ms: int = 500
    min_speech_ms: int = 100
    max_utterance_ms: int = 30000
    # How a turn ends (voiced.core.turns): "smart" decides at each short pause from the words, the
    # end-of-turn model and the silence so far (where the model is on disk; else silence, said once at
    # start); "silence" ends it after hangover_ms of silence.
    turn_detection: str = "smart"
    eagerness: str = "medium"  # smart: low | medium | high (at most 8 / 4 / 2 s of silence before a reply)
    turn_model: str = ""  # smart's end-of-turn model: empty: smart-turn-v3 from the cache; a name or an .onnx path


@dataclass
class ASRConfig:
    model: str = "auto"  # auto: large-v3-turbo on a GPU, base on a CPU; or a name (`voiced models list`) or a path
    backend: str = "auto"  # auto | torch | trtllm
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = ""  # empty: float16 on GPU, float32 on CPU; "int8": int8 GEMMs on the CPU (approximate, faster)
    window: str = "auto"  # the encoder's: auto: sized to the clip on a CPU, 30 s on a GPU; full: 30 s
    # decoder rows shared by all callers; 0: on a GPU the most, up to 64, that whisper_kv_fraction holds, 8 on a CPU
    max_batch: int = 0
    language: str = ""  # default for sessions; empty: detect
    beam_size: int = 1
    max_new_tokens: int = 0  # 0: the model's limit (half its text context)
    no_speech_threshold: float = 0.6
    logprob_threshold: float = -1.0
    compression_ratio_threshold: float = 2.4
    interim_interval_ms: int = 1000  # how often interim results are computed while speaking


@dataclass
class TTSConfig:
    enabled: bool = True
    # auto: Spark-TTS on a GPU, a Piper voice on a CPU (voiced.engines.provision); or a name / path of either
    model: str = "auto"
    backend: str = "auto"
    device: str = "auto"
    dtype: str = ""
    # replies generated together; 0: on a GPU the most, up to 64, that tts_kv_fraction holds, 16 on a CPU
    max_batch: int = 0
    voice: str = ""  # default voice; empty: the engine's default preset
    voices_dir: str = ""  # cloned voices; empty: <cache>/voices
    first_chunk_tokens: int = 10
    chunk_tokens: int = 25
    max_seconds: float = 30.0
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    # onnxruntime threads a Piper voice synthesizes with (CPU): 1 leaves the other cores to recognition, which
    # then stays real time beside it on a 2-core machine
    threads: int = 1
    # torch.compile the LM's decode and prefill layers on a GPU: a decode step ~2.5x faster, start-up ~20 s
    # longer (more on a machine new to the kernels); false starts faster and steps slower (CUDA graphs still on)
    compile: bool = True


@dataclass
class AgentConfig:
    default: str = "echo"  # echo | openai | client | a plug-in's name
    system_prompt: str = "You are a helpful voice assistant. Answer briefly, in plain spoken sentences."
    openai_base_url: str = "http://127.0.0.1:8000/v1"
    openai_api_key: str = ""
    openai_model: str = "default"
    openai_timeout_s: float = 30.0
    max_history_turns: int = 20
    reply_timeout_s: float = 30.0  # an agent silent this long (before a piece of its answer) is given up


@dataclass
class BargeInConfig:
    enabled: bool = True
    # Caller speech over a reply must last this long (to its last voiced frame) to stop it: shorter is
    # a backchannel ("mm-hmm", "okay", a cough), which the reply talks through (LiveKit's minimum
    # interruption duration is 0.5 s too).
    min_speech_ms: int = 500


@dataclass
class EnginesConfig:
    dir: str = "engines"  # built TensorRT-LLM engines: <dir>/<model>/ with a manifest.json
    # "shared": one thread steps both engines, recognition first (voiced.core.scheduler says why);
    # "separate": a thread each, so one engine's host work and syncs overlap the other's GPU work
    # (ahead at 16, 64 and 128 callers on an H200, docs/BENCHMARKS.md "Engine threads"; their step
    # transients may then coexist, and the memory plan counts both). "auto": separate on a GPU,
    # shared on the CPU (where two threads would only fight over the same cores), the default.
    threads: str = "auto"
    # "inline": the engines run in the daemon's process; "separate": in a child process of their own,
    # so the event loop's Python (every caller's frames) and the engine threads' do not share one GIL
    # (voiced.engine_process); "auto": separate on a GPU (ahead at 16, 64 and 128 callers on an H100,
    # docs/BENCHMARKS.md), inline on the CPU, the default. There "auto" threads are shared.
    process: str = "auto"
    # With one thread stepping both engines: "on" launches each engine's step (its CUDA work) before
    # waiting on any, so recognition's and the TTS's kernels, host work and read-backs overlap
    # (voiced.core.scheduler, "overlap"); "off" steps one engine to its end, then the other, recognition
    # first in bursts. "auto": on with a GPU, off on the CPU (where nothing runs asynchronously), the
    # default: on an H200 it carried 176 callers under a 500 ms p99 against under 160 off
    # (docs/BENCHMARKS.md, session 12).
    overlap: str = "auto"


@dataclass
class DoorsConfig:
    """Front doors besides gRPC (`server.listen`, always open): an address opens one, empty leaves it
    off (the default). Bind 127.0.0.1 to stay local, as gRPC's default does."""

    audiosocket: str = ""  # Asterisk AudioSocket, HOST:PORT
    media_ws: str = ""  # telephony media-stream WebSocket (Twilio's format), HOST:PORT
    wyoming: str = ""  # Wyoming (Home Assistant), tcp://HOST:PORT
    http: str = ""  # the HTTP listener (OpenAI-style audio API, health, web page), HOST:PORT


@dataclass
class PhoneDoorConfig:
    """What every call through one telephony door (AudioSocket, media WebSocket) gets."""

    agent: str = ""  # empty: [agent] default
    voice: str = ""  # empty: [tts] voice
    greeting: str = ""  # spoken as soon as a call starts; empty: none


@dataclass
class HttpConfig:
    """Limits of the HTTP door (`[doors] http`): OpenAI's audio API and the Realtime WebSocket."""

    max_upload_bytes: int = 25 * 1024 * 1024  # one transcription upload (OpenAI's own limit); larger: 413
    max_input_chars: int = 4096  # the text of one /v1/audio/speech request (OpenAI's limit)
    max_form_fields: int = 64  # fields of one multipart upload (OpenAI's API has 10); more: 400
    body_timeout_s: float = 300.0  # one request body (an upload at max_upload_bytes over ~1 Mbit/s); slower: 408


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    segmentation: SegmentationConfig = field(default_factory=SegmentationConfig)
    asr: ASRConfig = field(default_factory=ASRConfig)
    tts: TTSConfig = field(default_factory=TTSConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    barge_in: BargeInConfig = field(default_factory=BargeInConfig)
    engines: EnginesConfig = field(default_factory=EnginesConfig)
    doors: DoorsConfig = field(default_factory=DoorsConfig)
    audiosocket: PhoneDoorConfig = field(default_factory=PhoneDoorConfig)  # calls through [doors] audiosocket
    media_ws: PhoneDoorConfig = field(default_factory=PhoneDoorConfig)  # calls through [doors] media_ws
    http: HttpConfig = field(default_factory=HttpConfig)
    memory: MemoryPlan = field(default_factory=MemoryPlan)  # GPU memory fractions (voiced.memory_plan)

    def set(self, section: str, key: str, value: Any, source: str) -> None:
        """Set one value with type coercion; `source` names where it came from for errors."""
        table = getattr(self, section, None)
        if table is None or not dataclasses.is_dataclass(table):
            raise ConfigError(f"{source}: unknown section [{section}]; sections: {', '.join(SECTIONS)}")
        types = typing.get_type_hints(type(table))
        if key not in types:
            known = ", ".join(f.name for f in dataclasses.fields(table))
            raise ConfigError(f"{source}: unknown key {section}.{key}; [{section}] has: {known}")
        value = _coerce(types[key], value, f"{source}: {section}.{key}")
        if type(table).__dataclass_params__.frozen:
            setattr(self, section, dataclasses.replace(table, **{key: value}))
        else:
            setattr(table, key, value)

    def validate(self) -> None:
        try:
            self.memory.validate()
        except MemoryPlanError as e:
            raise ConfigError(str(e)) from None
        if self.engines.threads not in ENGINE_THREADS:
            raise ConfigError(f"engines.threads is {self.engines.threads!r}; use {', '.join(ENGINE_THREADS)}")
        if self.engines.process not in ENGINE_PROCESS:
            raise ConfigError(f"engines.process is {self.engines.process!r}; use {', '.join(ENGINE_PROCESS)}")
        if self.engines.overlap not in ENGINE_OVERLAP:
            raise ConfigError(f"engines.overlap is {self.engines.overlap!r}; use {', '.join(ENGINE_OVERLAP)}")
        for key, value in (("asr.max_batch", self.asr.max_batch), ("tts.max_batch", self.tts.max_batch)):
            if value < 0:
                raise ConfigError(f"{key} is {value}; set the rows to hold, or 0 for as many as the GPU's "
                                  "[memory] share holds (up to 64)")
        if self.tts.threads < 1:
            raise ConfigError(f"tts.threads is {self.tts.threads}; set the onnxruntime threads of a Piper voice, "
                              "at least 1")
        if self.asr.window not in ASR_WINDOWS:
            raise ConfigError(f"asr.window is {self.asr.window!r}; use {' or '.join(ASR_WINDOWS)}")
        if self.asr.backend not in BACKENDS or self.tts.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}")
        for key in ("server.idle_timeout_s", "server.max_session_s", "agent.reply_timeout_s",
                    "server.handshake_timeout_s", "http.body_timeout_s"):
            section, name = key.split(".")
            value = getattr(getattr(self, section), name)
            if not value >= 0:  # also catches NaN
                raise ConfigError(f"{key} is {value}; set seconds (0 switches the limit off)")
        if self.segmentation.turn_detection not in ("smart", "silence"):
            raise ConfigError(f"segmentation.turn_detection is {self.segmentation.turn_detection!r}; "
                              "set smart or silence")
        if self.segmentation.eagerness not in ("low", "medium", "high"):
            raise ConfigError(f"segmentation.eagerness is {self.segmentation.eagerness!r}; set low, medium or high")
        if self.server.event_loop not in EVENT_LOOPS:
            raise ConfigError(f"server.event_loop is {self.server.event_loop!r}; set {' or '.join(EVENT_LOOPS)}")
        for key in ("server.max_connections", "server.max_connections_per_door", "http.max_form_fields"):
            section, name = key.split(".")
            if getattr(getattr(self, section), name) < 1:
                raise ConfigError(f"{key} is {getattr(getattr(self, section), name)}; set at least 1")
        if self.server.max_outbound_bytes < 65536:
            raise ConfigError(f"server.max_outbound_bytes is {self.server.max_outbound_bytes}; "
                              "set at least 65536 (one second of 16 kHz audio is 32000 bytes)")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS = [f.name for f in dataclasses.fields(Config)]
ENGINE_THREADS = ("auto", "shared", "separate")
ENGINE_PROCESS = ("auto", "inline", "separate")
ENGINE_OVERLAP = ("auto", "on", "off")
EVENT_LOOPS = ("uvloop", "asyncio")  # voiced.event_loop.KINDS (config imports nothing of the daemon's)


def _coerce(kind: type, value: Any, where: str) -> Any:
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if kind is int:
            if isinstance(value, bool):
                raise ValueError(value)
            return int(value)
        if kind is float:
            return float(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {value!r} is not a valid {kind.__name__}") from None


def load_config(
    path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """File, then environment, then `overrides` ({"section.key": value}, from flags)."""
    config = Config()
    env = os.environ if env is None else env
    path = path or env.get("VOICED_CONFIG") or None
    if path:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{p}: not valid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{p}: {section} must be a table ([{section}])")
            if section not in SECTIONS:
                raise ConfigError(f"{p}: unknown section [{section}]; sections: {', '.join(SECTIONS)}")
            for key, value in table.items():
                config.set(section, key, value, str(p))
    for name, value in env.items():
        if not name.startswith("VOICED_") or name in _NOT_SETTINGS:
            continue
        rest = name[len("VOICED_") :].lower()
        if rest in _MEMORY_KEYS:  # a [memory] key without its section: say the name that sets it
            raise ConfigError(f"environment {name}: [memory] keys are set as VOICED_MEMORY_<KEY>; "
                              f"use VOICED_MEMORY_{rest.upper()}")
        section = next((s for s in SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            continue  # other tools' variables (VOICED_CACHE, ...)
        config.set(section, rest[len(section) + 1 :], value, f"environment {name}")
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section, key = dotted.split(".", 1)
        config.set(section, key, value, "command line")
    return config


# Variables that share the prefix but are not config keys.
_NOT_SETTINGS = {"VOICED_CONFIG", "VOICED_CACHE"}
_MEMORY_KEYS = {f.name for f in dataclasses.fields(MemoryPlan)}
