"""The Smart Turn separation bench: its AUC, how it reads the sources, and where it puts ends and holds."""

import io
import shutil
import tarfile
import wave
import zipfile

import numpy as np
import pytest

from benchmarks import smart_turn_separation as sts


def _wav(samples: np.ndarray) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(samples.astype(np.int16).tobytes())
    return buf.getvalue()


def test_auc_counts_ends_above_holds_and_ties_half():
    assert sts.auc([0.9, 0.8], [0.1, 0.2]) == 1.0
    assert sts.auc([0.1], [0.9]) == 0.0
    assert sts.auc([0.5, 0.9], [0.5, 0.1]) == pytest.approx((0.5 + 1 + 1 + 1) / 4)
    assert sts.auc([], [0.3]) is None
    low, high = sts.auc_interval([0.9, 0.7, 0.4], [0.5, 0.2, 0.1])
    assert low <= sts.auc([0.9, 0.7, 0.4], [0.5, 0.2, 0.1]) <= high


def test_rates_at_the_models_threshold():
    pts = [sts.Point("s", "a", "end", np.inf, np.zeros(1), p=0.9), sts.Point("s", "b", "end", np.inf, np.zeros(1), p=0.2),
           sts.Point("s", "c", "hold", 0.3, np.zeros(1), p=0.7), sts.Point("s", "d", "hold", 0.3, np.zeros(1), p=0.1)]
    r = sts.row("s", pts)
    assert (r["ends"], r["holds"], r["holds_called_complete"], r["ends_not_complete"]) == (2, 2, 1, 1)
    assert r["auc"] == 0.75
    assert "| s | 2 | 2 | 0.75" in sts.table([r])


def test_a_speakers_utterances_in_a_row_are_one_turn():
    stm = ("x 1 A 1.0 2.0 Hello?\nx 1 B 2.5 3.0 Hi.\nx 1 B 3.2 4.0 Who is it?\n;; comment\n"
           "x 1 A 4.1 5.0 Me.\n")
    turns = sts.speaker_turns(sts.read_stm(stm))
    assert turns == [("A", 1.0, 2.0, 0.0), ("B", 2.5, 4.0, 2.0), ("A", 4.1, 5.0, 4.0)]


def test_members_come_out_of_wheels_and_source_archives(tmp_path):
    data = _wav(np.zeros(320))
    with zipfile.ZipFile(tmp_path / "p.whl", "w") as z:
        z.writestr("pyannote/audio/sample/sample.wav", data)
        z.writestr("pyannote/audio/other.py", "")
    with tarfile.open(tmp_path / "a.tar.gz", "w:gz") as t:
        info = tarfile.TarInfo("pkg-1.0/data/arctic_a0001.wav")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    assert list(sts.archive_members(tmp_path / "p.whl", lambda n: n.endswith(".wav"))) == ["sample.wav"]
    got = sts.archive_members(tmp_path / "a.tar.gz", lambda n: "arctic_" in n)
    assert len(sts.wav_16k(got["arctic_a0001.wav"])) == 320
    with pytest.raises(SystemExit, match="pyannote.audio 4.x"):
        sts.pyannote_points(tmp_path / "p.whl", 0.1)


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="needs espeak-ng")
def test_a_pause_inside_the_turn_is_a_hold_and_the_last_stop_the_end():
    from voiced.bench.turn_set import _render, trim

    first, second = trim(_render(["I would like to book a table for"])), trim(_render(["four people on Monday."]))
    gap = np.zeros(8000, np.float32)  # 0.5 s
    speech = np.concatenate([np.zeros(4000, np.float32), first, gap, second])
    pts = sts.points_of_turn("t", "caller", (speech * 32767).astype(np.int16), 0.1)
    holds = [p for p in pts if p.kind == "hold"]
    assert pts[-1].kind == "end" and len(pts[-1].clip) > len(first) + len(second)
    assert any(0.4 <= p.gap_s <= 0.6 and abs(len(p.clip) - 4000 - len(first) - 3200) < 4800 for p in holds)
    # the clip is the turn up to the voice's end, then MODEL_SILENCE_MS of digital silence
    assert not pts[-1].clip[-3200:].any()
