"""Overlapped engine steps on the GPU (engines.overlap; skipped without CUDA): one thread launches
recognition's step on Whisper's CUDA stream and the TTS's on its own before reading either back.
Each read-back must wait for its own engine's work on its own stream: a read made on the other
engine's stream, or before the work it reads was launched, returns stale tokens. So the transcripts
and the reply must be the very ones the same requests get with the steps one after the other."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from whisper_fixtures import make_openai_checkpoint, speech

from tests.gpu_phrases import WHISPER
from tests.spark_fixtures import cached_spark_checkpoint
from voiced.core.scheduler import EngineThread, EngineWorker
from voiced.engines.base import ASROptions, ASRRequest, TTSOptions, TTSRequest

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    from voiced.engines.spark.engine import SparkTTSEngine
    from voiced.engines.whisper.engine import WhisperEngine

    root = tmp_path_factory.mktemp("overlap")
    asr = WhisperEngine.load(make_openai_checkpoint(root / "w", n_mels=128, seed=5), device="cuda", max_batch=8,
                             max_encoder_batch=4)
    tts = SparkTTSEngine.load(cached_spark_checkpoint(tmp_path_factory), device="cuda", max_batch=4,
                              max_seq_len=512, voices_dir=root / "voices")
    asr.warmup()
    tts.warmup()
    clips = [speech(t, root) for t in WHISPER]
    return asr, tts, clips


def serve_together(engines, overlap: bool) -> tuple[list[list[int]], np.ndarray]:
    """Every clip transcribed (16 tokens each) while a reply is synthesized, all submitted before the
    engine thread's first step; the transcripts' tokens and the reply's audio."""
    asr_engine, tts_engine, clips = engines
    thread = EngineThread("engines", overlap=overlap)
    asr, tts = EngineWorker(asr_engine, "asr", thread=thread), EngineWorker(tts_engine, "tts", thread=thread)

    async def scenario():
        async def reply():
            return [c async for c in tts.stream(TTSRequest("A reply spoken while the callers are heard.",
                                                           TTSOptions(seed=3, max_seconds=2)))]

        opts = ASROptions(language="en", max_new_tokens=16, min_new_tokens=16)
        jobs = [asyncio.ensure_future(reply())]
        jobs += [asyncio.ensure_future(asr.run(ASRRequest(c, opts))) for c in clips * 2]
        await asyncio.sleep(0.05)  # every submission is queued...
        asr.start()  # ... before the thread's first step, so the batches are the same each time
        chunks, *heard = await asyncio.gather(*jobs)
        return [h.tokens for h in heard], np.concatenate([c.samples for c in chunks])

    try:
        return asyncio.run(scenario())
    finally:
        thread.stop()


def test_overlapped_steps_read_back_their_own_engines_results(engines):
    tokens, audio = serve_together(engines, overlap=False)
    assert len({tuple(t) for t in tokens}) == len(WHISPER), "different audio must give different tokens"
    for _ in range(2):
        o_tokens, o_audio = serve_together(engines, overlap=True)
        assert o_tokens == tokens
        assert audio.size > 16000 and np.array_equal(o_audio, audio)
