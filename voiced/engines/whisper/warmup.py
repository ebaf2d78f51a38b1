"""The Whisper engine's warm-up: run now, on the GPU, every shape serving will meet, so that no request pays
a first-time cost (torch.compile, CUDA-graph capture, cuDNN / cuBLAS plans, Triton kernels). `engine` below
is the WhisperEngine (not imported here: it imports this module)."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from voiced.engines.base import SAMPLE_RATE, ASROptions, ASRRequest, finish

from .audio import N_SAMPLES


def warm_up(engine) -> None:
    """What `WhisperEngine.warmup` runs (see there), on the engine's stream."""
    steps, rt = engine.steps, engine.runtime
    for t in (steps.tok, steps.pos, steps.minleft):
        t.zero_()
    if rt.cuda_graphs:
        # Chunk graphs only here, from rows at position 0: their capture's two eager runs advance rows by
        # 2 x decode_chunk positions, past the text context from a live row near its limit.
        kinds = ("plain", "greedy", "chunk") if rt.chunk_graphs else ("plain", "greedy")
        for b in engine.buckets:
            for kind in kinds:
                if (kind, b) not in steps.graphs:
                    steps.capture(kind, b)
    elif engine.fast_decoder is not None and engine.fast_decoder.compiled:
        for b in engine.buckets:  # compile every bucket's step (the plain and greedy steps share it)
            steps.plain(b)
    encoder = engine.fast_encoder
    for b in engine.encoder_buckets():
        if encoder.graphs is not None:
            if ("encoder", b) not in encoder.graphs:
                encoder.capture(b, engine.dtype)
        else:
            encoder.run(torch.zeros(b, N_SAMPLES, device=engine.model.device), b, engine.dtype)
    # Admission at every size: with a language (prefill only) and without (detection first), with and without
    # timestamps (the two prompt lengths the prefill graphs cover). The encoder itself is skipped there
    # (`engine._warming`): its bucket shapes are warm already.
    silence = np.zeros(SAMPLE_RATE // 10, dtype=np.float32)
    ids = itertools.count(-10_000_000, -1)
    engine._warming = True
    try:
        for n in range(1, min(engine.max_encoder_batch, engine.max_batch) + 1):
            for lang, ts in (("en", False), (None, False), ("en", True)):
                for _ in range(n):
                    engine.submit(next(ids), ASRRequest(silence, ASROptions(language=lang, timestamps=ts,
                                                                            max_new_tokens=1)))
                while engine._queue or engine._active:
                    finish(engine._step())
    finally:
        engine._warming = False
    engine.words.warm()
    torch.cuda.synchronize()
