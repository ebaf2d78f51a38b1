"""In-band DTMF: telling keypad tones apart from speech, one 20 ms frame at a time.

A phone caller's key presses often arrive as sound in the audio itself. webrtcvad calls them speech,
and Whisper, handed 100 ms bursts of two sine waves, writes "you" (sometimes sure enough of it to
pass the no-speech and log-probability rules). A DTMF tone is one frequency from each of two groups
(ITU-T Q.23): 697/770/852/941 Hz and 1209/1336/1477/1633 Hz. So a frame is a tone when nearly all of
its energy sits at the strongest frequency of each group, at comparable levels (twist) - something
speech, whose energy spreads over many harmonics and formants, does not do for 20 ms.

The energy at each of the eight frequencies is the squared magnitude of the frame's Fourier sum at
that exact frequency (Goertzel's quantity), computed as one small real matrix product.
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
TWIST = 10.0 ** (MAX_TWIST_DB / 10.0)  # the same bound as a power ratio


@lru_cache(maxsize=4)
def _basis(n: int, rate: int) -> np.ndarray:
    """cos and sin of each frequency over an n-sample frame: [16, n], X(f) = cos @ x - i sin @ x."""
    w = 2 * np.pi * np.array(LOW + HIGH)[:, None] * (np.arange(n) / rate)
    return np.concatenate([np.cos(w), np.sin(w)])


def key(frame: np.ndarray, rate: int = 16000, peak: float | None = None) -> str | None:
    """The key whose tone fills `frame` (int16 or float samples), or None for anything else. `peak`:
    the frame's largest |sample|, where the caller has it already (the segmenter does).

    The segmenter asks this of every voiced frame of speech, 50 times a second per caller, on the event
    loop, where a numpy call costs about half a microsecond whatever its size. So: one basis per frame
    length (a trimmed frame uses a slice of it, since where the time origin sits only turns X(f) by a
    unit phase and |X(f)| is what is judged); no search for the edges when both ends of the frame are
    loud; and the eight powers worked out as Python floats, with the same IEEE operations in the same
    order as numpy's elementwise form (tests/test_dtmf.py keeps that form and compares them frame by
    frame)."""
    x = np.asarray(frame, dtype=np.float64)
    n = len(x)
    if not n:
        return None
    if peak is None:
        peak = float(np.maximum.reduce(np.abs(x)))
    edge = EDGE * peak
    if not edge > 0.0:
        return None  # silence
    basis = _basis(n, rate)
    # A tone that starts or stops inside the frame: judge the part that sounds (a frame that is half
    # silence would otherwise put only half its length into the tone's share).
    if not (abs(x[0]) > edge and abs(x[n - 1]) > edge):
        loud = np.abs(x) > edge
        first, last = int(loud.argmax()), n - 1 - int(loud[::-1].argmax())
        if last + 1 - first < MIN_SPAN_MS * rate // 1000:
            return None
        x, basis = x[first: last + 1], basis[:, first: last + 1]
    energy = float(x @ x)
    # A tone of amplitude a over n samples puts |X(f)|^2 = (a n / 2)^2 at its frequency and has
    # energy a^2 n / 2: its share of the frame's energy is 2 |X(f)|^2 / (n * energy).
    c0, c1, c2, c3, c4, c5, c6, c7, s0, s1, s2, s3, s4, s5, s6, s7 = (basis @ x).tolist()
    k = 2.0 / len(x)
    low = (k * (c0 * c0 + s0 * s0), k * (c1 * c1 + s1 * s1), k * (c2 * c2 + s2 * s2), k * (c3 * c3 + s3 * s3))
    high = (k * (c4 * c4 + s4 * s4), k * (c5 * c5 + s5 * s5), k * (c6 * c6 + s6 * s6), k * (c7 * c7 + s7 * s7))
    p_lo, p_hi = max(low), max(high)
    if (p_lo + p_hi) < TONE_SHARE * energy or min(p_lo, p_hi) <= 0.0:
        return None
    if max(p_lo, p_hi) > TWIST * min(p_lo, p_hi):
        return None
    return KEYS[low.index(p_lo)][high.index(p_hi)]  # (the first of equal maxima, as argmax takes)


def is_tone(frame: np.ndarray, rate: int = 16000, peak: float | None = None) -> bool:
    return key(frame, rate, peak) is not None
