"""Voices: built-in controllable presets, and cloned voices registered from a recording.

A preset names the style labels of the controllable prompt (gender, pitch, speed); the LM invents a
speaker to match. `female`, `male`, `female-high`, ... are listed; any `gender:pitch:speed` spec
(e.g. `male:low:very_high`) works too.

A cloned voice is a reference recording plus its transcript. What the LM needs from the recording is
its BiCodec tokens: 32 global tokens (from a 6 s mel) and the semantic tokens of the whole clip (from
wav2vec2 features). Computing them runs wav2vec2, so they are cached on disk under the audio's sha256
(of its 16 kHz PCM16 samples) and the checkpoint's fingerprint: registering the same recording again,
under any name, computes nothing, and voices survive restarts. Layout under `root`:

    voices/<name>.json              name, transcript, audio sha256, duration, created
    audio/<sha256>.wav              the 16 kHz reference (so another checkpoint can re-tokenize it)
    tokens/<fingerprint>/<sha256>.json   {"global": [...32], "semantic": [...]}
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import wave
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from voiced_client.wavio import float_to_int16

from voiced.engines.base import EngineError

from .checkpoint import GENDERS, LEVELS

log = logging.getLogger(__name__)

SAMPLE_RATE = 16000
MIN_REFERENCE_S = 1.0
MAX_REFERENCE_S = 30.0  # its semantic tokens go into every prompt: 30 s is 1500 tokens of context
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")

# (gender, pitch, speed) of the listed presets.
PRESETS: dict[str, tuple[str, str, str]] = {
    "female": ("female", "moderate", "moderate"),
    "male": ("male", "moderate", "moderate"),
    "female-high": ("female", "high", "moderate"),
    "female-low": ("female", "low", "moderate"),
    "male-high": ("male", "high", "moderate"),
    "male-low": ("male", "low", "moderate"),
    "female-fast": ("female", "moderate", "high"),
    "female-slow": ("female", "moderate", "low"),
    "male-fast": ("male", "moderate", "high"),
    "male-slow": ("male", "moderate", "low"),
}
DEFAULT_VOICE = "female"
LANGUAGES = ("en", "zh")  # what Spark-TTS-0.5B was trained to speak, with any voice


@dataclass
class VoiceInfo:
    """What `voiced voices list` and the daemon's ListVoices show."""

    name: str
    kind: str  # "preset" | "cloned"
    description: str
    transcript: str | None = None
    audio_sha256: str | None = None
    duration_s: float | None = None
    created: float | None = None


@dataclass
class Voice:
    """A voice resolved for prompting: either style labels or reference tokens."""

    name: str
    kind: str
    gender: str | None = None
    pitch: str | None = None
    speed: str | None = None
    global_ids: list[int] | None = None
    semantic_ids: list[int] | None = None
    transcript: str | None = None


def parse_preset(name: str) -> tuple[str, str, str] | None:
    if name in PRESETS:
        return PRESETS[name]
    parts = name.split(":")
    if len(parts) == 3 and parts[0] in GENDERS and parts[1] in LEVELS and parts[2] in LEVELS:
        return parts[0], parts[1], parts[2]
    return None


def audio_sha256(samples: np.ndarray) -> str:
    return hashlib.sha256(_pcm16(samples).tobytes()).hexdigest()


def _pcm16(samples: np.ndarray) -> np.ndarray:
    # x * 32768, as every reader of PCM16 divides (`_load_audio`, voiced_client.wavio): the stored
    # recording reads back as the samples registered, bit for bit, and a PCM16 file's own samples are
    # stored unchanged, so tokens computed again after a restart equal those computed at registration.
    return float_to_int16(samples).astype("<i2", copy=False)


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)  # atomic: a crash never leaves half a voice


Tokenizer = Callable[[np.ndarray], tuple[list[int], list[int]]]


