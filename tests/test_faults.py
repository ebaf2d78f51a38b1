"""Faults held to one caller: real engines on the CPU with a fault injected into one method for one
request. The request that caused it fails with a clear error; the batch it shared goes on with the
same results as without it, and the worker keeps serving."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from tests.speech import phrase
from tests.whisper_fixtures import make_openai_checkpoint
from voiced.core.scheduler import EngineWorker
from voiced.engines.base import ASROptions, ASRRequest, CapacityError, EngineFault, TTSOptions, TTSRequest
from voiced.engines.whisper import engine as whisper_engine
from voiced.engines.whisper.chunks import Chunk
from voiced.engines.whisper.decoding import RequestDecoder
from voiced.engines.whisper.engine import WhisperEngine

TEXTS = ["Please call me back tomorrow morning.", "Seven apples and three oranges.", "Good evening."]


@pytest.fixture(scope="module", params=["per-step", "ahead"])
def asr_engine(request, tmp_path_factory):
    """The CPU's engine as it serves (a token at a time), and with chunks of 3 steps launched ahead of the one
    being read (decode-ahead), where a fault can strike while a chunk is in flight."""
    ckpt = make_openai_checkpoint(tmp_path_factory.mktemp("whisper"), seed=3)
    if request.param == "ahead":
        return WhisperEngine.load(str(ckpt), device="cpu", max_batch=8, decode_chunk=3, decode_ahead=True)
    return WhisperEngine.load(str(ckpt), device="cpu", max_batch=8)


@pytest.fixture(scope="module")
def clips():
    return [phrase(t) for t in TEXTS]


def opts(**kw) -> ASROptions:
    return ASROptions(language="en", max_new_tokens=8, min_new_tokens=8, **kw)


@pytest.fixture(scope="module")
def clean(asr_engine, clips):
    """Each clip transcribed alone, nothing injected: what the survivors must still get."""
    return [asr_engine.transcribe(ASRRequest(c, opts())).tokens for c in clips]


def run_together(engine, requests: list[ASRRequest]) -> list:
    """Submit all requests before the worker's first step (so they share one admission and one
    batch) and gather each one's transcript or the exception it got, in order."""

    async def scenario():
        worker = EngineWorker(engine, "asr")
        tasks = [asyncio.ensure_future(worker.run(r)) for r in requests]
        await asyncio.sleep(0)  # each task has queued its submission
        worker.start()
        try:
            return await asyncio.gather(*tasks, return_exceptions=True), worker
        finally:
            worker.stop()

    results, worker = asyncio.run(scenario())
    assert worker.pending == 0 and engine.active_requests() == 0 and not engine.has_work()
    return results


def test_a_fault_in_the_shared_forward_pass_fails_the_newest_request_and_the_batch_goes_on(
        asr_engine, clips, clean, monkeypatch):
    poison = opts()
    real_step = asr_engine._decoder.step

    def step(*args, **kwargs):
        # One forward pass for every row: the engine cannot tell whose rows broke it.
        if any(o is not None and o[0].request.options is poison for o in asr_engine._owner[: asr_engine._n]):
            raise RuntimeError("injected fault in the decoder")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(asr_engine._decoder, "step", step)
    results = run_together(asr_engine, [ASRRequest(clips[0], opts()), ASRRequest(clips[1], opts()),
                                        ASRRequest(clips[2], poison)])
    first, second, newest = results
    assert isinstance(newest, EngineFault)
    assert "internal error in the asr engine" in str(newest) and "injected fault in the decoder" in str(newest)
    assert [first.tokens, second.tokens] == clean[:2]  # retried without it: the same transcripts

    monkeypatch.setattr(asr_engine._decoder, "step", real_step)
    assert run_together(asr_engine, [ASRRequest(clips[2], opts())])[0].tokens == clean[2]


def test_a_fault_reading_the_rows_tokens_back_fails_the_newest_request_and_the_batch_goes_on(
        asr_engine, clips, clean, monkeypatch):
    """A fault surfacing where the host waits for a chunk's tokens (where a GPU's asynchronous error is
    reported), with the next chunk already launched ahead of it: no one can be blamed, so the newest request
    fails; the others go on from the tokens they had, not from the chunk launched ahead of the lost one."""
    poison = opts()
    real_wait = Chunk.wait

    def wait(chunk):
        if any(q.request.options is poison for q in chunk.reqs):
            raise RuntimeError("injected fault reading the tokens back")
        return real_wait(chunk)

    monkeypatch.setattr(Chunk, "wait", wait)
    results = run_together(asr_engine, [ASRRequest(clips[0], opts()), ASRRequest(clips[1], opts()),
                                        ASRRequest(clips[2], poison)])
    assert isinstance(results[2], EngineFault) and "injected fault reading the tokens back" in str(results[2])
    assert [results[0].tokens, results[1].tokens] == clean[:2]


