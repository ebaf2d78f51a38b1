"""In-band keypad tones: recognised frame by frame, never confused with speech, and kept out of
the segmenter's speech (so Whisper is never handed a key press to call "you")."""

from __future__ import annotations

import numpy as np
import pytest

from tests.daemon_harness import heard_audio, wire_audio
from tests.speech import phrase
from voiced.audio import dtmf
from voiced.audio.ingest import FRAME_SAMPLES, RATE, Format
from voiced.core.segmenter import Segmenter, SegmenterConfig, SpeechStarted, Utterance

PHONE = Format("MULAW", 8000)


def tone(k: str, seconds: float, level: float = 0.2, phase: float = 0.0) -> np.ndarray:
    row = next(i for i, r in enumerate(dtmf.KEYS) if k in r)
    f1, f2 = dtmf.LOW[row], dtmf.HIGH[dtmf.KEYS[row].index(k)]
    t = np.arange(int(seconds * RATE)) / RATE + phase
    return (level * (np.sin(2 * np.pi * f1 * t) + 0.7 * np.sin(2 * np.pi * f2 * t))).astype(np.float32)


def frames(x: np.ndarray):
    x = np.round(np.clip(x, -1, 1) * 32767).astype(np.int16) if x.dtype != np.int16 else x
    return [x[i:i + FRAME_SAMPLES] for i in range(0, len(x) - FRAME_SAMPLES + 1, FRAME_SAMPLES)]


@pytest.mark.parametrize("phone", [False, True], ids=["16k", "mulaw-8k"])
def test_every_key_is_recognised_at_any_level_and_phase(phone):
    for k in "".join(dtmf.KEYS):
        for level, phase in ((0.05, 0.0), (0.3, 0.0013)):
            x = tone(k, 0.1, level, phase)
            if phone:
                x = heard_audio(wire_audio(x, PHONE), PHONE)
            keys = [dtmf.key(f) for f in frames(x)[1:-1]]  # whole frames (the line's resampler rings at the ends)
            assert keys and all(got == k for got in keys), (k, keys)


def test_a_tone_that_starts_or_stops_inside_a_frame_is_still_a_tone():
    x = np.concatenate([np.zeros(200, np.float32), tone("5", 0.1), np.zeros(500, np.float32)])
    fs = frames(x)
    assert dtmf.key(fs[0]) == "5" and all(dtmf.key(f) == "5" for f in fs[1:5])


def test_speech_dial_tones_and_silence_are_not_keys():
    for text, voice in [("Please call me back tomorrow morning.", "en"), ("Seven apples and three oranges.", "en"),
                        ("Guten Tag, wie geht es Ihnen?", "de"), ("Bonjour, je voudrais une table.", "fr")]:
        a = phrase(text, voice)
        for x in (a, heard_audio(wire_audio(a, PHONE), PHONE)):
            assert not any(dtmf.is_tone(f) for f in frames(x)), text
    t = np.arange(RATE) / RATE
    dial = (0.2 * (np.sin(2 * np.pi * 350 * t) + np.sin(2 * np.pi * 440 * t))).astype(np.float32)  # US dial tone
    busy = (0.2 * (np.sin(2 * np.pi * 480 * t) + np.sin(2 * np.pi * 620 * t))).astype(np.float32)
    for x in (dial, busy, np.zeros(RATE, np.float32)):
        assert not any(dtmf.is_tone(f) for f in frames(x))


def test_key_presses_between_phrases_do_not_become_speech():
    gap = np.zeros(RATE, np.float32)
    keys = np.concatenate([np.concatenate([tone(k, 0.09, phase=i * 1e-3), np.zeros(1400, np.float32)])
                           for i, k in enumerate("4711#")])
    a = np.concatenate([gap, phrase("Please call me back tomorrow morning."), gap, keys, gap,
                        phrase("Seven apples and three oranges."), gap])
    seg = Segmenter(SegmenterConfig())
    events = [e for f in frames(a) for e in seg.push(f)] + seg.flush()
    assert sum(isinstance(e, SpeechStarted) for e in events) == 2
    assert sum(isinstance(e, Utterance) for e in events) == 2


def reference_key(frame: np.ndarray, rate: int = RATE) -> str | None:
    """The rule as first written (a complex basis per trimmed length, the twist in dB): `dtmf.key` is
    its cheaper form, and must give the same key for every frame."""
    x = np.asarray(frame, dtype=np.float64)
    loud = np.flatnonzero(np.abs(x) > dtmf.EDGE * np.abs(x).max(initial=0.0))
    if len(loud) and (loud[0] > 0 or loud[-1] < len(x) - 1):
        if loud[-1] + 1 - loud[0] < dtmf.MIN_SPAN_MS * rate // 1000:
            return None
        x = x[loud[0]: loud[-1] + 1]
    energy = float(x @ x)
    if energy <= 0.0:
        return None
    t = np.arange(len(x)) / rate
    basis = np.exp(-2j * np.pi * np.array(dtmf.LOW + dtmf.HIGH)[:, None] * t)
    power = 2.0 * np.abs(basis @ x) ** 2 / len(x)
    lo, hi = int(np.argmax(power[:4])), int(np.argmax(power[4:]))
    p_lo, p_hi = power[lo], power[4 + hi]
    if (p_lo + p_hi) < dtmf.TONE_SHARE * energy or min(p_lo, p_hi) <= 0.0:
        return None
    if abs(10.0 * np.log10(p_lo / p_hi)) > dtmf.MAX_TWIST_DB:
        return None
    return dtmf.KEYS[lo][hi]


