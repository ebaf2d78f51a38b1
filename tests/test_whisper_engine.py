"""The stepped batch engine: continuous batching, cancellation, capacity, errors, loading."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from whisper_fixtures import assert_same_scores, make_openai_checkpoint, openai_reference_model, speech

from voiced.engines.base import ASREngine, ASROptions, ASRRequest, CapacityError, EngineError
from voiced.engines.whisper.checkpoint import CheckpointError
from voiced.engines.whisper.engine import WhisperEngine
from voiced.hub import ModelNotFoundError

SENTENCES = [
    ("en", "Hello world. This is the first caller speaking."),
    ("de", "Guten Tag, hier spricht der zweite Anrufer."),
    ("en", "Three. Short."),
    ("fr", "Bonjour, je voudrais réserver une table pour deux personnes ce soir."),
    ("en", "The last caller reads a much longer sentence, with several clauses, so that it runs for a while."),
]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("clips")
    return [speech(t, d, voice=v) for v, t in SENTENCES]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # eot_boost: some sequences end on their own, so requests leave the batch at different steps.
    return make_openai_checkpoint(tmp_path_factory.mktemp("m"), n_mels=80, seed=11, eot_boost=9.0)


def options():
    return [
        ASROptions(max_new_tokens=40),  # language detection
        ASROptions(language="de", max_new_tokens=30, beam_size=3),
        ASROptions(language="en", max_new_tokens=12),
        ASROptions(language="fr", max_new_tokens=40, timestamps=True),
        ASROptions(language="en", max_new_tokens=48, beam_size=2, initial_prompt="A long sentence."),
    ]


def same_scores(got, want, ckpt, audio, opts: ASROptions) -> None:
    """Batch shapes change float32 rounding: scores equal as far as float32 determines them."""
    from voiced.engines.whisper.audio import window_features

    openai_opts = dict(beam_size=opts.beam_size if opts.beam_size > 1 else None, prompt=opts.initial_prompt,
                       without_timestamps=not opts.timestamps)
    assert_same_scores(got, want, openai_reference_model(ckpt), window_features(audio, 80), **openai_opts)


def run_all(engine, submissions):
    """submissions: {step_index: [(rid, request), ...]}; steps until idle; returns {rid: Transcript}."""
    results, step = {}, 0
    while engine.has_work() or any(k >= step for k in submissions):
        for rid, req in submissions.get(step, []):
            engine.submit(rid, req)
        for out in engine.step():
            assert out.final and out.error is None, out.error
            assert out.request_id not in results
            results[out.request_id] = out.value
        step += 1
        assert step < 500
    return results


def test_implements_the_contract(ckpt):
    engine = WhisperEngine.load(ckpt)
    assert isinstance(engine, ASREngine)
    assert engine.backend == "torch" and engine.device == "cpu" and engine.model_name == ckpt.stem
    assert not engine.has_work() and engine.active_requests() == 0 and engine.step() == []


@pytest.mark.slow
def test_batched_equals_alone_with_joins_and_leaves(ckpt, clips):
    alone = WhisperEngine.load(ckpt, max_batch=4)
    expected = [alone.transcribe(ASRRequest(c, o)) for c, o in zip(clips, options())]
    assert len({tuple(e.tokens) for e in expected}) == len(expected)  # all different
    lengths = {len(e.tokens) for e in expected}
    assert len(lengths) > 2  # they leave the batch at different steps

    # 10 rows for 1+3+1+1+2 = 8 rows of work: everything fits, staggered arrivals.
    engine = WhisperEngine.load(ckpt, max_batch=10)
    reqs = [ASRRequest(c, o) for c, o in zip(clips, options())]
    got = run_all(engine, {0: [(0, reqs[0]), (1, reqs[1])], 3: [(2, reqs[2])], 5: [(3, reqs[3]), (4, reqs[4])]})
    for i, e in enumerate(expected):
        assert got[i].tokens == e.tokens, i
        assert got[i].language == e.language
        same_scores(got[i], e, ckpt, clips[i], options()[i])
    assert engine.free_rows == 10 and engine.active_requests() == 0

    # Too few rows: requests wait in the queue, then take the rows others free; results unchanged.
    small = WhisperEngine.load(ckpt, max_batch=3)
    got = run_all(small, {0: list(enumerate(reqs))})
    assert [got[i].tokens for i in range(len(reqs))] == [e.tokens for e in expected]


def test_cancel_frees_rows_and_leaves_others_untouched(ckpt, clips):
    alone = WhisperEngine.load(ckpt, max_batch=4)
    opts = [ASROptions(language="en", max_new_tokens=40), ASROptions(language="de", beam_size=3, max_new_tokens=40),
            ASROptions(language="en", max_new_tokens=40)]
    expected = [alone.transcribe(ASRRequest(clips[i], o)) for i, o in enumerate(opts)]
    engine = WhisperEngine.load(ckpt, max_batch=5)
    for i, o in enumerate(opts):
        engine.submit(i, ASRRequest(clips[i], o))
    results = {}
    for _ in range(3):
        for out in engine.step():
            results[out.request_id] = out.value
    assert engine.free_rows == 0 and engine.active_requests() == 3
    engine.cancel(1)  # the beam-search request in the middle of the rows
    assert engine.free_rows == 3 and engine.active_requests() == 2
    engine.cancel(1)  # idempotent
    engine.cancel(12345)  # unknown: ignored
    # The freed rows are usable at once: a new request joins and completes correctly.
    engine.submit(7, ASRRequest(clips[3], ASROptions(language="fr", max_new_tokens=20)))
    fresh = alone.transcribe(ASRRequest(clips[3], ASROptions(language="fr", max_new_tokens=20)))
    while engine.has_work():
        for out in engine.step():
            results[out.request_id] = out.value
    assert set(results) == {0, 2, 7}
    assert results[0].tokens == expected[0].tokens and results[2].tokens == expected[2].tokens
    assert results[7].tokens == fresh.tokens
    assert engine.free_rows == 5

    # Cancelling a queued request removes it before it takes any row.
    engine.submit(8, ASRRequest(clips[0], ASROptions(max_new_tokens=5)))
    engine.cancel(8)
    assert not engine.has_work() and engine.step() == []


def test_priority_and_capacity(ckpt, clips):
    engine = WhisperEngine.load(ckpt, max_batch=1, max_queue=2)
    engine.submit(1, ASRRequest(clips[2], ASROptions(language="en", max_new_tokens=3)))
    engine.submit(2, ASRRequest(clips[2], ASROptions(language="en", max_new_tokens=3, priority=5)))
    with pytest.raises(CapacityError):
        engine.submit(3, ASRRequest(clips[2], ASROptions(language="en")))
    order = []
    while engine.has_work():
        order += [o.request_id for o in engine.step()]
    assert order == [2, 1]


def test_request_errors_are_clear(ckpt, clips):
    engine = WhisperEngine.load(ckpt, max_batch=2)
    with pytest.raises(EngineError, match="at most 30 s"):
        engine.submit(1, ASRRequest(np.zeros(31 * 16000, np.float32)))
    with pytest.raises(EngineError, match="unsupported language"):
        engine.submit(1, ASRRequest(clips[0], ASROptions(language="klingon")))
    with pytest.raises(EngineError, match="beam_size"):
        engine.submit(1, ASRRequest(clips[0], ASROptions(beam_size=3)))  # more rows than the engine has
    with pytest.raises(EngineError, match="task"):
        engine.submit(1, ASRRequest(clips[0], ASROptions(task="summarize")))
    engine.submit(1, ASRRequest(clips[0], ASROptions(max_new_tokens=2)))
    with pytest.raises(EngineError, match="already in use"):
        engine.submit(1, ASRRequest(clips[0]))


def test_english_only_model(tmp_path, clips):
    engine = WhisperEngine.load(make_openai_checkpoint(tmp_path, multilingual=False, seed=3))
    t = engine.transcribe(ASRRequest(clips[0], ASROptions(max_new_tokens=8)))
    assert t.language == "en" and t.language_probs is None and len(t.tokens) == 8
    with pytest.raises(EngineError, match="English-only"):
        engine.submit(1, ASRRequest(clips[0], ASROptions(language="de")))
    with pytest.raises(EngineError, match="translate"):
        engine.submit(1, ASRRequest(clips[0], ASROptions(task="translate")))


def test_hallucination_flags_follow_thresholds(ckpt, clips):
    engine = WhisperEngine.load(ckpt)
    silence = np.zeros(16000, np.float32)
    base = engine.transcribe(ASRRequest(silence, ASROptions(language="en", max_new_tokens=20)))
    # no_speech > threshold and avg_logprob < threshold: flagged; either filter off: not flagged.
    flag = ASROptions(language="en", max_new_tokens=20, no_speech_threshold=base.no_speech_prob / 2,
                      logprob_threshold=base.avg_logprob + 1, compression_ratio_threshold=None)
    assert engine.transcribe(ASRRequest(silence, flag)).is_hallucination
    off = ASROptions(language="en", max_new_tokens=20, no_speech_threshold=None, logprob_threshold=None,
                     compression_ratio_threshold=None)
    assert not engine.transcribe(ASRRequest(silence, off)).is_hallucination
    cr = ASROptions(language="en", max_new_tokens=20, no_speech_threshold=None,
                    compression_ratio_threshold=base.compression_ratio - 0.01)
    assert engine.transcribe(ASRRequest(silence, cr)).is_hallucination
    assert 0.0 <= base.no_speech_prob <= 1.0 and base.compression_ratio > 0


def test_kv_budget_sizes_the_batch(ckpt):
    from voiced.engines.whisper.model import KVCache

    probe = WhisperEngine.load(ckpt, max_batch=1)
    per_row = KVCache.bytes_per_slot(probe.dims, probe.dtype)
    assert WhisperEngine.load(ckpt, max_batch=64, kv_cache_bytes=5 * per_row + 1).max_batch == 5
    with pytest.raises(EngineError, match="holds no decoder row"):
        WhisperEngine.load(ckpt, kv_cache_bytes=per_row // 2)


def test_loading_errors_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("VOICED_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelNotFoundError, match="voiced models pull tiny"):
        WhisperEngine.load("tiny")
    with pytest.raises(ModelNotFoundError, match="known Whisper model"):
        WhisperEngine.load("no-such-model")
    # No .tiktoken beside the checkpoint and none in the cache: the bundled one serves (offline).
    bare = make_openai_checkpoint(tmp_path / "bare", with_tokenizer=False, seed=1)
    assert WhisperEngine.load(bare).tok.sot == 50258
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"this is not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint"):
        WhisperEngine.load(bad)
    import torch

    wrong = tmp_path / "wrong.pt"
    torch.save({"weights": {}}, wrong)
    with pytest.raises(CheckpointError, match="dims"):
        WhisperEngine.load(wrong)
    # A name in the cache loads by name; the tokenizer comes from the cache directory.
    cache = tmp_path / "cache" / "whisper"
    make_openai_checkpoint(cache, n_mels=80, multilingual=False, seed=2, name="tiny.en.pt")
    assert WhisperEngine.load("tiny.en").model_name == "tiny.en"


# ----------------------------------------------------------------------------------------------- CLI
def cli(*args, env=None):
    import os

    e = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "voiced", *args], capture_output=True, text=True, env=e, check=False)


@pytest.mark.slow
def test_cli_transcribe_json_matches_engine(ckpt, tmp_path, clips):
    wav = tmp_path / "a.wav"
    subprocess.run(["espeak-ng", "-w", str(wav), SENTENCES[0][1]], check=True)
    stereo = tmp_path / "stereo.wav"
    subprocess.run(["sox", str(wav), "-r", "44100", "-c", "2", str(stereo)], check=True)
    r = cli("transcribe", str(wav), str(stereo), "--model", str(ckpt), "--json", "--max-new-tokens", "16",
            "--language", "en")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(lines) == 2
    from voiced.audio.files import decode_file
    from voiced.audio.ingest import int16_to_float

    audio = int16_to_float(decode_file(wav.read_bytes(), 16000)[0])  # read as the CLI and the daemon read files
    expected = WhisperEngine.load(ckpt).transcribe(ASRRequest(audio, ASROptions(language="en", max_new_tokens=16)))
    rec = lines[0]
    assert rec["tokens"] == expected.tokens and rec["text"] == expected.text and rec["language"] == "en"
    same_scores(SimpleNamespace(**rec), expected, ckpt, audio, ASROptions(language="en"))
    assert {"no_speech_prob", "compression_ratio"} <= set(rec)
    assert lines[1]["tokens"]  # stereo 44.1 kHz decodes too
    r = cli("transcribe", str(wav), "--model", str(ckpt), "--json", "--timestamps", "--max-new-tokens", "16")
    assert r.returncode == 0, r.stderr
    assert "segments" in json.loads(r.stdout)


@pytest.mark.slow
def test_cli_errors_and_models(tmp_path, ckpt):
    # (`voiced transcribe` with a model it cannot have: tests/test_transcribe_cli.py)
    env = {"VOICED_CACHE": str(tmp_path / "c")}
    r = cli("models", "list", env=env)
    assert r.returncode == 0 and "no models yet" in r.stdout and "large-v3-turbo" in r.stdout
    r = cli("models", "pull", "gpt-5", env=env)
    assert r.returncode == 2 and "unknown model" in r.stderr


def test_pull_offline_says_what_to_do(tmp_path):
    from voiced.engines.whisper import registry
    from voiced.hub import DownloadError

    # A closed local port stands in for "no network": the real download code path, failing fast.
    model = registry.OfficialModel("tiny", (registry.RemoteFile("http://127.0.0.1:9/tiny.pt", "tiny.pt", None),),
                                   True, tmp_path / "tiny.pt")
    orig = registry.official_model
    registry.official_model = lambda name, root=None: model
    try:
        with pytest.raises(DownloadError, match="offline"):
            registry.pull("tiny", tmp_path)
    finally:
        registry.official_model = orig
    assert not (tmp_path / "whisper" / "tiny.pt").exists()


def test_min_new_tokens_forces_length(tmp_path, clips):
    engine = WhisperEngine.load(make_openai_checkpoint(tmp_path, seed=1, eot_boost=10.0))
    frees = [engine.transcribe(ASRRequest(c, ASROptions(language="en", max_new_tokens=60))) for c in clips]
    i = next(i for i, f in enumerate(frees) if len(f.tokens) < 20)  # this model can end early (eot_boost)...
    free = frees[i]
    forced = engine.transcribe(ASRRequest(clips[i], ASROptions(language="en", max_new_tokens=20, min_new_tokens=20)))
    assert len(forced.tokens) == 20  # ...unless end-of-text is held back
    assert forced.tokens[: len(free.tokens)] == free.tokens
