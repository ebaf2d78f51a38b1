"""Real speech for tests: espeak-ng phrases laid out with known pauses.

Machines without espeak-ng (the GPU box) read the same WAVs from a speech directory rendered
beforehand on a machine that has it (`python -m tests.speech DIR TEXT...`, which `make gpu-data`
runs for the GPU suite's phrases): `VOICED_SPEECH_DIR`, default `.devdata/speech` in the repository.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import wave
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

RATE = 16000
REPO = Path(__file__).resolve().parent.parent


def speech_dir() -> Path:
    return Path(os.environ.get("VOICED_SPEECH_DIR") or REPO / ".devdata" / "speech")


def _key(text: str, voice: str, speed: int | None) -> str:
    return hashlib.sha1(f"{voice}|{speed}|{text}".encode()).hexdigest()[:20]


def need_espeak() -> None:
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng), and the phrase is not in "
                    f"{speech_dir()} (render it where espeak-ng is: `make gpu-data`)")


def _run_espeak(text: str, dest: Path, voice: str, speed: int | None) -> Path:
    cmd = ["espeak-ng", "-v", voice] + (["-s", str(speed)] if speed is not None else []) + ["-w", str(dest), text]
    subprocess.run(cmd, check=True, capture_output=True)
    return dest


def espeak_wav(text: str, dest: Path, voice: str = "en", speed: int | None = None) -> Path:
    """espeak-ng's WAV of `text` at `dest`: copied from the speech directory when it was rendered
    there, else made now (skips the test where espeak-ng is missing)."""
    rendered = speech_dir() / f"{_key(text, voice, speed)}.wav"
    if rendered.exists():
        shutil.copyfile(rendered, dest)
        return dest
    need_espeak()
    return _run_espeak(text, dest, voice, speed)


def render(directory: Path, phrases: list[tuple[str, str, int | None]]) -> list[Path]:
    """Render (text, voice, speed) phrases with espeak-ng into `directory`, for machines without it."""
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is not installed (apt-get install espeak-ng)")
    directory.mkdir(parents=True, exist_ok=True)
    return [_run_espeak(t, directory / f"{_key(t, v, s)}.wav", v, s) for t, v, s in phrases]


@lru_cache(maxsize=64)
def _speak(text: str, voice: str) -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        path = espeak_wav(text, Path(tmp) / "x.wav", voice)
        with wave.open(str(path)) as w:
            rate = w.getframerate()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    import soxr

    return soxr.resample(pcm.astype(np.float32) / 32768.0, rate, RATE).astype(np.float32).tobytes()


def phrase(text: str, voice: str = "en") -> np.ndarray:
    """The phrase at 16 kHz float32, with espeak's leading and trailing silence trimmed."""
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


if __name__ == "__main__":  # python -m tests.speech DIR [TEXT...]: the GPU suite's phrases by default
    from tests.gpu_phrases import PHRASES

    texts = [(t, "en", None) for t in sys.argv[2:]] or PHRASES
    print(f"{len(render(Path(sys.argv[1]), texts))} phrases in {sys.argv[1]}")
