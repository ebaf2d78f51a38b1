"""The GPU encoder arrangement (fused QKV, per-layer function) computes the reference encoder.

It only runs on CUDA in the engine, but it is plain torch, so its arithmetic is checked here in
float32 on the CPU against `AudioEncoder.forward`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from whisper_fixtures import random_state_dict, tiny_dims

from voiced.engines.whisper.audio import N_SAMPLES, log_mel_spectrogram
from voiced.engines.whisper.engine import build_model
from voiced.engines.whisper.fast import FastEncoder


def test_fast_encoder_equals_reference_forward():
    dims = tiny_dims(n_mels=128)
    model = build_model(dims, random_state_dict(dims, seed=3)).eval()
    g = torch.Generator().manual_seed(0)
    audio = 0.1 * torch.randn(3, N_SAMPLES, generator=g)
    with torch.inference_mode():
        ref = model.encoder(log_mel_spectrogram(audio, dims.n_mels))
        got = FastEncoder(model.encoder, dims.n_mels)(audio, torch.float32)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
