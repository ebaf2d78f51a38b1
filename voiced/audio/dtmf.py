"""In-band DTMF: telling keypad tones apart from speech, one 20 ms frame at a time.

A phone caller's key presses often arrive as sound in the audio itself. webrtcvad calls them speech,
and Whisper, handed 100 ms bursts of two sine waves, writes "you" (sometimes sure enough of it to
pass the no-speech and log-probability rules). A DTMF tone is one frequency from each of two groups
(ITU-T Q.23): 697/770/852/941 Hz and 1209/1336/1477/1633 Hz. So a frame is a tone when nearly all of
its energy sits at the strongest frequency of each group, at comparable levels (twist) - something
speech, whose energy spreads over many harmonics and formants, does not do for 20 ms.

The energy at each of the eight frequencies is the squared magnitude of the frame's Fourier sum at
that exact frequency (Goertzel's quantity), computed as one small matrix product.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

LOW = (697.0, 770.0, 852.0, 941.0)
HIGH = (1209.0, 1336.0, 1477.0, 1633.0)
KEYS = ("123A", "456B", "789C", "*0#D")  # KEYS[low][high]
# Share of the frame's energy the two tones must carry, and their largest level difference
# (Q.24 allows up to 8 dB of twist between the groups).
TONE_SHARE = 0.8
MAX_TWIST_DB = 8.0
EDGE = 0.1  # samples under a tenth of the frame's peak before the first / after the last louder one are cut
MIN_SPAN_MS = 5


@lru_cache(maxsize=4)
def _basis(n: int, rate: int) -> np.ndarray:
    t = np.arange(n) / rate
    f = np.array(LOW + HIGH)[:, None]
    return np.exp(-2j * np.pi * f * t)  # [8, n]


def key(frame: np.ndarray, rate: int = 16000) -> str | None:
    """The key whose tone fills `frame` (int16 or float samples), or None for anything else."""
    x = np.asarray(frame, dtype=np.float64)
    # A tone that starts or stops inside the frame: judge the part that sounds (a frame that is half
    # silence would otherwise put only half its length into the tone's share).
    loud = np.flatnonzero(np.abs(x) > EDGE * np.abs(x).max(initial=0.0))
    if len(loud) and (loud[0] > 0 or loud[-1] < len(x) - 1):
        if loud[-1] + 1 - loud[0] < MIN_SPAN_MS * rate // 1000:
            return None
        x = x[loud[0]: loud[-1] + 1]
    energy = float(x @ x)
    if energy <= 0.0:
        return None
    # A tone of amplitude a over n samples puts |X(f)|^2 = (a n / 2)^2 at its frequency and has
    # energy a^2 n / 2: its share of the frame's energy is 2 |X(f)|^2 / (n * energy).
    power = 2.0 * np.abs(_basis(len(x), rate) @ x) ** 2 / len(x)
    lo, hi = int(np.argmax(power[:4])), int(np.argmax(power[4:]))
    p_lo, p_hi = power[lo], power[4 + hi]
    if (p_lo + p_hi) < TONE_SHARE * energy or min(p_lo, p_hi) <= 0.0:
        return None
    if abs(10.0 * np.log10(p_lo / p_hi)) > MAX_TWIST_DB:
        return None
    return KEYS[lo][hi]


def is_tone(frame: np.ndarray, rate: int = 16000) -> bool:
    return key(frame, rate) is not None
