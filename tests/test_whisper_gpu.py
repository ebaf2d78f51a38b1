"""GPU-only checks of the Whisper engine (skipped without CUDA): CUDA graphs against eager."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from whisper_fixtures import make_openai_checkpoint, speech

from voiced.engines.base import ASROptions, ASRRequest
from voiced.engines.whisper.engine import WhisperEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_cuda_graphs_match_eager_single_and_staggered(tmp_path):
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=4)
    clips = [speech(t, tmp_path) for t in ("one utterance here", "and a second, longer utterance", "third")]
    graphs = WhisperEngine.load(ckpt, device="cuda", max_batch=8)
    graphs.warmup()
    eager = WhisperEngine.load(ckpt, device="cuda", max_batch=8, cuda_graphs=False)
    for c in clips:
        o = ASROptions(language="en", max_new_tokens=24, min_new_tokens=24)
        assert graphs.transcribe(ASRRequest(c, o)).tokens == eager.transcribe(ASRRequest(c, o)).tokens
    # requests joining one per step, different lengths: continuous batching through the graphs
    results = {}
    for eng, name in ((graphs, "g"), (eager, "e")):
        pending = [(i, ASRRequest(c, ASROptions(language="en", max_new_tokens=10 + 5 * i))) for i, c in enumerate(clips)]
        out = {}
        while pending or eng.has_work():
            if pending:
                eng.submit(*pending.pop(0))
            out.update({o.request_id: o.value.tokens for o in eng.step()})
        results[name] = out
    assert results["g"] == results["e"]
