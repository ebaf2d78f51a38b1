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