class VoiceStore:
    """Presets plus the cloned voices in `root`; `tokenize` maps 16 kHz audio to (global, semantic) ids."""

    def __init__(self, root: str | Path, fingerprint: str | Callable[[], str], tokenize: Tokenizer) -> None:
        self.root = Path(root)
        self._fingerprint = fingerprint  # or a function computing it, called on first need
        self._tokenize = tokenize
        self.tokenize_calls = 0  # how many times registration actually ran the audio tokenizer
        # When set, every name resolves to this voice (benchmarks on random weights, where no
        # registered voice exists: see SparkTTSEngine.use_random_voice).
        self.only: Voice | None = None

    @property
    def fingerprint(self) -> str:
        if callable(self._fingerprint):
            self._fingerprint = self._fingerprint()
        return self._fingerprint

    # ----------------------------------------------------------------------------- public API

    def list(self) -> list[VoiceInfo]:
        out = [VoiceInfo(n, "preset", f"built-in: {g}, {p} pitch, {s} speed") for n, (g, p, s) in PRESETS.items()]
        vdir = self.root / "voices"
        if vdir.is_dir():
            for f in sorted(vdir.glob("*.json")):
                try:
                    rec = json.loads(f.read_text())
                    out.append(self._info(rec))
                except (OSError, ValueError, KeyError) as e:
                    log.warning("skipping unreadable voice file %s: %s", f, e)
        return out

    def add(self, name: str, audio: np.ndarray, transcript: str) -> VoiceInfo:
        """Register (or replace) cloned voice `name` from 16 kHz float32 `audio` and its transcript."""
        if not _NAME.fullmatch(name or ""):
            raise EngineError(f"voice name {name!r} is invalid: use 1-64 letters, digits, '_', '-', '.'")
        if parse_preset(name) is not None:
            raise EngineError(f"{name!r} is a built-in preset; pick another name")
        transcript = (transcript or "").strip()
        if not transcript:
            raise EngineError("the transcript is empty; give the words spoken in the recording")
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        dur = audio.shape[0] / SAMPLE_RATE
        if dur < MIN_REFERENCE_S:
            raise EngineError(f"the recording is {dur:.2f} s; give at least {MIN_REFERENCE_S:.0f} s (3-10 s is best)")
        if dur > MAX_REFERENCE_S:
            raise EngineError(f"the recording is {dur:.1f} s; give at most {MAX_REFERENCE_S:.0f} s (3-10 s is best)")
        if not np.isfinite(audio).all() or np.abs(audio).max() < 1e-4:
            raise EngineError("the recording is silent or invalid")
        sha = audio_sha256(audio)
        self._store_audio(sha, audio)
        self.tokens(sha)  # compute now (or find cached) so errors surface at registration
        rec = {"name": name, "transcript": transcript, "audio_sha256": sha, "duration_s": round(dur, 3),
               "created": time.time()}
        _write_json(self.root / "voices" / f"{name}.json", rec)
        log.info("voice %r registered (%.1f s, sha256 %s)", name, dur, sha[:12])
        return self._info(rec)

    def delete(self, name: str) -> bool:
        """Remove cloned voice `name`; returns False when there was none. Cached tokens stay (other
        voices may share the recording); they are small."""
        if parse_preset(name) is not None:
            raise EngineError(f"{name!r} is a built-in preset and cannot be deleted")
        path = self.root / "voices" / f"{name}.json"
        if not _NAME.fullmatch(name or "") or not path.exists():
            return False
        path.unlink()
        return True

    def has(self, name: str) -> bool:
        """Whether `name` is a voice of this store (a preset, gender:pitch:speed, or a cloned voice),
        without computing anything."""
        return parse_preset(name) is not None or self._record(name) is not None

    def resolve(self, name: str | None) -> Voice:
        """A voice name (None: the default preset) -> what the prompt needs."""
        if self.only is not None:
            return self.only
        name = name or DEFAULT_VOICE
        preset = parse_preset(name)
        if preset is not None:
            g, p, s = preset
            return Voice(name, "preset", gender=g, pitch=p, speed=s)
        rec = self._record(name)
        if rec is None:
            names = ", ".join(v.name for v in self.list())
            raise EngineError(f"unknown voice {name!r}; known voices: {names} (or gender:pitch:speed, "
                              f"e.g. female:high:moderate). Add one with `voiced voices add`.")
        g, s = self.tokens(rec["audio_sha256"])
        return Voice(name, "cloned", global_ids=g, semantic_ids=s, transcript=rec["transcript"])

    def tokens(self, sha: str) -> tuple[list[int], list[int]]:
        """(global, semantic) ids of stored recording `sha` under this checkpoint, computing them once."""
        path = self.root / "tokens" / self.fingerprint / f"{sha}.json"
        if path.exists():
            try:
                data = json.loads(path.read_text())
                return list(data["global"]), list(data["semantic"])
            except (OSError, ValueError, KeyError):
                log.warning("recomputing damaged token cache %s", path)
        audio = self._load_audio(sha)
        self.tokenize_calls += 1
        t0 = time.perf_counter()
        g, s = self._tokenize(audio)
        log.info("tokenized reference %s: %d global + %d semantic tokens in %.2f s", sha[:12], len(g), len(s),
                 time.perf_counter() - t0)
        _write_json(path, {"global": [int(x) for x in g], "semantic": [int(x) for x in s]})
        return list(g), list(s)

    # ------------------------------------------------------------------------------ internals

    def _record(self, name: str) -> dict | None:
        if not _NAME.fullmatch(name):
            return None
        path = self.root / "voices" / f"{name}.json"
        if not path.exists():
            return None
        return json.loads(path.read_text())

    @staticmethod
    def _info(rec: dict) -> VoiceInfo:
        text = rec["transcript"]
        short = text if len(text) <= 40 else text[:37] + "..."
        return VoiceInfo(rec["name"], "cloned", f"cloned from {rec['duration_s']:.1f} s: \"{short}\"",
                         transcript=text, audio_sha256=rec["audio_sha256"], duration_s=rec["duration_s"],
                         created=rec.get("created"))

    def _store_audio(self, sha: str, audio: np.ndarray) -> None:
        path = self.root / "audio" / f"{sha}.wav"
        if path.exists():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        with wave.open(str(tmp), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(SAMPLE_RATE)
            w.writeframes(_pcm16(audio).tobytes())
        os.replace(tmp, path)

    def _load_audio(self, sha: str) -> np.ndarray:
        path = self.root / "audio" / f"{sha}.wav"
        if not path.exists():
            raise EngineError(f"the reference recording {sha[:12]} is missing from {path.parent}; add the voice again")
        with wave.open(str(path), "rb") as w:
            pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
        return pcm.astype(np.float32) / 32768.0


def info_dict(v: VoiceInfo) -> dict:
    return {k: val for k, val in asdict(v).items() if val is not None}
