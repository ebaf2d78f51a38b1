"""Whisper's input features: 16 kHz audio -> log-mel spectrogram of one 30 s window (or a shorter one,
clip_window.py).

The filterbank is computed here (Slaney-style mel scale and area normalisation, the definition
librosa uses by default and the one Whisper was trained with), so nothing is downloaded and any
number of mel bands works. The STFT runs in torch so it can run on the GPU next to the model.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import torch
import torch.nn.functional as F

SAMPLE_RATE = 16000
N_FFT = 400  # 25 ms window
HOP_LENGTH = 160  # 10 ms hop
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000 samples in one window
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 mel frames; the encoder halves this to 1500 positions


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    # Slaney: linear (200/3 Hz per mel) below 1 kHz, logarithmic above.
    hz = np.asarray(hz, dtype=np.float64)
    f_sp = 200.0 / 3.0
    mel = hz / f_sp
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    above = hz >= min_log_hz
    mel = np.where(above, min_log_mel + np.log(np.maximum(hz, 1e-10) / min_log_hz) / logstep, mel)
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asarray(mel, dtype=np.float64)
    f_sp = 200.0 / 3.0
    hz = f_sp * mel
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    above = mel >= min_log_mel
    return np.where(above, min_log_hz * np.exp(logstep * (mel - min_log_mel)), hz)


@cache
def mel_filterbank(n_mels: int, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Triangular mel filters, shape (n_mels, n_fft // 2 + 1), float32.

    Bands are spaced evenly on the Slaney mel scale from 0 Hz to Nyquist, each triangle spans its
    two neighbours' centres, and each is scaled by 2 / bandwidth so every band has equal area.
    Computed in float64 and rounded once, like the reference.
    """
    fft_freqs = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    mel_points = np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2)
    hz_points = _mel_to_hz(mel_points)
    widths = np.diff(hz_points)
    ramps = hz_points[:, None] - fft_freqs[None, :]
    rising = -ramps[:-2] / widths[:-1, None]
    falling = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))
    weights *= (2.0 / (hz_points[2:] - hz_points[:-2]))[:, None]
    weights.setflags(write=False)
    return weights.astype(np.float32)


_filters_on_device: dict[tuple[int, str], torch.Tensor] = {}


def _filters(n_mels: int, device: torch.device) -> torch.Tensor:
    key = (n_mels, str(device))
    if key not in _filters_on_device:
        _filters_on_device[key] = torch.from_numpy(mel_filterbank(n_mels)).to(device)
    return _filters_on_device[key]


def pad_or_trim(audio: torch.Tensor, length: int = N_SAMPLES) -> torch.Tensor:
    """Zero-pad (or cut) the last axis to `length` samples."""
    n = audio.shape[-1]
    if n > length:
        return audio[..., :length]
    if n < length:
        return F.pad(audio, (0, length - n))
    return audio


def log_mel_spectrogram(audio: np.ndarray | torch.Tensor, n_mels: int = 80,
                        device: str | torch.device | None = None) -> torch.Tensor:
    """Log-mel features, shape (..., n_mels, frames) with frames = samples // 160, float32.

    Steps: centred STFT (reflect padding, periodic Hann window), power |X|^2 with the last frame
    dropped (so 30 s gives exactly 3000 frames), mel projection, log10 clamped at 1e-10, a floor
    8 (i.e. 80 dB) below each spectrogram's maximum, then (x + 4) / 4 to centre it near zero.
    """
    x = torch.as_tensor(audio, dtype=torch.float32)
    if device is not None:
        x = x.to(device)
    window = torch.hann_window(N_FFT, device=x.device)
    stft = torch.stft(x, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    mel = _filters(n_mels, x.device) @ power
    log_spec = torch.clamp(mel, min=1e-10).log10()
    # The floor is relative to each spectrogram's own maximum (per item when batched).
    peak = log_spec.amax(dim=(-2, -1), keepdim=True)
    log_spec = torch.maximum(log_spec, peak - 8.0)
    return (log_spec + 4.0) / 4.0


def window_features(audio: np.ndarray | torch.Tensor, n_mels: int,
                    device: str | torch.device | None = None) -> torch.Tensor:
    """Features of one utterance (at most 30 s) padded to the model's 30 s window: (n_mels, 3000)."""
    x = torch.as_tensor(audio, dtype=torch.float32)
    if device is not None:
        x = x.to(device)
    return log_mel_spectrogram(pad_or_trim(x), n_mels)
