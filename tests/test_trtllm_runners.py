"""The Whisper and Spark-TTS runners' request building and result handling, over the executor
interface (tests/trtllm_fakes.py), with the real Whisper tokenizer and features."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from tests.spark_fixtures import cached_spark_checkpoint
from tests.trtllm_fakes import BINDINGS, FakeExecutor
from voiced.engines.base import ASROptions, ASRRequest, EngineError, TTSOptions, TTSRequest
from voiced.engines.spark.frontend import SparkLMRequest
from voiced.engines.trtllm.spark_runner import SparkTokenLayout, TrtllmSparkEngine, TRTLLMSparkLM, load_spark_frontend
from voiced.engines.trtllm.whisper_runner import (
    TrtllmWhisperEngine,
    WhisperEngineLimits,
    WhisperFrontend,
    compression_ratio,
    split_segments,
)


@pytest.fixture(scope="module")
def frontend():
    whisper = pytest.importorskip("whisper")  # for its bundled multilingual.tiktoken only
    from voiced.engines.whisper.audio import window_features
    from voiced.engines.whisper.tokenizer import WhisperTokenizer

    assets = Path(os.path.dirname(whisper.__file__)) / "assets"
    tok = WhisperTokenizer.load(True, 99, [assets])
    return WhisperFrontend(features=lambda a, n: window_features(a, n), tokenizer=tok)


LIMITS = WhisperEngineLimits(n_mels=80, num_languages=99, vocab_size=51865, max_batch_size=4, max_beam_width=2,
                             max_prompt_tokens=14, max_seq_len=114, context_logits=True)


def engine(frontend, limits=LIMITS, ex=None):
    ex = ex or FakeExecutor()
    return ex, TrtllmWhisperEngine(ex, BINDINGS, limits, frontend, model_name="small", device="cpu")


def logits_row(vocab, hot: dict[int, float]):
    row = np.full(vocab, -30.0, dtype=np.float32)
    for t, v in hot.items():
        row[t] = v
    return row


def test_request_carries_features_prompt_and_end_ids(frontend):
    ex, eng = engine(frontend)
    tok = frontend.tokenizer
    audio = (0.1 * np.sin(np.arange(16000) / 10)).astype(np.float32)
    eng.submit(7, ASRRequest(audio, ASROptions(language="de", beam_size=2, max_new_tokens=500)))
    eng.step()
    (req,) = ex.requests.values()
    assert req.input_token_ids == [tok.sot, tok.language_token("de"), tok.transcribe, tok.no_timestamps]
    assert req.encoder_input_features.shape == (3000, 80)  # [frames, n_mels], as run.py transposes
    assert req.encoder_output_length == 1500
    assert req.end_id == req.pad_id == tok.eot
    assert req.sampling_config.beam_width == 2
    assert req.max_tokens == 114 - 4  # capped by the engine's max_seq_len
    assert req.output_config.return_context_logits and req.output_config.exclude_input_from_output


def test_transcript_from_tokens_logprobs_and_context_logits(frontend):
    ex, eng = engine(frontend)
    tok = frontend.tokenizer
    eng.submit(1, ASRRequest(np.zeros(8000, np.float32), ASROptions(language="en")))
    eng.step()
    eid = next(iter(ex.requests))
    text = tok.encode(" Hello world.")
    ctx = np.stack([logits_row(51865, {tok.no_speech: 5.0, 220: 5.0})] + [logits_row(51865, {})] * 3)
    ex.answer(eid, text + [tok.eot], cum_log_probs=[-1.5], context_logits=ctx)
    (out,) = eng.step()
    t = out.value
    assert out.final and out.error is None
    assert t.text == "Hello world." and t.tokens == text and t.language == "en"
    assert t.avg_logprob == pytest.approx(-1.5 / (len(text) + 1))
    assert t.no_speech_prob == pytest.approx(0.5, abs=1e-3)  # two equal logits at SOT
    assert t.compression_ratio == pytest.approx(compression_ratio("Hello world."))
    assert not t.is_hallucination


def test_language_detection_is_a_first_pass_then_transcription(frontend):
    ex, eng = engine(frontend)
    tok = frontend.tokenizer
    eng.submit(3, ASRRequest(np.zeros(16000, np.float32), ASROptions(language=None)))
    eng.step()
    (detect_id,) = ex.requests
    assert ex.requests[detect_id].input_token_ids == [tok.sot] and ex.requests[detect_id].max_tokens == 1
    fr, en = tok.language_token("fr"), tok.language_token("en")
    ex.answer(detect_id, [fr], context_logits=logits_row(51865, {fr: 3.0, en: 1.0})[None])
    assert eng.step() == []  # the transcription pass was enqueued in the same step
    second = [e for e in ex.requests if e != detect_id]
    assert len(second) == 1
    assert ex.requests[second[0]].input_token_ids[:3] == [tok.sot, fr, tok.transcribe]
    ex.answer(second[0], tok.encode(" Bonjour") + [tok.eot], cum_log_probs=[-0.2])
    (out,) = eng.step()
    assert out.value.language == "fr" and out.value.text == "Bonjour"
    assert out.value.language_probs["fr"] == pytest.approx(np.exp(3) / (np.exp(3) + np.exp(1) + 97 * np.exp(-30)))


def test_cancel_during_language_detection(frontend):
    ex, eng = engine(frontend)
    eng.submit(3, ASRRequest(np.zeros(16000, np.float32)))
    eng.step()
    (detect_id,) = ex.requests
    eng.cancel(3)
    assert ex.cancelled == [detect_id]
    assert eng.step() == [] and not eng.has_work() and len(ex.requests) == 1


def test_hallucination_flags_and_limits(frontend):
    ex, eng = engine(frontend)
    tok = frontend.tokenizer
    eng.submit(1, ASRRequest(np.zeros(100, np.float32), ASROptions(language="en")))
    eng.step()
    loop = tok.encode(" thank you" * 40)[:100]
    ex.answer(next(iter(ex.requests)), loop, cum_log_probs=[-5.0])
    (out,) = eng.step()
    assert out.value.compression_ratio > 2.4 and out.value.is_hallucination
    with pytest.raises(EngineError, match="max_beam_width 2"):
        eng.submit(2, ASRRequest(np.zeros(100, np.float32), ASROptions(beam_size=5)))
    with pytest.raises(EngineError, match="at most 30 s"):
        eng.submit(2, ASRRequest(np.zeros(31 * 16000, np.float32)))
    with pytest.raises(EngineError, match="unknown language"):
        eng.submit(2, ASRRequest(np.zeros(100, np.float32), ASROptions(language="xx")))
    with pytest.raises(EngineError, match='word timestamps.*asr.backend = "torch"'):
        eng.submit(2, ASRRequest(np.zeros(100, np.float32), ASROptions(word_timestamps=True)))


def test_initial_prompt_is_trimmed_to_the_engine_budget(frontend):
    ex, eng = engine(frontend)
    tok = frontend.tokenizer
    eng.submit(1, ASRRequest(np.zeros(100, np.float32),
                             ASROptions(language="en", initial_prompt="Names: Ada Lovelace, Grace Hopper, Alan Turing")))
    eng.step()
    (req,) = ex.requests.values()
    assert len(req.input_token_ids) == 14 and req.input_token_ids[0] == tok.sot_prev
    assert req.input_token_ids[-4:] == [tok.sot, tok.language_token("en"), tok.transcribe, tok.no_timestamps]


def test_timestamped_tokens_become_segments(frontend):
    tok = frontend.tokenizer
    b = tok.timestamp_begin
    tokens = [b + 0] + tok.encode(" One.") + [b + 50, b + 50] + tok.encode(" Two.") + [b + 120]
    segs = split_segments(tokens, tok)
    assert [(s.start, s.end, s.text) for s in segs] == [(0.0, 1.0, "One."), (1.0, 2.4, "Two.")]


def test_engine_limits_from_trtllm_build_config(tmp_path):
    for part, cfg in (("encoder", {"pretrained_config": {"n_mels": 128, "num_languages": 100, "dtype": "bfloat16"},
                                   "build_config": {"max_batch_size": 8}}),
                      ("decoder", {"pretrained_config": {"vocab_size": 51866},
                                   "build_config": {"max_batch_size": 8, "max_beam_width": 4, "max_input_len": 14,
                                                    "max_seq_len": 114, "gather_context_logits": True}})):
        (tmp_path / part).mkdir()
        (tmp_path / part / "config.json").write_text(json.dumps(cfg))
    lim = WhisperEngineLimits.from_engine_dir(tmp_path)
    assert (lim.n_mels, lim.num_languages, lim.max_beam_width, lim.max_prompt_tokens) == (128, 100, 4, 14)
    assert lim.multilingual and lim.context_logits and lim.dtype == "bfloat16"
    with pytest.raises(EngineError, match="voiced engines build whisper"):
        WhisperEngineLimits.from_engine_dir(tmp_path / "nope")


def test_features_are_sent_in_the_engines_dtype(frontend):
    """Issue 16.1: the encoder copies features into a buffer of the engine's dtype and refuses others."""
    torch = pytest.importorskip("torch")
    for dtype, torch_dtype in (("float16", torch.float16), ("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        ex, eng = engine(frontend, dataclasses.replace(LIMITS, dtype=dtype), FakeExecutor(encoder_dtype=dtype))
        eng.submit(1, ASRRequest(np.zeros(16000, np.float32), ASROptions(language="en")))
        eng.step()
        (eid,) = ex.requests
        assert ex.requests[eid].encoder_input_features.dtype == torch_dtype
        ex.answer(eid, frontend.tokenizer.encode(" Hi") + [frontend.tokenizer.eot], cum_log_probs=[-0.1])
        (out,) = eng.step()
        assert out.error is None and out.value.text == "Hi"


def test_beam_engines_say_beam_widths_do_not_batch_and_requests_stay_greedy(frontend, caplog):
    """Issue 16.4: the executor runs one beam width at a time; greedy is the default on both passes."""
    log_name = "voiced.engines.trtllm.whisper_runner"
    with caplog.at_level(logging.WARNING, logger=log_name):
        engine(frontend, dataclasses.replace(LIMITS, max_beam_width=1))
    assert not caplog.records
    with caplog.at_level(logging.WARNING, logger=log_name):
        ex, eng = engine(frontend)  # max_beam_width 2
    assert "one beam width at a time" in caplog.text and "max_beam_width 2" in caplog.text
    tok = frontend.tokenizer
    eng.submit(1, ASRRequest(np.zeros(8000, np.float32)))  # default options: detect the language
    eng.step()
    (detect,) = ex.requests
    assert ex.requests[detect].sampling_config.beam_width == 1
    ex.answer(detect, [tok.language_token("en")])
    eng.step()
    (transcribe,) = [e for e in ex.requests if e != detect]
    assert ex.requests[transcribe].sampling_config.beam_width == 1


# ------------------------------------------------------------------------------------ Spark LM

L = SparkTokenLayout()


def g(i):
    return L.global_base + i


def s(i):
    return L.semantic_base + i


def test_spark_lm_streams_globals_then_semantics_until_eos():
    ex = FakeExecutor()
    lm = TRTLLMSparkLM(ex, BINDINGS, max_batch_size=4, max_seq_len=2560)
    lm.submit(1, SparkLMRequest(prompt_ids=[1, 2, 3], max_new_tokens=100, seed=7))
    lm.step()
    (eid,) = ex.requests
    req = ex.requests[eid]
    assert req.streaming and req.end_id == L.eos and req.max_tokens == 100
    sc = req.sampling_config
    assert (sc.beam_width, sc.top_k, sc.top_p, sc.temperature, sc.seed) == (1, 50, 0.95, 0.8, 7)
    ex.answer(eid, [g(5), g(6), 151664, s(10)], final=False)  # a non-audio token (151664) is skipped
    ex.answer(eid, [s(11), s(12)], final=False)
    ex.answer(eid, [s(13), L.eos], final=True)
    outs = lm.step()
    deltas = [o.value for o in outs]
    assert [d.global_ids for d in deltas] == [[5, 6], [], []]
    assert [d.semantic_ids for d in deltas] == [[10], [11, 12], [13]]
    assert [o.final for o in outs] == [False, False, True] and deltas[-1].finish == "eos"
    assert deltas[-1].total_semantic == 4 and not lm.has_work()


def test_spark_lm_audio_cap_stops_the_request_and_frees_the_slot():
    ex = FakeExecutor()
    lm = TRTLLMSparkLM(ex, BINDINGS, max_batch_size=4, max_seq_len=2560)
    lm.submit(1, SparkLMRequest(prompt_ids=[1], max_new_tokens=100, max_semantic_tokens=3))
    lm.step()
    (eid,) = ex.requests
    ex.answer(eid, [s(1), s(2), s(3), s(4)], final=False)
    (o,) = lm.step()
    assert o.final and o.value.semantic_ids == [1, 2, 3] and o.value.finish == "cap"
    assert ex.cancelled == [eid]
    lm.step()
    assert lm.in_flight() == 0


def test_spark_lm_rejects_prompts_that_do_not_fit():
    lm = TRTLLMSparkLM(FakeExecutor(), BINDINGS, max_batch_size=1, max_input_len=9, max_seq_len=10)
    with pytest.raises(EngineError, match="max_input_len 9"):
        lm.submit(1, SparkLMRequest(prompt_ids=list(range(10)), max_new_tokens=5))


def test_spark_lm_refuses_prompts_over_the_engines_max_input_len():
    """Issue 16.2: the executor refuses prompts over the engine's max_input_len, not only max_seq_len."""
    ex = FakeExecutor(max_input_len=1024)
    lm = TRTLLMSparkLM(ex, BINDINGS, max_batch_size=2, max_input_len=1024, max_seq_len=2560)
    lm.submit(1, SparkLMRequest(prompt_ids=list(range(1024)), max_new_tokens=5))  # exactly the limit
    with pytest.raises(EngineError, match=r"1025 tokens.*max_input_len 1024.*--max-input-len"):
        lm.submit(2, SparkLMRequest(prompt_ids=list(range(1025)), max_new_tokens=5))
    assert lm.step() == [] and len(ex.requests) == 1  # the accepted one runs; nothing failed in the executor


def test_a_voice_too_long_for_the_engine_is_refused_when_registered(tmp_path, tmp_path_factory):
    """Issue 16.2: a cloned voice's reference tokens go into every prompt; refuse the clip up front,
    naming the engine's limit and the clip's length, instead of failing every request that uses it."""
    frontend = load_spark_frontend(cached_spark_checkpoint(tmp_path_factory), device="cpu", voices_dir=str(tmp_path))
    ex = FakeExecutor(max_input_len=512)
    engine = TrtllmSparkEngine(TRTLLMSparkLM(ex, BINDINGS, max_batch_size=2, max_input_len=512, max_seq_len=2048),
                               frontend)
    clip = (0.1 * np.random.default_rng(0).standard_normal(12 * 16000)).astype(np.float32)
    with pytest.raises(EngineError, match=r"(?s)12\.0 s.*max_input_len 512.*--max-input-len"):
        engine.voices.add("long", clip, "A reference recording that runs on for twelve seconds.")
    assert "long" not in [v.name for v in engine.voices.list()]
    # A short clip whose transcript is long: caught once the clip is tokenized, and not kept.
    with pytest.raises(EngineError, match=r"(?s)3\.0 s\) and its transcript make a prompt of \d+ tokens.*512"):
        engine.voices.add("wordy", clip[: 3 * 16000], "So many words. " * 30)
    assert "wordy" not in [v.name for v in engine.voices.list()]
    engine.voices.add("short", clip[: 3 * 16000], "Three seconds.")
    engine.submit(1, TTSRequest("Hello there.", TTSOptions(voice="short")))
    engine.step()
    (eid,) = ex.requests
    assert len(ex.requests[eid].input_token_ids) <= 512 and ex.live == {eid}  # accepted by the executor


def test_spark_token_layout_is_checked_against_added_tokens(tmp_path):
    table = {"<|im_end|>": 151645, "<|bicodec_global_0|>": 151665, "<|bicodec_global_4095|>": 155760,
             "<|bicodec_semantic_0|>": 155761, "<|bicodec_semantic_8191|>": 163952}
    p = tmp_path / "added_tokens.json"
    p.write_text(json.dumps(table))
    assert SparkTokenLayout.from_added_tokens(p) == SparkTokenLayout()
    p.write_text(json.dumps({**table, "<|im_end|>": 151643}))
    with pytest.raises(EngineError, match="<\\|im_end\\|>: expected 151645, found 151643"):
        SparkTokenLayout.from_added_tokens(p)
