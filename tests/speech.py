"""Real speech for tests: espeak-ng phrases laid out with known pauses."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import wave
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

RATE = 16000


def need_espeak() -> None:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")


@lru_cache(maxsize=64)
def _speak(text: str, voice: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-w", str(path), text], check=True, capture_output=True)
        with wave.open(str(path)) as w:
            rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    import soxr

    return soxr.resample(pcm.astype(np.float32) / 32768.0, rate, RATE).astype(np.float32).tobytes()


def phrase(text: str, voice: str = "en") -> np.ndarray:
    """The phrase at 16 kHz float32, with espeak's leading and trailing silence trimmed."""
    need_espeak()
    audio = np.frombuffer(_speak(text, voice), dtype=np.float32)
    loud = np.nonzero(np.abs(audio) > 0.01)[0]
    return audio[loud[0] : loud[-1] + 1].copy()


@dataclass
class Layout:
    audio: np.ndarray  # float32 at 16 kHz
    spans: list[tuple[int, int]]  # (start, end) sample of each phrase
    texts: list[str]


def layout(texts: list[str], lead_s: float = 0.6, gap_s: float = 1.2, tail_s: float = 1.2,
           noise: float = 0.0, seed: int = 0) -> Layout:
    parts = [np.zeros(int(lead_s * RATE), np.float32)]
    spans = []
    pos = len(parts[0])
    for i, text in enumerate(texts):
        p = phrase(text)
        spans.append((pos, pos + len(p)))
        parts.append(p)
        pos += len(p)
        gap = np.zeros(int((tail_s if i == len(texts) - 1 else gap_s) * RATE), np.float32)
        parts.append(gap)
        pos += len(gap)
    audio = np.concatenate(parts)
    if noise:
        audio = audio + np.random.default_rng(seed).normal(0, noise, len(audio)).astype(np.float32)
    return Layout(audio, spans, texts)


def write_wav(path: Path, audio: np.ndarray, rate: int = RATE) -> Path:
    """float32 in [-1, 1] or int16 samples, as 16-bit PCM."""
    from voiced_client.wavio import write_wav as write

    write(path, audio, rate)
    return path
