"""Exactness against the references, on tiny random checkpoints in the real formats.

openai-whisper decodes with its own model class loaded from our `.pt` file; transformers loads our
Hugging Face directory. Same weights, same audio (espeak-ng speech), same tokens expected.

Scores (average log-probability, no-speech and language probabilities, logits) come from float32
forward passes with other kernels on each side, so they agree only to float32 rounding, which the
random models' sharp attention amplifies: they are compared with `assert_float32_close` (a
tolerance derived from float32 arithmetic on the model at hand), not a tolerance picked from a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from whisper_fixtures import (
    assert_float32_close,
    assert_same_scores,
    make_hf_checkpoint,
    make_openai_checkpoint,
    openai_reference_model,
    speech,
)

whisper = pytest.importorskip("whisper")
from whisper import DecodingOptions

from voiced.engines.base import ASROptions, ASRRequest
from voiced.engines.whisper.audio import window_features
from voiced.engines.whisper.engine import WhisperEngine

TEXTS = {
    "en": ("en", "Hello world. This is a test of the speech recognizer, reading numbers: one, two, three."),
    "de": ("de", "Guten Morgen. Wie geht es dir heute? Das Wetter ist schön."),
    "long": ("en", " ".join(["The quick brown fox jumps over the lazy dog."] * 9)),  # ~ 25 s
}


@pytest.fixture(scope="module")
def audio(tmp_path_factory):
    d = tmp_path_factory.mktemp("speech")
    out = {k: speech(t, d, voice=v) for k, (v, t) in TEXTS.items()}
    assert 15 * 16000 < len(out["long"]) <= 30 * 16000
    return out


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


_cache: dict = {}


def pair(ckpt_dir, **kw):
    """(our engine, openai-whisper's model) on one checkpoint, cached per configuration."""
    key = tuple(sorted(kw.items()))
    if key not in _cache:
        path = make_openai_checkpoint(ckpt_dir, name="m-" + "-".join(f"{k}{v}" for k, v in key) + ".pt", **kw)
        _cache[key] = (WhisperEngine.load(path, max_batch=8, window="full"), openai_reference_model(path), path)
    return _cache[key][:2]


def ref_decode(model, audio, n_mels, **opts):
    mel = window_features(audio, n_mels)
    return whisper.decode(model, mel, DecodingOptions(fp16=False, **opts))


def ours(engine, audio, **opts):
    return engine.transcribe(ASRRequest(audio, ASROptions(**opts)))


def assert_same(ours_t, ref, model, audio, n_mels, **opts):
    """Same tokens and text; scores equal as far as float32 determines them. `model`, `opts`:
    openai-whisper's model and the options `ref_decode` ran with."""
    assert ours_t.tokens == ref.tokens
    assert ours_t.text == ref.text
    assert ours_t.compression_ratio == pytest.approx(ref.compression_ratio)  # of the same text
    assert_same_scores(ours_t, ref, model, window_features(audio, n_mels), **opts)


GREEDY_CASES = [  # n_mels, multilingual, seed, eot_boost
    (80, True, 0, 0.0), (80, True, 1, 10.0), (128, True, 2, 0.0), (128, True, 3, 10.0),
    (80, False, 4, 0.0), (80, False, 5, 10.0), (128, False, 6, 0.0),
]


@pytest.mark.parametrize("n_mels,multilingual,seed,boost", GREEDY_CASES)
def test_greedy_tokens_identical_to_openai_whisper(ckpt_dir, audio, n_mels, multilingual, seed, boost):
    engine, ref = pair(ckpt_dir, n_mels=n_mels, multilingual=multilingual, seed=seed, eot_boost=boost)
    for name in ("en", "long") if not multilingual else ("en", "de", "long"):
        lang = "en" if not multilingual else TEXTS[name][0]
        opts = dict(language=lang, without_timestamps=True, sample_len=48)
        r = ref_decode(ref, audio[name], n_mels, **opts)
        o = ours(engine, audio[name], language=lang, max_new_tokens=48)
        assert_same(o, r, ref, audio[name], n_mels, **opts)
        assert o.language == r.language
    # the test must be able to fail: different audio gives different tokens
    a = ours(engine, audio["en"], language="en", max_new_tokens=48).tokens
    b = ours(engine, audio["long"], language="en", max_new_tokens=48).tokens
    assert a != b


def test_natural_end_of_text_is_reached(ckpt_dir, audio):
    engine, _ = pair(ckpt_dir, n_mels=80, multilingual=True, seed=1, eot_boost=10.0)
    o = ours(engine, audio["en"], language="en", max_new_tokens=100)
    assert 0 < len(o.tokens) < 100  # stopped by <|endoftext|>, which is not reported
    assert engine.tok.eot not in o.tokens


@pytest.mark.parametrize("n_mels,seed", [(80, 0), (80, 7), (128, 2), (128, 8)])
def test_language_detection_matches(ckpt_dir, audio, n_mels, seed):
    engine, ref = pair(ckpt_dir, n_mels=n_mels, multilingual=True, seed=seed, eot_boost=0.0)
    seen = set()
    for name in ("en", "de", "long"):
        mel = window_features(audio[name], n_mels)
        _, probs = whisper.detect_language(ref, mel)
        expected = max(probs, key=probs.get)
        o = ours(engine, audio[name], max_new_tokens=24)
        assert o.language == expected
        assert_float32_close(o.language_probs[expected], probs[expected], ref, mel,
                             lambda m, x, e=expected: whisper.detect_language(m, x)[1][e], floor=1e-4)
        assert len(o.language_probs) == (100 if n_mels == 128 else 99)
        opts = dict(without_timestamps=True, sample_len=24)  # language=None
        r = ref_decode(ref, audio[name], n_mels, **opts)
        assert_same(o, r, ref, audio[name], n_mels, **opts)
        seen.add(o.language)
    assert len(seen) >= 1


@pytest.mark.parametrize("beam,n_mels,multilingual,seed,boost", [
    (2, 80, True, 0, 0.0), (4, 80, True, 1, 10.0), (4, 128, True, 3, 9.0), (3, 80, False, 5, 10.0),
])
def test_beam_search_matches(ckpt_dir, audio, beam, n_mels, multilingual, seed, boost):
    engine, ref = pair(ckpt_dir, n_mels=n_mels, multilingual=multilingual, seed=seed, eot_boost=boost)
    for name in ("en", "long"):
        opts = dict(language="en", beam_size=beam, without_timestamps=True, sample_len=32)
        r = ref_decode(ref, audio[name], n_mels, **opts)
        o = ours(engine, audio[name], language="en", beam_size=beam, max_new_tokens=32)
        assert_same(o, r, ref, audio[name], n_mels, **opts)


@pytest.mark.parametrize("n_mels,multilingual,seed,boost", [(80, True, 1, 10.0), (128, True, 2, 0.0), (80, False, 4, 6.0)])
def test_timestamps_match(ckpt_dir, audio, n_mels, multilingual, seed, boost):
    engine, ref = pair(ckpt_dir, n_mels=n_mels, multilingual=multilingual, seed=seed, eot_boost=boost)
    for beam in (1, 2):
        opts = dict(language="en", beam_size=beam if beam > 1 else None, without_timestamps=False, sample_len=40)
        r = ref_decode(ref, audio["en"], n_mels, **opts)
        o = ours(engine, audio["en"], language="en", beam_size=beam, timestamps=True, max_new_tokens=40)
        assert_same(o, r, ref, audio["en"], n_mels, **opts)
        tb = engine.tok.timestamp_begin
        assert o.tokens[0] >= tb  # the rules force a timestamp first
        assert o.segments, "timestamps on: at least one segment"
        assert all(0 <= s.start <= s.end for s in o.segments)
        assert [t for s in o.segments for t in s.tokens] == [t for t in o.tokens if t < tb]


def test_prompt_and_translate_match(ckpt_dir, audio):
    engine, ref = pair(ckpt_dir, n_mels=80, multilingual=True, seed=0, eot_boost=0.0)
    prompt = "Names: Anneliese, Bartholomew, Quentin."
    opts = dict(language="de", prompt=prompt, without_timestamps=True, sample_len=30)
    r = ref_decode(ref, audio["de"], 80, **opts)
    o = ours(engine, audio["de"], language="de", initial_prompt=prompt, max_new_tokens=30)
    assert_same(o, r, ref, audio["de"], 80, **opts)
    plain = ours(engine, audio["de"], language="de", max_new_tokens=30)
    assert plain.tokens != o.tokens  # the prompt really reached the decoder
    opts = dict(language="de", task="translate", without_timestamps=True, sample_len=30)
    r = ref_decode(ref, audio["de"], 80, **opts)
    o = ours(engine, audio["de"], language="de", task="translate", max_new_tokens=30)
    assert_same(o, r, ref, audio["de"], 80, **opts)


# ------------------------------------------------------------------------------------ transformers
@pytest.mark.parametrize("n_mels,multilingual,seed", [(80, True, 0), (128, True, 3), (80, False, 4)])
def test_logits_match_transformers(tmp_path, audio, n_mels, multilingual, seed):
    transformers = pytest.importorskip("transformers")
    hf_dir = make_hf_checkpoint(tmp_path, n_mels=n_mels, multilingual=multilingual, seed=seed)
    hf = transformers.WhisperForConditionalGeneration.from_pretrained(hf_dir, attn_implementation="sdpa").eval()
    engine = WhisperEngine.load(hf_dir, window="full")  # our loader on the Hugging Face layout
    mel = window_features(audio["en"], n_mels)[None]
    tok = engine.tok
    tokens = torch.tensor([tok.sot_sequence("en", "transcribe") + [tok.no_timestamps] + tok.encode(" Hello world, this is")])
    def hf_logits(m, x):
        with torch.inference_mode():
            return m(input_features=x, decoder_input_ids=tokens).logits.numpy()

    def hf_features(m, x):
        with torch.inference_mode():
            return m.model.encoder(x).last_hidden_state.numpy()

    with torch.inference_mode():
        expected = hf(input_features=mel, decoder_input_ids=tokens).logits
        model = engine.model
        feats = model.encoder(mel)
        assert_float32_close(feats, hf.model.encoder(mel).last_hidden_state, hf, mel, hf_features, floor=1e-4)
        cache = model.allocate_cache(1)
        slots = torch.tensor([0])
        model.decoder.write_cross(cache, slots, feats)
        got = model.decoder.prefill(tokens, slots, cache)
        # SDPA in float32 on both sides, other projections and blocking: agreement to float32 rounding,
        # which the tiny models' sharp attention amplifies (a float64 run differs by up to ~1e-2).
        assert_float32_close(got, expected, hf, mel, hf_logits, floor=1e-4)
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
        # One incremental step from the cache equals the full-sequence logits of the last position.
        t = tokens.shape[1]
        cache2 = model.allocate_cache(1)
        model.decoder.write_cross(cache2, slots, feats)
        model.decoder.prefill(tokens[:, :-1], slots, cache2)
        step = model.decoder.step(tokens[:, -1], torch.tensor([t - 1]), cache2, kv_len=t, masked=True)
        assert_float32_close(step, expected[:, -1], hf, mel, lambda m, x: hf_logits(m, x)[:, -1], floor=1e-4)


def test_hf_directory_and_openai_file_decode_identically(tmp_path, audio):
    pt = make_openai_checkpoint(tmp_path, n_mels=128, seed=9)
    hf = make_hf_checkpoint(tmp_path, n_mels=128, seed=9)
    a = WhisperEngine.load(pt).transcribe(ASRRequest(audio["en"], ASROptions(max_new_tokens=24)))
    b = WhisperEngine.load(hf).transcribe(ASRRequest(audio["en"], ASROptions(max_new_tokens=24)))
    assert a.tokens == b.tokens and a.language == b.language
    assert a.avg_logprob == b.avg_logprob


def test_tokenizer_ids_match_openai_whisper():
    from whisper.tokenizer import get_tokenizer

    from voiced.engines.whisper.tokenizer import WhisperTokenizer

    assets = [Path(whisper.__file__).parent / "assets"]
    for multilingual, n_lang in ((True, 99), (True, 100), (False, 99)):
        ours_t = WhisperTokenizer.load(multilingual, n_lang, assets)
        ref = get_tokenizer(multilingual, num_languages=n_lang)
        assert ours_t.n_vocab == ref.encoding.n_vocab
        for attr in ("eot", "sot", "translate", "transcribe", "sot_prev", "sot_lm", "no_speech",
                     "no_timestamps", "timestamp_begin"):
            assert getattr(ours_t, attr) == getattr(ref, attr), attr
        assert ours_t.language_tokens == tuple(sorted(ref.all_language_tokens))
        assert ours_t.non_speech_tokens == ref.non_speech_tokens
        text = " Grüße aus Köln, 123 — ok?"
        assert ours_t.encode(text) == ref.encode(text)
        assert ours_t.decode(ours_t.encode(text)) == text
    v3 = WhisperTokenizer.load(True, 100, assets)
    assert (v3.sot, v3.language_token("en"), v3.translate, v3.transcribe, v3.no_timestamps, v3.n_vocab) == \
        (50258, 50259, 50359, 50360, 50364, 51866)
    assert np.array(v3.language_tokens).max() == 50358  # cantonese, the 100th
