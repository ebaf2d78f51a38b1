"""The time warping's kernel on a GPU (skipped without CUDA): its paths are the host's `timing.dtw`, bit for bit,
for matrices of every size word timings meet (up to 448 tokens against 30 s of audio) warped together,
random and full of ties; and the engine's word timings are the same with the kernel as with the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_dtw_kernel import matrices, words_both_ways
from voiced.engines.whisper import dtw_kernel, timing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_kernel_paths_are_the_hosts_on_a_gpu():
    rng = np.random.default_rng(7)
    mats = matrices(0) + [rng.standard_normal((448, 1500)).astype(np.float32),
                          rng.integers(-1, 2, (200, 900)).astype(np.float32),
                          (rng.standard_normal((30, 400)) * 1e-3).astype(np.float32)]
    buffer = dtw_kernel.launch([torch.from_numpy(m).cuda() for m in mats]).cpu().numpy()
    for m, (rows, cols) in zip(mats, dtw_kernel.paths(buffer)):
        want_rows, want_cols = timing.dtw(-m.astype(np.float64))
        assert np.array_equal(rows, want_rows) and np.array_equal(cols, want_cols), m.shape


def test_engine_word_timings_with_the_kernel_are_the_hosts(tmp_path):
    from tests.gpu_phrases import REFERENCE
    from tests.whisper_fixtures import make_openai_checkpoint, speech
    from voiced.engines.whisper.engine import WhisperEngine

    engine = WhisperEngine.load(make_openai_checkpoint(tmp_path, seed=4, eot_boost=3.0, n_text_layer=4),
                                device="cuda", max_batch=4, cuda_graphs=False)
    out = words_both_ways(engine, speech(REFERENCE["en"][1], tmp_path))
    assert out["1"] == out["0"] and all(out["1"])