def previous_key(frame: np.ndarray, rate: int = RATE) -> str | None:
    """The rule's numpy form before the event loop's per-frame work was cut (issue 26, session 10): edges
    found by argmax on the whole frame, the eight powers and their maxima as numpy arrays. `dtmf.key`
    must give the same key for every frame, with or without the peak handed in."""
    x = np.asarray(frame, dtype=np.float64)
    n = len(x)
    if not n:
        return None
    a = np.abs(x)
    loud = a > dtmf.EDGE * a.max()
    first = int(loud.argmax())
    if not loud[first]:
        return None
    last = n - 1 - int(loud[::-1].argmax())
    basis = dtmf._basis(n, rate)
    if first > 0 or last < n - 1:
        if last + 1 - first < dtmf.MIN_SPAN_MS * rate // 1000:
            return None
        x, basis = x[first: last + 1], basis[:, first: last + 1]
    energy = float(x @ x)
    y = basis @ x
    power = (2.0 / len(x)) * (y[:8] ** 2 + y[8:] ** 2)
    lo, hi = int(power[:4].argmax()), int(power[4:].argmax())
    p_lo, p_hi = float(power[lo]), float(power[4 + hi])
    if (p_lo + p_hi) < dtmf.TONE_SHARE * energy or min(p_lo, p_hi) <= 0.0:
        return None
    if max(p_lo, p_hi) > dtmf.TWIST * min(p_lo, p_hi):
        return None
    return dtmf.KEYS[lo][hi]


def judged_clips() -> list[np.ndarray]:
    """Speech (16 kHz and through a phone line), noise, and every key's tone with edges anywhere in a
    frame, under speech and noise near the share's bound, and with twists either side of the bound."""
    rng = np.random.default_rng(0)
    speech = np.concatenate([phrase("Please call me back tomorrow morning."), phrase("Seven apples and three oranges.")])
    clips = [speech, heard_audio(wire_audio(speech, PHONE), PHONE), 0.1 * rng.standard_normal(RATE).astype(np.float32)]
    for i, k in enumerate("0123456789*#ABCD"):
        lead = np.zeros(int(rng.integers(0, 2 * FRAME_SAMPLES)), np.float32)
        t = tone(k, 0.07 + 0.01 * i, level=0.05 + 0.02 * i, phase=i * 1e-3)
        clips.append(np.concatenate([lead, t, lead]))
        under = speech[: len(t)] * (0.2 + 0.05 * i) + 0.02 * i * rng.standard_normal(len(t)).astype(np.float32)
        clips.append(t + under)
        row = next(r for r, keys in enumerate(dtmf.KEYS) if k in keys)
        f1, f2 = dtmf.LOW[row], dtmf.HIGH[dtmf.KEYS[row].index(k)]
        s = np.arange(FRAME_SAMPLES * 4) / RATE
        for db in (7.9, 8.1):
            clips.append((0.2 * np.sin(2 * np.pi * f1 * s) + 0.2 * 10 ** (-db / 20) * np.sin(2 * np.pi * f2 * s))
                         .astype(np.float32))
    return clips


def test_key_gives_the_reference_rules_answer_frame_by_frame():
    seen = set()
    for x in judged_clips():
        for f in frames(x):
            want = reference_key(f)
            assert dtmf.key(f) == want
            seen.add(want)
    assert None in seen and len(seen) > 10  # tones and not-tones both met


def test_key_gives_the_previous_forms_answer_frame_by_frame():
    """Also on float frames, frames of one loud sample, and silence; and with the peak the segmenter
    hands in (from its int16 extremes)."""
    rng = np.random.default_rng(1)
    odd = [np.zeros(FRAME_SAMPLES, np.int16), np.eye(1, FRAME_SAMPLES, 7, dtype=np.int16)[0] * 30000,
           np.full(FRAME_SAMPLES, -32768, np.int16), (rng.standard_normal(FRAME_SAMPLES) * 8000).astype(np.int16)]
    seen = set()
    for x in judged_clips():
        for f in frames(x):
            want = previous_key(f)
            assert dtmf.key(f) == want
            peak = float(max(int(f.max()), -int(f.min())))
            assert dtmf.key(f, RATE, peak) == want
            assert dtmf.key(f.astype(np.float32) / 32768.0) == previous_key(f.astype(np.float32) / 32768.0)
            seen.add(want)
    for f in odd:
        assert dtmf.key(f) == previous_key(f)
        assert dtmf.key(f, RATE, float(max(int(f.max()), -int(f.min())))) == previous_key(f)
    assert None in seen and len(seen) > 10
