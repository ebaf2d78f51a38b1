"""`voiced eval` and `voiced eval make-set`: the set maker's files, reading sets, the normaliser, and
a run with faster-whisper and openai-whisper beside ours on one (random) CTranslate2 checkpoint."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from tests.ct2_fixtures import write_ct2_dir
from tests.whisper_fixtures import random_state_dict, tiny_dims
from voiced.bench import asr_eval as ev
from voiced.bench import speech_set
from voiced.cli import main as voiced_main

pytestmark = pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")


def test_make_set_writes_audio_references_and_a_manifest_the_same_way_every_time(tmp_path, capsys):
    assert voiced_main(["eval", "make-set", str(tmp_path / "a"), "--n", "3"]) == 0
    assert voiced_main(["eval", "make-set", str(tmp_path / "b"), "--n", "3"]) == 0
    lines = [json.loads(x) for x in (tmp_path / "a" / "manifest.jsonl").read_text().splitlines()]
    assert [x["audio"] for x in lines] == ["utt-0001.wav", "utt-0002.wav", "utt-0003.wav"]
    for x in lines:
        assert (tmp_path / "a" / x["audio"]).read_bytes() == (tmp_path / "b" / x["audio"]).read_bytes()
        assert (tmp_path / "a" / x["audio"]).with_suffix(".txt").read_text().strip() == x["text"]
        assert x["text"] in speech_set.SENTENCES
    assert len({x["text"] for x in lines}) == 3

    from voiced.audio.wavfile import read_wav

    clean, rate = read_wav(tmp_path / "a" / "utt-0001.wav")
    assert rate == 16000 and 0.5 < len(clean) / rate < 10
    speech_set.make_set(tmp_path / "p", 1, noise=True, phone=True, progress=False)
    raw = (tmp_path / "p" / "utt-0001.wav").read_bytes()
    assert raw[20:22] == b"\x07\x00"  # WAVE_FORMAT_MULAW, as a phone system records
    phone, rate = read_wav(tmp_path / "p" / "utt-0001.wav")
    assert rate == 8000 and abs(len(phone) / 8000 - len(clean) / 16000) < 0.01
    # pink noise at 15 dB: the quiet start of the clip is no longer silent
    speech_set.make_set(tmp_path / "n", 1, noise=True, progress=False)
    noisy, _ = read_wav(tmp_path / "n" / "utt-0001.wav")
    assert np.sqrt(np.mean(noisy[:800] ** 2)) > 5 * np.sqrt(np.mean(clean[:800] ** 2)) + 1e-4


def test_sets_from_folders_and_manifests_and_what_is_wrong_with_them(tmp_path):
    speech_set.make_set(tmp_path / "s", 2, progress=False)
    by_manifest = ev.load_set(tmp_path / "s")
    (tmp_path / "s" / "manifest.jsonl").unlink()
    by_folder = ev.load_set(tmp_path / "s")
    assert [(u.name, u.text) for u in by_manifest] == [(u.name, u.text) for u in by_folder]
    assert np.array_equal(by_manifest[1].audio, by_folder[1].audio) and by_folder[0].seconds > 0.5
    (tmp_path / "s" / "utt-0002.txt").unlink()
    with pytest.raises(ev.EvalError, match="utt-0002.wav has no reference text: write it to utt-0002.txt"):
        ev.load_set(tmp_path / "s")
    (tmp_path / "m.jsonl").write_text('{"audio": "s/utt-0001.wav", "text": "hi"}\n{"audio": "s/nope.wav", "text": "x"}\n')
    with pytest.raises(ev.EvalError, match="nope.wav .*does not exist"):
        ev.load_set(tmp_path / "m.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"file": "a.wav"}\n')
    with pytest.raises(ev.EvalError, match=r"bad.jsonl:1: expected a JSON object with \"audio\" and \"text\""):
        ev.load_set(tmp_path / "bad.jsonl")
    with pytest.raises(ev.EvalError, match="voiced eval make-set"):
        ev.load_set(tmp_path / "missing")


def test_normalizers():
    assert ev.simple_normalize("Hello, World!  It's 5 o'clock -- 'quoted'.") == "hello world it's 5 o'clock quoted"
    norm, name = ev.normalizer("en")
    pytest.importorskip("whisper")
    assert name == "openai-whisper EnglishTextNormalizer"
    assert norm("Mr. Smith paid twenty dollars.") == norm("mister smith paid $20")


def test_eval_runs_ours_and_openai_whisper_on_one_checkpoint(tmp_path, capsys):
    pytest.importorskip("whisper")
    pytest.importorskip("jiwer")
    dims = tiny_dims(multilingual=False)
    model = write_ct2_dir(tmp_path / "m", dims, random_state_dict(dims, seed=4, eot_boost=3.0),
                          quantization="float32", vocabulary="vocabulary.txt")
    speech_set.make_set(tmp_path / "s", 3, progress=False)
    out = tmp_path / "r.json"
    assert voiced_main(["eval", str(tmp_path / "s"), "--model", str(model), "--dtype", "float32,int8",
                        "--compare", "openai-whisper", "--repeats", "2", "--out", str(out), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    full = json.loads(out.read_text())
    assert [r["system"] for r in printed["results"]] == ["voiced float32", "voiced int8", "openai-whisper float32"]
    assert printed["normalizer"] == "openai-whisper EnglishTextNormalizer"
    # The figures are jiwer's over the normalised texts, and our texts are `voiced transcribe`'s.
    import jiwer

    norm, _ = ev.normalizer("en")
    refs = [norm(full["references"][k]) for k in sorted(full["references"])]
    for r in printed["results"]:
        hyps = full["hypotheses"][r["system"]]
        assert r["wer"] == pytest.approx(jiwer.wer(refs, [norm(hyps[k]) for k in sorted(hyps)]))
        assert r["latency_p90_ms"] >= r["latency_p50_ms"] > 0 and r["rtf"] > 0 and r["utterances"] == 3
        # each utterance's own latency is kept, for paired comparisons
        lat = full["latencies_ms"][r["system"]]
        assert sorted(lat) == sorted(full["references"]) and all(v > 0 for v in lat.values())
    assert voiced_main(["transcribe", str(tmp_path / "s" / "utt-0002.wav"), "--model", str(model), "--json"]) == 0
    said = json.loads(capsys.readouterr().out)["text"]
    assert full["hypotheses"]["voiced float32"]["utt-0002"] == said
    # Unknown comparisons are refused with what to use.
    assert voiced_main(["eval", str(tmp_path / "s"), "--model", str(model), "--compare", "whisperx"]) == 2
    assert "unknown system 'whisperx'" in capsys.readouterr().err


def test_eval_with_faster_whisper_on_real_tiny_en(tmp_path, capsys):
    pytest.importorskip("faster_whisper")
    pytest.importorskip("whisper")
    from tests.real_whisper import tiny_en_dir

    model = tiny_en_dir()
    speech_set.make_set(tmp_path / "s", 4, progress=False)
    assert voiced_main(["eval", str(tmp_path / "s"), "--model", str(model), "--dtype", "float32,int8",
                        "--json"]) == 0
    rows = {r["system"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    assert list(rows) == ["voiced float32", "voiced int8", "faster-whisper float32", "faster-whisper int8",
                          "openai-whisper float32"]
    # real weights: every system hears most words of espeak-ng's (robotic) speech; random weights get ~100 %
    assert all(r["wer"] < 0.6 for r in rows.values()), rows
