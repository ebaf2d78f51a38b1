"""The Piper engine's voices: the voice it was started with and every other voice in the cache.

What the doors list (gRPC ListVoices, /v1/audio/voices, Wyoming describe, the page's picker) and
resolve a caller's voice through: `list`, `has`, `resolve`; `add` and `delete` answer that Piper voices
cannot be cloned from a recording. A voice is loaded (its ONNX graph, ~60 MB, about a second) the first
time it is asked for and kept, up to `MAX_LOADED`.

Spark-TTS's preset names (`female`, `male-low`, `gender:pitch:speed`), which the OpenAI doors map their
own voice names onto (`alloy` -> `female`), resolve to the default voice: a client that always names a
voice still gets one from a server that speaks with Piper.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from voiced.engines.base import EngineError

from . import registry
from .voice import PiperVoice, VoiceConfig

log = logging.getLogger(__name__)

MAX_LOADED = 4  # voices held at once (~60-120 MB each); the least recently used one goes
ATTRIBUTION = ("Piper (rhasspy / Open Home Foundation)", "https://github.com/OHF-Voice/piper1-gpl")
_PRESET = re.compile(r"^(female|male)(-[a-z_]+)?$|^(female|male):[a-z_]+:[a-z_]+$")


@dataclass
class VoiceInfo:
    """A voice as the doors list it."""

    name: str
    kind: str  # "piper"
    description: str
    language: str = ""  # e.g. en_US
    licence: str = ""
    languages: list[str] = field(default_factory=list)  # what Wyoming advertises for it


@dataclass(frozen=True)
class Resolved:
    """A voice as `resolve` names it (plain data: it crosses to the daemon from an engine process)."""

    name: str
    kind: str
    any_speed: bool = True  # speaks at the rate TTSOptions.speed asks (its length scale divided by it)


def language_codes(voices: list[VoiceInfo]) -> tuple[str, ...]:
    """ISO 639-1 codes of the voices' languages, first seen first (`en_US` -> `en`)."""
    return tuple(dict.fromkeys(v.language.split("_")[0] for v in voices if v.language))


class PiperVoices:
    """The voices a Piper engine speaks with; `default` is the one it was started with."""

    def __init__(self, default: PiperVoice, threads: int = 1, root: Path | None = None,
                 espeak_data: str | Path | None = None) -> None:
        self.default_name = default.model_path.stem
        self.threads, self.root, self.espeak_data = threads, root, espeak_data
        self._loaded: OrderedDict[str, PiperVoice] = OrderedDict({self.default_name: default})
        self._lock = threading.Lock()  # doors resolve on their threads while the engine thread synthesizes

    def _files(self) -> dict[str, Path]:
        found = {v.name: v.model for v in registry.on_disk(self.root)}
        found.setdefault(self.default_name, self._loaded[self.default_name].model_path)
        return found

    def list(self) -> list[VoiceInfo]:
        return [self._info(name, model) for name, model in self._files().items()]

    def has(self, name: str) -> bool:
        return name in self._loaded or name in self._files()

    def resolve(self, name: str | None) -> Resolved:
        """A voice by name (None, or a Spark-TTS preset name: the default voice); EngineError for one this
        server does not have. What the doors check a caller's voice with: nothing is loaded."""
        if not name or _PRESET.match(name):
            return Resolved(self.default_name, "piper")
        if name not in self._loaded and name not in self._files():
            raise EngineError(f"unknown voice {name!r}; this server's Piper voices: {', '.join(self._files())}. "
                              f"Add one with `voiced models pull piper:<voice>` (e.g. piper:{registry.DEFAULT_VOICE})")
        return Resolved(name, "piper")

    def voice(self, name: str | None) -> PiperVoice:
        """The loaded voice `resolve(name)` names (loaded on first use)."""
        name = self.resolve(name).name
        with self._lock:
            voice = self._loaded.get(name)
            if voice is not None:
                self._loaded.move_to_end(name)
                return voice
        voice = PiperVoice.load(self._files()[name], self.threads, self.espeak_data)
        with self._lock:
            self._loaded[name] = voice
            while len(self._loaded) > MAX_LOADED:
                del self._loaded[next(n for n in self._loaded if n != self.default_name)]
        log.info("Piper voice %s loaded from %s", name, voice.model_path)
        return voice

    def add(self, name: str, audio, transcript: str):
        raise EngineError("Piper voices cannot be cloned from a recording; add a voice with `voiced models pull "
                          "piper:<voice>` (the server lists it after a restart), or serve with Spark-TTS on a GPU")

    def delete(self, name: str) -> bool:
        raise EngineError("Piper voices are models in the cache, not registered voices; remove its folder under "
                          f"{registry.piper_cache(self.root)} to delete one")

    def _info(self, name: str, model: Path) -> VoiceInfo:
        loaded = self._loaded.get(name)
        try:
            config = loaded.config if loaded is not None else VoiceConfig.read(model.with_name(model.name + ".json"))
            language, quality = config.language, config.quality
        except EngineError:
            language, quality = "", ""
        licence = registry.licence(model.parent)
        default = ", the default" if name == self.default_name else ""
        return VoiceInfo(name, "piper", f"Piper voice, {language or 'language unknown'}, {quality or '?'} quality"
                                        f"{default}; voice licence: {licence}", language, licence,
                         [language] if language else [])
