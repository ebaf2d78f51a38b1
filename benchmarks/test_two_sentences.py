"""The two-sentence bench: its callers' audio keeps the gap it names, and how it counts the callers split."""

import shutil

import numpy as np
import pytest

from benchmarks import two_sentences as ts
from voiced.bench.turn_set import LOUD, RATE, silent_runs


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
@pytest.mark.parametrize("line_seed", [None, 1])
def test_a_caller_is_two_sentences_the_named_gap_apart_then_a_silence_past_the_detectors_bound(line_seed):
    first, gap_s, second = ts.CALLERS[2]
    audio = np.frombuffer(ts.caller_audio(first, gap_s, second, None), "<i2").astype(np.float32) / 32768
    loud = np.nonzero(np.abs(audio) > LOUD)[0]
    assert abs(loud[0] / RATE - 0.5) < 0.03 and abs((len(audio) - loud[-1]) / RATE - 4.5) < 0.03
    # the longest silence inside the speech is the gap between the sentences
    gaps = [(b - a) / RATE for a, b in silent_runs(audio[loud[0]:loud[-1]], 0.3)]
    assert len(gaps) == 1 and abs(gaps[0] - gap_s) < 0.03, gaps
    if line_seed is not None:  # the phone line keeps the length (the real end of speech stays where it was)
        assert len(ts.caller_audio(first, gap_s, second, line_seed)) == 2 * len(audio)


def test_callers_with_two_turns_or_more_count_as_split_per_line():
    rows = [{"line": "clean", "turns": 2}, {"line": "clean", "turns": 1}, {"line": "phone", "turns": 3},
            {"line": "phone", "turns": 1}, {"line": "phone", "turns": 1}]
    assert ts.split_counts(rows) == {"clean": "1/2", "phone": "1/3", "all": "2/5"}
