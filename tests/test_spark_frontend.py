"""SparkFrontend: the Spark-TTS host code the TensorRT-LLM runner drives (prompts in, semantic tokens
to streamed audio out), end to end through TrtllmSparkEngine over the fake executor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.spark_fixtures import cached_spark_checkpoint
from tests.trtllm_fakes import BINDINGS, FakeExecutor
from voiced.engines.base import TTSOptions, TTSRequest
from voiced.engines.spark.engine import SparkTTSEngine
from voiced.engines.spark.frontend import SparkFrontend
from voiced.engines.trtllm.spark_runner import SparkTokenLayout, TrtllmSparkEngine, TRTLLMSparkLM, load_spark_frontend

L = SparkTokenLayout()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cached_spark_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def frontend(ckpt, tmp_path_factory):
    return load_spark_frontend(ckpt, device="cpu", voices_dir=str(tmp_path_factory.mktemp("voices")))


def test_prompt_and_options_match_the_torch_engine(ckpt, frontend, tmp_path):
    assert isinstance(frontend, SparkFrontend) and frontend.sample_rate == 16000
    opts = TTSOptions(voice="male:low:high", seed=4, temperature=0.7, top_k=20, top_p=0.9, max_seconds=2.0, priority=3)
    req = frontend.lm_request(TTSRequest("Good morning.", opts))
    engine = SparkTTSEngine.load(ckpt, device="cpu", max_batch=1, max_seq_len=512, voices_dir=tmp_path)
    engine.submit(1, TTSRequest("Good morning.", opts))
    r = engine._queue[0]
    assert req.prompt_ids == engine._prompt(r, 0)
    assert req.prompt_ids[0] == engine.special.task_controllable_tts
    assert (req.max_semantic_tokens, req.max_new_tokens) == (100, 100 + 34)
    assert (req.temperature, req.top_k, req.top_p, req.seed, req.priority) == (0.7, 20, 0.9, 4, 3)


def test_stream_joins_to_the_offline_decode(frontend):
    torch.manual_seed(0)
    sem = torch.randint(0, 8192, (150,))
    glob = torch.randint(0, 4096, (32,))
    stream = frontend.open_stream(TTSRequest("x", TTSOptions(first_chunk_tokens=5, chunk_tokens=17)))
    chunks = stream.push(sem[:3].tolist(), glob[:10].tolist())  # semantics before the speaker is complete
    assert chunks == []
    chunks += stream.push([], glob[10:].tolist())
    for i in range(3, 150, 7):
        chunks += stream.push(sem[i : i + 7].tolist())
    chunks += stream.finish()
    assert chunks[0].shape[0] == 5 * 320 and len(chunks) > 3
    offline = frontend.codec.detokenize(sem[None], glob[None])[0].numpy()
    joined = np.concatenate(chunks)
    assert joined.shape == offline.shape and np.abs(joined - offline).max() < 1e-4


def test_trtllm_engine_streams_audio_through_the_frontend(frontend):
    ex = FakeExecutor()
    lm = TRTLLMSparkLM(ex, BINDINGS, max_batch_size=2, max_seq_len=2048)
    engine = TrtllmSparkEngine(lm, frontend)
    engine.submit(7, TTSRequest("Hello there.", TTSOptions(seed=1, max_seconds=3.0, first_chunk_tokens=4)))
    assert engine.step() == []
    (eid,) = ex.requests
    assert ex.requests[eid].input_token_ids == frontend.lm_request(TTSRequest("Hello there.", TTSOptions(seed=1))).prompt_ids
    ex.answer(eid, [L.global_base + i for i in range(32)], final=False)
    ex.answer(eid, [L.semantic_base + (i * 37) % 8192 for i in range(100)], final=False)
    ex.answer(eid, [L.semantic_base + 5, L.eos], final=True)
    outs = engine.step()
    chunks = [o.value for o in outs]
    assert outs[-1].final and chunks[-1].last and sum(o.final for o in outs) == 1
    assert [c.sequence for c in chunks] == list(range(len(chunks)))
    total = np.concatenate([c.samples for c in chunks])
    assert chunks[0].samples.shape[0] == 4 * 320 and total.shape[0] == 101 * 320
    assert not engine.has_work()
