"""GPU-only checks of the Whisper engine (skipped without CUDA): CUDA graphs against eager."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
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


def test_cuda_graphs_match_eager_full_batch(tmp_path):
    """16 different utterances decoded together: graph replay and eager steps pick the same tokens
    (both run the same kernels; see WhisperEngine's cuBLAS note), and the encoder graph equals the
    eager encoder bucket for bucket."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=5)
    rng = np.random.default_rng(0)
    base = speech("sixteen utterances decoded in one batch", tmp_path)
    clips = [(base * rng.uniform(0.3, 1.5) + 0.01 * rng.standard_normal(base.size)).astype(np.float32)
             for _ in range(16)]
    graphs = WhisperEngine.load(ckpt, device="cuda", max_batch=16, max_encoder_batch=16)
    graphs.warmup()
    eager = WhisperEngine.load(ckpt, device="cuda", max_batch=16, max_encoder_batch=16, cuda_graphs=False)
    eager.warmup()
    o = ASROptions(language="en", max_new_tokens=32, min_new_tokens=32)
    out = {}
    for eng, name in ((graphs, "g"), (eager, "e")):
        for i, c in enumerate(clips):
            eng.submit(i, ASRRequest(c, o))
        res = {}
        while eng.has_work():
            res.update({r.request_id: r.value.tokens for r in eng.step()})
        out[name] = res
    assert out["g"] == out["e"]
    x = torch.randn(4, 480000, device="cuda") * 0.1
    with torch.inference_mode(), graphs.on_stream():
        a = graphs._encode_bucket(x, 4).clone()
        b = eager._encode_bucket(x, 4).clone()
    assert torch.equal(a, b)


def test_fast_decoder_step_is_the_default_and_close_to_the_reference(tmp_path):
    """On CUDA the engine's decoder step is the fused, compiled one; in fp16 its logits match the
    modules' step up to rounding (tests/test_whisper_fast.py pins the arithmetic exactly in fp32)."""
    ckpt = make_openai_checkpoint(tmp_path, n_mels=128, seed=6)
    fast = WhisperEngine.load(ckpt, device="cuda", max_batch=8)
    ref = WhisperEngine.load(ckpt, device="cuda", max_batch=8, fast_decoder=False)
    assert fast.decoder_path == "fused, compiled" and ref.decoder_path == "reference"
    with torch.inference_mode(), fast.on_stream():
        feats = torch.randn(8, 1500, fast.dims.n_audio_state, device="cuda", dtype=fast.dtype)
        for eng in (fast, ref):
            eng.model.decoder.write_cross(eng.cache, torch.arange(8, device="cuda"), feats)
            eng._tok_buf[:8] = torch.arange(8, device="cuda") + 1000
            eng._pos_buf[:8] = 0
        a = fast._plain_step(8).float()
        b = ref._plain_step(8).float()
    assert (a - b).abs().max().item() <= 2e-2 * b.abs().max().item()
