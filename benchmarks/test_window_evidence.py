"""The window-evidence bench: where it decodes a turn set's callers, and its arguments."""

import json
import wave

import numpy as np
import pytest

from benchmarks import window_evidence as we


def _set(tmp_path, rate=16000):
    with wave.open(str(tmp_path / "turn-001.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.zeros(5 * rate, np.int16).tobytes())
    callers = [{"name": "turn-001", "audio": "turn-001.wav", "pauses": [[1.5, 2.0], [3.0, 3.4]], "speech_end_s": 4.2}]
    (tmp_path / "manifest.jsonl").write_text("\n".join(map(json.dumps, callers)) + "\n")
    return tmp_path


def test_each_pause_is_a_hold_and_the_real_end_an_end_heard_100_ms_into_the_silence(tmp_path):
    pts = we.points(_set(tmp_path))
    assert [(name, kind, len(audio)) for name, kind, audio in pts] == [
        ("turn-001", "hold", 1600 * 16), ("turn-001", "hold", 3100 * 16), ("turn-001", "end", 4300 * 16)]


def test_a_set_at_another_rate_and_bad_windows_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit, match="8000 Hz"):
        we.points(_set(tmp_path, rate=8000))
    with pytest.raises(SystemExit):
        we.main(["--model", "tiny.en-pypi", "--set", str(tmp_path), "--windows", "40"])
    assert "seconds from 1 to 30" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        we.main(["--model", "tiny.en-pypi", "--set", str(tmp_path / "none")])
    assert "no manifest.jsonl" in capsys.readouterr().err
