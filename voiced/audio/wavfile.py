"""WAV files in, 16 kHz mono float32 out: what Whisper and the engines eat.

Reading is voiced_client.wavio's (one WAV parser for the daemon and the clients).
"""

from __future__ import annotations

import os

import numpy as np
from voiced_client.wavio import WavError, resample
from voiced_client.wavio import read_wav as _read_wav

TARGET_RATE = 16000

__all__ = ["WavError", "read_wav", "to_16k", "load_16k"]


def read_wav(path) -> tuple[np.ndarray, int]:
    """(samples as float32 mono in [-1, 1], sample rate); `path` may also be an open binary file."""
    return _read_wav(path, np.float32)


def to_16k(samples: np.ndarray, rate: int) -> np.ndarray:
    """Resample float32 mono audio to 16 kHz (a pass-through at 16 kHz)."""
    samples = np.asarray(samples, dtype=np.float32)
    if rate == TARGET_RATE:
        return samples
    return resample(samples, rate, TARGET_RATE).astype(np.float32, copy=False)


def load_16k(path: str | os.PathLike) -> np.ndarray:
    """A WAV file as 16 kHz mono float32."""
    return to_16k(*read_wav(path))
