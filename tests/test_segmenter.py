import numpy as np
import pytest

from tests.speech import RATE, layout
from voiced.audio.ingest import FRAME_SAMPLES, float_to_int16
from voiced.core.segmenter import Segmenter, SegmenterConfig, SpeechEnded, SpeechStarted, Utterance

PHRASES = ["The quick brown fox jumps over the lazy dog.", "Please call me back tomorrow morning.",
           "Seven apples and three oranges."]


def run(seg: Segmenter, audio: np.ndarray) -> list:
    pcm = float_to_int16(audio)
    pcm = np.pad(pcm, (0, -len(pcm) % FRAME_SAMPLES))
    events = []
    for frame in pcm.reshape(-1, FRAME_SAMPLES):
        events += seg.push(frame)
    return events + seg.flush()


def ms(samples):
    return samples * 1000 / RATE


@pytest.mark.parametrize("aggressiveness", [1, 2, 3])
def test_one_start_end_pair_per_phrase_at_the_right_place(aggressiveness):
    lay = layout(PHRASES, gap_s=1.0)
    cfg = SegmenterConfig(vad_aggressiveness=aggressiveness, hangover_ms=500)
    events = run(Segmenter(cfg), lay.audio)
    starts = [e for e in events if isinstance(e, SpeechStarted)]
    ends = [e for e in events if isinstance(e, SpeechEnded)]
    utts = [e for e in events if isinstance(e, Utterance)]
    assert len(starts) == len(ends) == len(utts) == len(PHRASES)
    for (a, b), s, e, u in zip(lay.spans, starts, ends, utts):
        assert abs(ms(s.offset) - ms(a)) <= 100
        assert abs(ms(e.offset) - (ms(b) + cfg.hangover_ms)) <= 100
        # Pre-roll before and the hangover after are in the utterance: no clipped words.
        assert len(u.audio) >= (b - a) + (cfg.pre_roll_ms + cfg.hangover_ms - 60) * RATE // 1000


def test_a_click_shorter_than_min_speech_starts_nothing():
    audio = np.zeros(RATE * 2, np.float32)
    t = np.arange(int(0.04 * RATE)) / RATE
    audio[RATE : RATE + len(t)] = 0.5 * np.sin(2 * np.pi * 300 * t)  # a 40 ms blip
    events = run(Segmenter(SegmenterConfig(min_speech_ms=200)), audio)
    assert events == []


def test_long_speech_is_split_at_max_utterance():
    lay = layout([PHRASES[0]] * 4, gap_s=0.1)  # ~10 s of nearly continuous speech
    events = run(Segmenter(SegmenterConfig(max_utterance_ms=3000, hangover_ms=400)), lay.audio)
    utts = [e for e in events if isinstance(e, Utterance)]
    assert len(utts) >= 3
    assert all(len(u.audio) <= 3000 * RATE // 1000 for u in utts)
    kinds = [type(e).__name__ for e in events if not isinstance(e, Utterance)]
    assert kinds == ["SpeechStarted", "SpeechEnded"] * (len(kinds) // 2)  # always paired


def test_push_to_talk_yields_exactly_the_marked_spans():
    lay = layout(PHRASES[:2])
    seg = Segmenter(SegmenterConfig(mode="push_to_talk"))
    pcm = float_to_int16(lay.audio)
    marks = [(10, 60), (80, 130)]  # in frames
    events = []
    for i, frame in enumerate(pcm[: len(pcm) // FRAME_SAMPLES * FRAME_SAMPLES].reshape(-1, FRAME_SAMPLES)):
        for a, b in marks:
            if i == a:
                events += seg.talk_start()
            if i == b:
                events += seg.talk_end()
        events += seg.push(frame)
    utts = [e for e in events if isinstance(e, Utterance)]
    assert [(u.start, u.end) for u in utts] == [(a * FRAME_SAMPLES, b * FRAME_SAMPLES) for a, b in marks]
    for u, (a, b) in zip(utts, marks):
        assert np.array_equal(u.audio, pcm[a * FRAME_SAMPLES : b * FRAME_SAMPLES])


@pytest.mark.parametrize("bad", [dict(vad_aggressiveness=4), dict(hangover_ms=0), dict(max_utterance_ms=40000),
                                 dict(mode="always")])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        Segmenter(SegmenterConfig(**bad))


def test_speech_in_background_noise_still_starts_and_ends():
    lay = layout(PHRASES, gap_s=1.2, noise=0.01)  # about -40 dBFS of white noise throughout
    events = run(Segmenter(SegmenterConfig(vad_aggressiveness=3)), lay.audio)
    starts = [e for e in events if isinstance(e, SpeechStarted)]
    ends = [e for e in events if isinstance(e, SpeechEnded)]
    assert len(starts) == len(ends) == len(PHRASES)
    for (a, b), s, e in zip(lay.spans, starts, ends):
        assert abs(ms(s.offset) - ms(a)) <= 150
        assert ms(b) < ms(e.offset) <= ms(b) + 500 + 300


def test_the_voice_gate_gives_the_previous_forms_answer_frame_by_frame():
    """`_voice` (the swing from argmax/argmin, the DTMF check handed its peak) against the previous form:
    the swing from numpy's reductions, then the tone check on the frame alone."""
    from tests.test_dtmf import frames, judged_clips
    from voiced.audio import dtmf
    from voiced.core.segmenter import SILENCE_SWING, _voice

    seen = set()
    for x in judged_clips():
        for f in frames(x) + frames(x * 0.004):  # and quiet enough for the swing to say no
            want = (int(np.maximum.reduce(f)) - int(np.minimum.reduce(f)) > SILENCE_SWING) and not dtmf.is_tone(f)
            assert _voice(f) == want
            seen.add(want)
    assert seen == {True, False}
