"""The engines' worker thread: recognition is not kept waiting behind speech synthesis."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from tests.speech import layout
from voiced.core.scheduler import EngineThread, EngineWorker
from voiced.engines.base import ASROptions, ASRRequest, TTSOptions, TTSRequest


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from tests.spark_fixtures import cached_spark_checkpoint
    from tests.whisper_fixtures import make_openai_checkpoint
    from voiced.engines.spark.engine import SparkTTSEngine
    from voiced.engines.whisper.engine import WhisperEngine

    root = tmp_path_factory.mktemp("sched")
    asr = WhisperEngine.load(str(make_openai_checkpoint(root / "w", seed=3)), device="cpu", max_batch=4)
    tts = SparkTTSEngine.load(str(cached_spark_checkpoint(tmp_path_factory)), device="cpu", max_batch=2,
                              voices_dir=root / "voices")
    return asr, tts


def started(engines, **thread_options) -> tuple[EngineThread, EngineWorker, EngineWorker]:
    """Both engines' workers on one engine thread, started."""
    asr_engine, tts_engine = engines
    thread = EngineThread("engines", **thread_options)
    asr, tts = EngineWorker(asr_engine, "asr", thread=thread), EngineWorker(tts_engine, "tts", thread=thread)
    asr.start()
    return thread, asr, tts


def transcript_during_a_long_reply(engines, first_budget_s: float):
    """A reply streams; a 12-token transcript is asked for meanwhile; then the caller hangs up on the
    reply. Returns the transcript, the engine thread's step log and the two workers."""
    thread, asr, tts = started(engines, step_log=10_000)
    thread.first_budget_s = first_budget_s
    audio = layout(["Please call me back tomorrow."], lead_s=0.2, tail_s=0.3).audio

    async def scenario():
        reply = tts.stream(TTSRequest("A long answer that keeps the synthesizer busy for a while.",
                                      TTSOptions(seed=1, max_seconds=20)))
        await reply.__anext__()  # the reply is streaming: the TTS engine has work every step
        result = await asr.run(ASRRequest(audio, ASROptions(language="en", max_new_tokens=12, min_new_tokens=12)))
        await reply.aclose()  # the caller hangs up on the reply: cancelled in the engine
        return result

    try:
        result = asyncio.run(scenario())
    finally:
        thread.stop()
    assert len(result.tokens) == 12 and np.isfinite(result.avg_logprob)
    assert tts.stats.cancelled == 1 and tts.engine.active_requests() == 0
    return result, list(thread.step_log), asr, tts


def asr_span(log):
    """Indexes in the step log of the transcript's submission and of its completion."""
    (rid,) = {ids[0] for name, event, ids in log if name == "asr" and event == "submit"}
    start = log.index(("asr", "submit", (rid,)))
    end = log.index(("asr", "done", (rid,)))
    return start, end


def test_a_transcript_finishes_in_a_burst_while_a_long_reply_streams(engines):
    _, log, _, _ = transcript_during_a_long_reply(engines, first_budget_s=float("inf"))
    start, end = asr_span(log)
    during = [(name, event) for name, event, _ in log[start + 1 : end]]
    # From the moment the transcript reached the engine thread, its steps ran back to back: not one TTS
    # step in between (the step already under way when it was sent ran before the submission landed).
    assert during and set(during) == {("asr", "step")}, during
    # ... while the reply was streaming before it and still in the engine after it, until the caller
    # hung up (a cancel is logged only for a request the engine still held).
    tts_id = next(ids[0] for name, event, ids in log if name == "tts" and event == "submit")
    assert ("tts", "step", (tts_id,)) in log[:start]
    assert ("tts", "cancel", (tts_id,)) in log[end:] and ("tts", "done", (tts_id,)) not in log


def test_the_budget_lets_the_reply_step_between_transcript_steps(engines):
    """A queue of transcripts may not starve the replies: past its budget (here none at all), the
    recognition engine yields one step to the others."""
    _, log, asr, _ = transcript_during_a_long_reply(engines, first_budget_s=0.0)
    start, end = asr_span(log)
    steps = [name for name, event, _ in log[start + 1 : end] if event == "step"]
    assert steps[0] == "asr" and steps.count("asr") >= 2  # the 12 tokens take a few steps
    assert all(a != b for a, b in zip(steps, steps[1:])), steps  # asr, tts, asr, tts, ...


