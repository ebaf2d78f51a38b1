"""The time warping's GPU kernel (voiced/engines/whisper/dtw_kernel.py) on the CPU, under Triton's interpreter
(in a child process: TRITON_INTERPRET=1 is read when the kernel is defined): every path equals the host's
`timing.dtw` (which equals openai-whisper's, tests/test_whisper_words.py), for matrices of many shapes warped
together, with random costs and with costs full of ties; and the engine's word timings are the same with
the kernel and without it. tests/test_whisper_gpu.py runs the kernel on a GPU."""

from __future__ import annotations

import numpy as np
import torch

from tests.triton_interpreter import run_interpreted

SHAPES = [(1, 1), (1, 6), (6, 1), (4, 9), (40, 300), (3, 2), (17, 120), (9, 9)]


def matrices(seed: int) -> list[np.ndarray]:
    """float32 token x frame matrices; every other one of small integers (many equal paths: the ties)."""
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) if k % 2 else rng.integers(-2, 2, s)).astype(np.float32)
            for k, s in enumerate(SHAPES)]


def _child() -> dict:
    from voiced.engines.whisper import dtw_kernel, timing

    mismatches = []
    for seed in (0, 1):
        mats = matrices(seed)
        buffer = dtw_kernel.launch([torch.from_numpy(m) for m in mats]).numpy()
        for m, (rows, cols) in zip(mats, dtw_kernel.paths(buffer)):
            want_rows, want_cols = timing.dtw(-m.astype(np.float64))
            if not (np.array_equal(rows, want_rows) and np.array_equal(cols, want_cols)):
                mismatches.append([seed, list(m.shape)])
    return {"mismatches": mismatches, "supported_on_cpu": dtw_kernel.supported(torch.device("cpu")),
            "engine": _engine_words()}


def words_both_ways(engine, audio) -> dict[str, list]:
    """Word timings of two requests finishing together (`audio` and its first half), with the warping in the
    kernel ("1") and on the host, the reference ("0")."""
    from voiced.engines.base import ASROptions, ASRRequest
    from voiced.engines.whisper import dtw_kernel

    opts = ASROptions(language="en", max_new_tokens=24, min_new_tokens=24, word_timestamps=True)
    out = {}
    on_device = dtw_kernel.supported
    try:
        for mode in ("1", "0"):
            dtw_kernel.supported = on_device if mode == "1" else (lambda device: False)
            for rid, clip in enumerate((audio, audio[: len(audio) // 2])):
                engine.submit(rid, ASRRequest(clip, opts))
            got = {}
            while engine.has_work():
                got.update({o.request_id: o.value for o in engine.step()})
            out[mode] = [[(w.word, w.start_s, w.end_s) for w in got[rid].words] for rid in (0, 1)]
    finally:
        dtw_kernel.supported = on_device
    return out


def _engine_words() -> dict:
    import tempfile

    from tests.whisper_fixtures import make_openai_checkpoint, speech
    from voiced.engines.whisper.engine import WhisperEngine

    with tempfile.TemporaryDirectory() as tmp:
        engine = WhisperEngine.load(make_openai_checkpoint(tmp, seed=4, eot_boost=3.0, n_text_layer=4), max_batch=4)
        audio = speech("Hello world. This is a test of the speech recognizer.", tmp)
    return words_both_ways(engine, audio)


def test_kernel_paths_are_the_hosts():
    got = run_interpreted("tests.test_dtw_kernel", timeout=600)
    assert got["supported_on_cpu"]  # (interpreted: the path the engine takes under the interpreter too)
    assert got["mismatches"] == []
    kernel, host = got["engine"]["1"], got["engine"]["0"]
    assert kernel == host and all(kernel) and kernel[0] != kernel[1]


def test_the_engine_keeps_the_warping_on_the_host_without_a_gpu():
    from voiced.engines.whisper import dtw_kernel

    assert not dtw_kernel.supported(torch.device("cpu"))


if __name__ == "__main__":
    import json

    print(json.dumps(_child()))
