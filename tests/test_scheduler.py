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
    from tests.spark_fixtures import make_spark_checkpoint
    from tests.whisper_fixtures import make_openai_checkpoint
    from voiced.engines.spark.engine import SparkTTSEngine
    from voiced.engines.whisper.engine import WhisperEngine

    root = tmp_path_factory.mktemp("sched")
    asr = WhisperEngine.load(str(make_openai_checkpoint(root / "w", seed=3)), device="cpu", max_batch=4)
    tts = SparkTTSEngine.load(str(make_spark_checkpoint(root / "Spark-TTS-0.5B")), device="cpu", max_batch=2,
                              voices_dir=root / "voices")
    return asr, tts


def test_a_transcript_finishes_in_a_burst_while_a_long_reply_streams(engines):
    asr_engine, tts_engine = engines
    thread = EngineThread("engines")
    asr, tts = EngineWorker(asr_engine, "asr", thread=thread), EngineWorker(tts_engine, "tts", thread=thread)
    asr.start()
    audio = layout(["Please call me back tomorrow."], lead_s=0.2, tail_s=0.3).audio

    async def scenario():
        reply = tts.stream(TTSRequest("A long answer that keeps the synthesizer busy for a while.",
                                      TTSOptions(seed=1, max_seconds=20)))
        await reply.__anext__()  # the reply is streaming: the TTS engine has work every step
        before = tts.stats.steps
        result = await asr.run(ASRRequest(audio, ASROptions(language="en", max_new_tokens=12, min_new_tokens=12)))
        during = tts.stats.steps - before
        await reply.aclose()  # the caller hangs up on the reply: cancelled in the engine
        return result, during

    try:
        result, tts_steps_meanwhile = asyncio.run(scenario())
    finally:
        thread.stop()
    assert len(result.tokens) == 12
    # The transcript's steps ran back to back: at most the TTS step already under way got in between.
    assert tts_steps_meanwhile <= 1
    assert tts.stats.cancelled == 1 and tts_engine.active_requests() == 0
    assert np.isfinite(result.avg_logprob)


def test_warm_up_runs_on_the_thread_that_steps_the_engines(engines):
    """cuDNN keeps plans per thread, so `voiced serve` warms the engines up through EngineThread.call:
    the warm-up, and then every step, run on the one engine thread; an error in it reaches the caller."""
    import threading

    from voiced.cli.serve import _warm

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