def test_a_fault_in_one_requests_own_tokens_fails_that_request_even_when_it_is_the_oldest(
        asr_engine, clips, clean, monkeypatch):
    poison = opts()
    real_update, real_span = RequestDecoder.update_greedy, RequestDecoder.update_greedy_span

    def update_greedy(self, token, logprob):  # a step's token (an admission's first)
        if self.plan.options is poison and self.n_sampled >= 2:
            raise ValueError("injected fault in this request's tokens")
        return real_update(self, token, logprob)

    def update_greedy_span(self, tokens, sums):  # a chunk's tokens
        if self.plan.options is poison and self.n_sampled >= 2:
            raise ValueError("injected fault in this request's tokens")
        return real_span(self, tokens, sums)

    monkeypatch.setattr(RequestDecoder, "update_greedy", update_greedy)
    monkeypatch.setattr(RequestDecoder, "update_greedy_span", update_greedy_span)
    results = run_together(asr_engine, [ASRRequest(clips[2], poison), ASRRequest(clips[0], opts()),
                                        ASRRequest(clips[1], opts())])
    assert isinstance(results[0], EngineFault) and "injected fault in this request's tokens" in str(results[0])
    assert [results[1].tokens, results[2].tokens] == clean[:2]


@pytest.mark.parametrize("oom", [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                                 RuntimeError("CUDA error: out of memory")], ids=["OutOfMemoryError", "RuntimeError"])
def test_out_of_memory_while_admitting_fails_only_the_request_that_does_not_fit(
        asr_engine, clips, clean, monkeypatch, oom):
    poison = opts()
    real_encode = asr_engine.admission._encode_into_cache
    admissions = []

    def encode(audio, chosen, warming):
        admissions.append(len(chosen))
        if any(r.request.options is poison for r in chosen):
            raise oom
        return real_encode(audio, chosen, warming)

    monkeypatch.setattr(asr_engine.admission, "_encode_into_cache", encode)
    # The one that does not fit is in the middle: neither the oldest nor the newest.
    results = run_together(asr_engine, [ASRRequest(clips[0], opts()), ASRRequest(clips[2], poison),
                                        ASRRequest(clips[1], opts())])
    first, middle, last = results
    assert isinstance(middle, CapacityError) and "ran out of GPU memory" in str(middle) and "retry" in str(middle)
    assert [first.tokens, last.tokens] == clean[:2]
    assert admissions == [3, 1, 1, 1]  # together, then one by one to find the one that does not fit


def test_a_shared_vocoder_fault_fails_the_newest_reply_and_the_other_loses_no_audio(tmp_path_factory, monkeypatch):
    from tests.spark_fixtures import cached_spark_checkpoint
    from voiced.engines.spark import engine as spark_engine
    from voiced.engines.spark.bicodec import HOP

    root = tmp_path_factory.mktemp("tts")
    engine = spark_engine.SparkTTSEngine.load(str(cached_spark_checkpoint(tmp_path_factory)), device="cpu",
                                              max_batch=2, voices_dir=root / "voices")
    poison = TTSOptions(seed=2, max_seconds=0.3, first_chunk_tokens=5, chunk_tokens=5)
    from voiced.engines.spark import vocoder_schedule

    real_launch = vocoder_schedule.launch_jobs
    faults = []

    def launch_jobs(codec, jobs):
        if any(r.options is poison for r in engine._active):
            faults.append(len(jobs))
            raise RuntimeError("injected fault in the vocoder")
        return real_launch(codec, jobs)

    monkeypatch.setattr(vocoder_schedule, "launch_jobs", launch_jobs)

    async def scenario():
        worker = EngineWorker(engine, "tts")

        async def collect(request):
            return [c async for c in worker.stream(request)]

        tasks = [asyncio.ensure_future(collect(TTSRequest("Hello there, caller one.", TTSOptions(
                     seed=1, max_seconds=0.3, first_chunk_tokens=5, chunk_tokens=5)))),
                 asyncio.ensure_future(collect(TTSRequest("And hello to you, caller two.", poison)))]
        await asyncio.sleep(0)
        worker.start()
        try:
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            worker.stop()

    survivor, newest = asyncio.run(scenario())
    assert faults and isinstance(newest, EngineFault) and "injected fault in the vocoder" in str(newest)
    assert engine.active_requests() == 0
    # The windows the failed pass had taken went back: every token the survivor sampled is heard.
    assert survivor[-1].last and [c.sequence for c in survivor] == list(range(len(survivor)))
    assert sum(len(c.samples) for c in survivor) == survivor[-1].tokens * HOP
    assert all(np.isfinite(c.samples).all() for c in survivor)


def test_a_group_that_fails_together_is_admitted_one_by_one_and_all_fit(asr_engine, clips, clean, monkeypatch):
    """Out of memory for the three together, enough for each alone: nobody fails."""
    real_encode = asr_engine.admission._encode_into_cache
    admissions = []

    def encode(audio, chosen, warming):
        admissions.append(len(chosen))
        if len(chosen) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real_encode(audio, chosen, warming)

    monkeypatch.setattr(asr_engine.admission, "_encode_into_cache", encode)
    results = run_together(asr_engine, [ASRRequest(c, opts()) for c in clips])
    assert [r.tokens for r in results] == clean and admissions == [3, 1, 1, 1]


def test_transcribe_reports_an_engine_fault_as_an_engine_error(asr_engine, clips, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(asr_engine._decoder, "step", broken)
    with pytest.raises(whisper_engine.EngineError, match="speech recognition failed: RuntimeError: injected"):
        asr_engine.transcribe(ASRRequest(clips[0], opts()))
    assert asr_engine.active_requests() == 0
