"""Word timings (`ASROptions.word_timestamps`) against openai-whisper's on the same weights.

openai-whisper's reference: `whisper.timing.add_word_timestamps` (what `transcribe(...,
word_timestamps=True)` runs after decoding a window) on the same checkpoint, the same window
features and the same decoded segments, then fitted to the audio's pauses as ours are
(`timing.fit_to_pauses`, a step openai-whisper does not have; tested on its own below). Tiny random checkpoints here; the real tiny.en weights in
test_whisper_words_real.py.

Word probabilities: both sides compute the same thing (the float32 softmax of the forced pass's
logits over the text tokens, the token's entry, the float64 mean over a word's tokens); where they
differ is the forward pass before it, in float32 with other kernels (our SDPA and fused
projections, openai-whisper's explicit attention, BLAS blocking that changes with the thread
count), so the logits agree only to float32 rounding, which these random models' sharp attention
amplifies. The probabilities are therefore compared within a tolerance derived from float32
arithmetic on the model at hand (`whisper_fixtures.assert_float32_close`: 3 x how far they move when
every weight and input moves by float32's unit roundoff), not one picked from a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from whisper_fixtures import assert_float32_close, make_openai_checkpoint, openai_reference_model, speech, tiny_dims

from voiced.engines.base import ASROptions, ASRRequest, Word
from voiced.engines.whisper import timing
from voiced.engines.whisper.engine import WhisperEngine

TEXT = "Hello world. This is a test of the speech recognizer, reading numbers: one, two, three."


# ---------------------------------------------------------------------------- the pieces
def test_dtw_follows_the_cheap_cells():
    # A cheap staircase through a costly matrix: each token row has a run of cheap frames.
    cost = np.ones((3, 9))
    cost[0, 0:3] = cost[1, 3:5] = cost[2, 5:9] = 0.0
    rows, cols = timing.dtw(cost)
    assert list(cols) == list(range(9))
    assert list(rows) == [0, 0, 0, 1, 1, 2, 2, 2, 2]


def test_dtw_is_openai_whispers_including_ties():
    ref = pytest.importorskip("whisper.timing")
    rng = np.random.default_rng(0)
    for n, m in [(1, 1), (1, 6), (6, 1), (4, 9), (40, 300), (120, 700)]:
        for x in (rng.random((n, m)), rng.integers(0, 3, (n, m)).astype(float)):  # the second: many ties
            want = ref.dtw_cpu(x)
            got = timing.dtw(x)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (n, m)


def test_dtw_of_many_matrices_at_once_is_each_alone(monkeypatch):
    # A step's requests are warped together in padded tables; each path is openai-whisper's for its
    # own matrix, whatever shares its table (and when the budget splits them into several tables).
    ref = pytest.importorskip("whisper.timing")
    rng = np.random.default_rng(1)
    shapes = [(40, 300), (1, 1), (6, 1), (12, 700), (3, 9), (1, 6), (25, 80)]
    costs = [rng.random(s) if k % 2 else rng.integers(0, 3, s).astype(float) for k, s in enumerate(shapes)]
    for cells in (timing.DTW_CELLS, 2000):
        monkeypatch.setattr(timing, "DTW_CELLS", cells)
        for cost, got in zip(costs, timing.dtw_many(costs)):
            want = ref.dtw_cpu(cost)
            assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), cost.shape


def test_official_heads_are_openai_whispers():
    whisper = pytest.importorskip("whisper")
    theirs = {k: v for k, v in whisper._ALIGNMENT_HEADS.items() if k not in ("large", "turbo")}
    assert timing.OFFICIAL_ALIGNMENT_HEADS == theirs
    # tiny.en: 4 layers x 6 heads; its table picks heads in the upper layers only
    dims = tiny_dims(multilingual=False, n_text_layer=4, n_head=6, n_state=384)
    heads = timing.official_alignment_heads("tiny.en", dims)
    assert heads and all(1 <= layer < 4 and 0 <= h < 6 for layer, h in heads)
    assert timing.official_alignment_heads("tiny", dims) is None  # multilingual name, English-only dims
    assert timing.official_alignment_heads("tiny.en", tiny_dims(multilingual=False)) is None  # other shape
    assert timing.default_alignment_heads(dims) == [(layer, h) for layer in (2, 3) for h in range(6)]


def test_words_split_at_spaces_and_punctuation():
    from voiced.engines.whisper.tokenizer import WhisperTokenizer

    tok = WhisperTokenizer.load(multilingual=True, num_languages=99)
    ids = tok.encode(" Hello, world. Unbelievable!")
    words, groups = timing.split_words(tok, ids + [tok.eot], "en")
    assert words == [" Hello", ",", " world", ".", " Unbelievable", "!", "<|endoftext|>"]
    assert [t for g in groups for t in g] == ids + [tok.eot]
    # Japanese: whole characters, even where one character takes several tokens
    ids = tok.encode("こんにちは世界")
    words, groups = timing.split_words(tok, ids, "ja")
    assert "".join(words) == "こんにちは世界" and all("\ufffd" not in w for w in words)


def _bursts(spans: list[tuple[float, float]], total: float, noise_db: float | None = None) -> np.ndarray:
    """A 220 Hz tone during each (start, end) span, silence (or noise) between."""
    rng = np.random.default_rng(0)
    t = np.arange(int(total * 16000)) / 16000
    audio = np.zeros_like(t)
    for a, b in spans:
        on = (t >= a) & (t < b)
        audio[on] = 0.3 * np.sin(2 * np.pi * 220 * t[on])
    if noise_db is not None:
        audio += 0.3 / np.sqrt(2) * 10 ** (-noise_db / 20) * rng.standard_normal(len(t))
    return audio.astype(np.float32)


@pytest.mark.parametrize("noise_db", [None, 25.0], ids=["clean", "noisy"])
def test_boundaries_move_into_the_pause_between_words(noise_db):
    # Three "words" with pauses between them; the alignment's times tile the audio, boundaries late.
    audio = _bursts([(0.4, 0.8), (0.95, 1.3), (1.5, 1.9)], 2.3, noise_db)
    words = [Word("a", 0.0, 1.02, 0.9), Word("b", 1.02, 1.6, 0.8), Word("c", 1.6, 2.3, 0.7)]
    got = timing.fit_to_pauses(words, audio)
    want = [(0.4, 0.8), (0.95, 1.3), (1.5, 1.9)]
    assert [w.word for w in got] == ["a", "b", "c"] and [w.probability for w in got] == [0.9, 0.8, 0.7]
    for w, (a, b) in zip(got, want):
        assert abs(w.start_s - a) <= 0.011 and abs(w.end_s - b) <= 0.011, (w, a, b)


def test_no_pause_no_move():
    audio = _bursts([(0.3, 1.5)], 1.8)  # one sound throughout: the boundaries stay where they were
    words = [Word("a", 0.3, 0.72, 1.0), Word("b", 0.72, 1.1, 1.0), Word("c", 1.1, 1.5, 1.0)]
    assert timing.fit_to_pauses(words, audio) == words
    # a pause farther than PAUSE_REACH_S from the boundary is another word's business
    audio = _bursts([(0.3, 0.9), (1.0, 1.8)], 2.0)
    words = [Word("a", 0.3, 0.5, 1.0), Word("b", 0.5, 1.8, 1.0)]
    assert timing.fit_to_pauses(words, audio) == words
    # a silence shorter than PAUSE_MIN_S (a stop's closure) is no pause
    audio = _bursts([(0.3, 0.9), (0.92, 1.5)], 1.5)
    words = [Word("a", 0.3, 0.95, 1.0), Word("b", 0.95, 1.5, 1.0)]
    assert timing.fit_to_pauses(words, audio) == words


# ------------------------------------------------------------------- the engine vs openai-whisper
@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    return speech(TEXT, tmp_path_factory.mktemp("speech"))


_models: dict = {}


def models(tmp_path_factory, multilingual: bool, seed: int, boost: float):
    key = (multilingual, seed, boost)
    if key not in _models:
        path = make_openai_checkpoint(tmp_path_factory.mktemp("ckpt"), multilingual=multilingual, seed=seed,
                                      eot_boost=boost, n_text_layer=4)
        _models[key] = (WhisperEngine.load(path, max_batch=4, window="full"), openai_reference_model(path))
    return _models[key]


def reference_words(ref_model, engine, audio, result, segments, mel=None):
    """openai-whisper's add_word_timestamps over `segments` [(start, end, tokens)] of this window
    (`mel`: its features, by default the window's own)."""
    import whisper.tokenizer as wt
    from whisper.timing import add_word_timestamps

    from voiced.engines.whisper.audio import window_features

    # openai-whisper's default heads for a model loaded from a file: the upper half of the decoder
    assert engine.alignment_heads == timing.default_alignment_heads(engine.dims)
    tok = wt.get_tokenizer(engine.dims.multilingual, num_languages=ref_model.num_languages,
                           language=result.language, task="transcribe")
    segs = [{"seek": 0, "start": s, "end": e, "tokens": t} for s, e, t in segments]
    mel = window_features(audio, engine.dims.n_mels) if mel is None else mel
    add_word_timestamps(segments=segs, model=ref_model, tokenizer=tok, mel=mel,
                        num_frames=len(audio) // 160, last_speech_timestamp=0.0)
    words = [w for s in segs for w in s["words"]]
    fitted = timing.fit_to_pauses([Word(w["word"], w["start"], w["end"], w["probability"]) for w in words], audio)
    return [{**w, "start": f.start_s, "end": f.end_s} for w, f in zip(words, fitted)]


def assert_same_words(ours, theirs, ref_model, engine, audio, result, segments):
    """Same words, times within a frame, probabilities equal as far as float32 determines them."""
    from voiced.engines.whisper.audio import window_features

    assert [w.word for w in ours] == [w["word"].strip() for w in theirs]
    for a, b in zip(ours, theirs):
        assert abs(a.start_s - b["start"]) <= 0.02 and abs(a.end_s - b["end"]) <= 0.02, (a, b)

    def probs(model, mel):
        return [w["probability"] for w in reference_words(model, engine, audio, result, segments, mel)]

    assert_float32_close([w.probability for w in ours], [w["probability"] for w in theirs], ref_model,
                         window_features(audio, engine.dims.n_mels), probs, floor=1e-4)


@pytest.mark.parametrize("multilingual,seed,boost,beam", [(True, 0, 3.0, 1), (False, 4, 3.0, 1), (True, 1, 2.0, 3)])
def test_word_times_equal_openai_whisper(tmp_path_factory, audio, multilingual, seed, boost, beam):
    engine, ref = models(tmp_path_factory, multilingual, seed, boost)
    opts = ASROptions(language="en", beam_size=beam, max_new_tokens=40)
    plain = engine.transcribe(ASRRequest(audio, opts))
    assert plain.words == []  # off unless asked
    opts.word_timestamps = True
    r = engine.transcribe(ASRRequest(audio, opts))
    assert r.tokens == plain.tokens  # asking for words changes no token
    assert len(r.words) >= 10
    segments = [(0.0, (len(audio) // 160) / 100, r.tokens)]
    theirs = reference_words(ref, engine, audio, r, segments)
    assert_same_words(r.words, theirs, ref, engine, audio, r, segments)
    ends = [w.end_s for w in r.words]
    assert ends == sorted(ends) and 0.0 <= r.words[0].start_s and ends[-1] <= len(audio) / 16000 + 0.02


def test_word_times_with_segment_timestamps_equal_openai_whisper(tmp_path_factory, audio):
    engine, ref = models(tmp_path_factory, True, 1, 2.0)
    opts = ASROptions(language="en", timestamps=True, max_new_tokens=40)
    plain = engine.transcribe(ASRRequest(audio, opts))
    opts.word_timestamps = True
    r = engine.transcribe(ASRRequest(audio, opts))
    assert r.segments and r.words and r.tokens == plain.tokens
    segments = [(s.start, s.end, s.tokens) for s in plain.segments]  # the decoder's own segment times
    theirs = reference_words(ref, engine, audio, r, segments)
    assert_same_words(r.words, theirs, ref, engine, audio, r, segments)
    # As in openai-whisper's transcribe(): each segment now spans its words (what subtitles show).
    k = 0
    for seg, before in zip(r.segments, plain.segments):
        n = len(engine.tok.decode(seg.tokens).split())  # (words of this English text: space-separated)
        assert seg.tokens == before.tokens and n
        assert (seg.start, seg.end) == (r.words[k].start_s, r.words[k + n - 1].end_s)
        k += n
    assert k == len(r.words)


def _run(engine, requests):
    for rid, req in requests.items():
        engine.submit(rid, req)
    got = {}
    while engine.has_work():
        got.update({o.request_id: o for o in engine.step()})
    return got


@pytest.mark.parametrize("group_bytes", [None, 1])  # all in one forced pass; one pass each
def test_words_of_several_requests_in_one_batch(tmp_path_factory, audio, monkeypatch, group_bytes):
    # Requests finishing in one step each get their own audio's timings and end probabilities, the
    # same as alone, whether their forced passes run together or apart.
    engine, _ = models(tmp_path_factory, False, 4, 3.0)
    if group_bytes is not None:
        monkeypatch.setattr(engine.words, "budget", group_bytes)
    clips = [audio, audio[: len(audio) // 2], audio[len(audio) // 4:]]
    opts = ASROptions(language="en", max_new_tokens=30, min_new_tokens=30, word_timestamps=True)
    alone = [engine.transcribe(ASRRequest(a, opts)) for a in clips]
    passes = []
    real_pass = engine.model.decoder.alignment_hidden
    monkeypatch.setattr(engine.model.decoder, "alignment_hidden", lambda *a: passes.append(a[0].shape[0]) or real_pass(*a))
    got = _run(engine, {k: ASRRequest(a, opts) for k, a in enumerate(clips)})
    assert passes == ([3] if group_bytes is None else [1, 1, 1])  # they finished together (forced lengths)
    for k, want in enumerate(alone):
        r = got[k].value
        assert [(w.word, w.start_s, w.end_s) for w in r.words] == [(w.word, w.start_s, w.end_s) for w in want.words]
        assert [w.probability for w in r.words] == pytest.approx([w.probability for w in want.words], rel=1e-4)
        assert (r.end_prob, r.stop_prob) == pytest.approx((want.end_prob, want.stop_prob), rel=1e-4, abs=1e-6)
    assert [w.end_s for w in got[0].value.words] != [w.end_s for w in got[1].value.words]


def test_a_failing_word_timing_fails_its_request_alone(tmp_path_factory, audio, monkeypatch):
    # One request's words failing in the shared forced pass: it gets an error naming the fault, the
    # requests finishing with it still get theirs.
    from voiced.engines.whisper import words as words_module

    engine, _ = models(tmp_path_factory, False, 4, 3.0)
    short = audio[: len(audio) // 2]
    opts = ASROptions(language="en", max_new_tokens=30, min_new_tokens=30, word_timestamps=True)
    want = engine.transcribe(ASRRequest(audio, opts))
    real = words_module.fit_to_pauses

    def fit(words, clip):
        if len(clip) == len(short):
            raise ValueError("no pauses today")
        return real(words, clip)

    monkeypatch.setattr(words_module, "fit_to_pauses", fit)
    got = _run(engine, {1: ASRRequest(audio, opts), 2: ASRRequest(short, opts)})
    assert got[2].error and "no pauses today" in got[2].error and got[2].fault
    assert got[1].error is None
    assert [(w.word, w.start_s, w.end_s) for w in got[1].value.words] == [(w.word, w.start_s, w.end_s) for w in want.words]
