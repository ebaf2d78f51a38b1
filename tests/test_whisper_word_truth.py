"""Word times against the truth, next to openai-whisper's on the same weights in the same run.

The truth: tests/word_truth.py (espeak-ng words laid end to end with 60-200 ms pauses, so each
word's start and end are known). The weights: the real tiny.en (test_whisper_words_real.py). The
comparison: openai-whisper's `transcribe(word_timestamps=True)`, what `whisper --word_timestamps
True` prints. Scored over the words each reads right, at every word's start and end; the figures
are docs/BENCHMARKS.md's (`python -m tests.word_truth` prints them).
"""

from __future__ import annotations

import pytest

from tests import word_truth as wt
from tests.real_whisper import tiny_en_dir

whisper = pytest.importorskip("whisper")


@pytest.fixture(scope="module")
def utterances():
    return wt.truth_set(len(wt.SENTENCES), seed=0)


def test_word_times_against_the_truth(utterances):
    from voiced.engines.whisper.engine import WhisperEngine

    engine = WhisperEngine.load(tiny_en_dir())
    ours = wt.score(utterances, [wt.voiced_words(engine, u.audio) for u in utterances])
    ref = wt.openai_model(engine)
    theirs = wt.score(utterances, [wt.openai_words(ref, u.audio) for u in utterances])
    print("\n" + ours.row("voiced") + "\n" + theirs.row("openai-whisper transcribe()"))
    n_words = sum(len(u.words) for u in utterances)
    assert len(ours.errors) // 2 >= n_words // 2  # most words are read right, so the figures mean something
    assert abs(ours.mean_signed_ms) <= 30
    assert ours.median_abs_ms <= theirs.median_abs_ms + 10


def test_the_truth_is_what_was_spoken():
    # The true spans hold the sound: loud inside each word, silent in the pauses between them.
    import numpy as np

    utt = wt.utterance("Seven green bottles", np.random.default_rng(3))
    assert [w.word for w in utt.words] == ["Seven", "green", "bottles"]
    rate = wt.RATE
    for a, b in zip(utt.words, utt.words[1:]):
        gap = b.start - a.end
        assert wt.GAP_S[0] - 0.001 <= gap <= wt.GAP_S[1] + 0.001
        assert np.abs(utt.audio[int(a.end * rate) + 1: int(b.start * rate) - 1]).max() == 0.0
    for w in utt.words:
        inside = np.abs(utt.audio[int(w.start * rate): int(w.end * rate)])
        assert inside[:160].max() > wt.LOUD and inside[-160:].max() > wt.LOUD
    assert utt.words[0].start == pytest.approx(wt.LEAD_S) and len(utt.audio) / rate == pytest.approx(utt.words[-1].end + wt.LEAD_S, abs=1e-3)