def test_warm_up_runs_on_the_thread_that_steps_the_engines(engines):
    """cuDNN keeps plans per thread, so `voiced serve` warms the engines up through EngineThread.call:
    the warm-up, and then every step, run on the one engine thread; an error in it reaches the caller."""
    import threading

    from voiced.assembly import _warm

    asr_engine, _ = engines
    thread = EngineThread("engines")
    seen: dict[str, set[int]] = {"warmup": set(), "step": set()}
    real_step = asr_engine.step
    asr_engine.warmup = lambda: seen["warmup"].add(threading.get_ident())

    def step():
        seen["step"].add(threading.get_ident())
        return real_step()

    asr_engine.step = step
    try:
        _warm(asr_engine, thread)  # the thread starts here, before any engine is attached to it
        asr = EngineWorker(asr_engine, "asr", thread=thread)
        asr.start()
        audio = layout(["Good morning."], lead_s=0.2, tail_s=0.3).audio
        asyncio.run(asr.run(ASRRequest(audio, ASROptions(language="en", max_new_tokens=4))))

        def broken():
            raise RuntimeError("no GPU memory left for the graphs")

        with pytest.raises(RuntimeError, match="no GPU memory"):
            thread.call(broken)
        assert thread.call(lambda: threading.get_ident()) in seen["warmup"]  # still serving after it
    finally:
        thread.stop()
        del asr_engine.warmup, asr_engine.step
    assert len(seen["warmup"]) == 1 and seen["step"] == seen["warmup"]
    assert threading.get_ident() not in seen["warmup"]


def transcript_and_reply(engines, overlap: bool):
    """A 2 s reply is synthesized while a 12-token transcript is asked for, on one engine thread;
    returns the transcript's tokens, the reply's audio and the thread's step log."""
    thread, asr, tts = started(engines, step_log=10_000, overlap=overlap)
    audio = layout(["Please call me back tomorrow."], lead_s=0.2, tail_s=0.3).audio

    async def scenario():
        reply = tts.stream(TTSRequest("A long answer that keeps the synthesizer busy for a while.",
                                      TTSOptions(seed=1, max_seconds=2)))
        chunks = [await reply.__anext__()]  # the reply is streaming when the transcript is asked for
        heard = asyncio.ensure_future(asr.run(ASRRequest(audio, ASROptions(language="en", max_new_tokens=12,
                                                                           min_new_tokens=12))))
        chunks += [c async for c in reply]
        return (await heard).tokens, np.concatenate([c.samples for c in chunks])

    try:
        tokens, speech = asyncio.run(scenario())
    finally:
        thread.stop()
    return tokens, speech, list(thread.step_log)


def test_overlapped_steps_give_the_same_transcript_and_reply(engines):
    """engines.overlap changes when each engine's work runs, never what it computes: the caller gets
    the same transcript and the same audio, and while both have work they take turns step by step."""
    tokens, speech, _ = transcript_and_reply(engines, overlap=False)
    o_tokens, o_speech, log = transcript_and_reply(engines, overlap=True)
    assert o_tokens == tokens and len(tokens) == 12
    assert speech.size > 16000 and np.array_equal(o_speech, speech)
    start, end = asr_span(log)
    tts_id = next(ids[0] for name, event, ids in log if name == "tts" and event == "submit")
    reply_end = log.index(("tts", "done", (tts_id,)))
    steps = [name for name, event, _ in log[start + 1 : min(end, reply_end)] if event == "step"]
    assert steps.count("asr") >= 2, steps
    # While both have work, a round steps each once: recognition never runs two steps in a row.
    assert all(a != b for a, b in zip(steps, steps[1:])), steps


def test_an_overlapped_step_that_fails_fails_the_newest_reply_only(engines, monkeypatch):
    """A shared TTS pass that raises in an overlapped round fails the newest reply alone; the older
    reply and the transcript in the same rounds go on."""
    _, tts_engine = engines
    thread, asr, tts = started(engines, overlap=True)
    audio = layout(["Good morning."], lead_s=0.2, tail_s=0.3).audio
    real_run_steps = tts_engine.lm.run_steps
    broken = {"once": False}

    def run_steps(*args, **kwargs):
        if len(tts_engine._active) == 2 and not broken["once"]:
            broken["once"] = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_run_steps(*args, **kwargs)

    monkeypatch.setattr(tts_engine.lm, "run_steps", run_steps)

    async def scenario():
        first = tts.stream(TTSRequest("The first answer, long enough to share steps.", TTSOptions(seed=1, max_seconds=2)))
        got = [await first.__anext__()]
        second = tts.stream(TTSRequest("The second answer.", TTSOptions(seed=2, max_seconds=2)))
        heard = asyncio.ensure_future(asr.run(ASRRequest(audio, ASROptions(language="en", max_new_tokens=4))))
        with pytest.raises(Exception, match="illegal memory access"):
            async for _ in second:
                pass
        got += [c async for c in first]
        return got, await heard

    try:
        got, heard = asyncio.run(scenario())
    finally:
        thread.stop()
    assert broken["once"] and got[-1].last and len(heard.tokens) >= 1
    assert tts_engine.active_requests() == 0 and tts.stats.failed == 1
