"""Reference recordings to speaker tokens: a cloned voice's 32 global tokens and semantic tokens come
from BiCodec over its recording (the semantic ones through wav2vec2 features), and the fingerprint of
those weights names where `VoiceStore` caches them. The engine and the TensorRT-LLM frontend both
register voices through `voice_store`."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import torch

from voiced.engines.base import SAMPLE_RATE, EngineError
from voiced.hub import cache_dir

from .bicodec import BiCodec, reference_clip, volume_normalize
from .checkpoint import SparkCheckpoint
from .voices import VoiceStore


class Wav2Vec2Features:
    """wav2vec2-large-xlsr-53 features through `transformers`: mean of hidden states 11, 14 and 16."""

    LAYERS = (11, 14, 16)

    def __init__(self, path: str | Path, device: str) -> None:
        try:
            import transformers
            from transformers import Wav2Vec2FeatureExtractor, Wav2Vec2Model
        except ModuleNotFoundError as e:  # after start-up: no command line around to explain it
            from voiced.extras import missing_extra

            raise EngineError(str(missing_extra(e, "registering a voice") or e)) from None

        path = Path(path)
        if not (path / "config.json").exists():
            raise EngineError(f"registering a voice needs wav2vec2 ({path} is missing); run `voiced models pull spark-tts-0.5b`")
        self.processor = Wav2Vec2FeatureExtractor.from_pretrained(path)
        # fp32, as upstream runs it: transformers 5 loads in the dtype config.json names ("auto"), 4.x
        # in fp32; 4.56 renamed `torch_dtype` to `dtype`, and 5.x warns on the old name.
        kw = "dtype" if _version(transformers.__version__) >= (4, 56) else "torch_dtype"
        self.model = Wav2Vec2Model.from_pretrained(path, **{kw: torch.float32}).to(device).eval()
        if self.model.config.num_hidden_layers < max(self.LAYERS):
            raise EngineError(f"{path}: wav2vec2 has {self.model.config.num_hidden_layers} layers; need {max(self.LAYERS)}")
        self.device = device

    @torch.no_grad()
    def __call__(self, wav: np.ndarray) -> torch.Tensor:
        x = self.processor(wav, sampling_rate=SAMPLE_RATE, return_tensors="pt").input_values.to(self.device)
        hs = self.model(x, output_hidden_states=True).hidden_states
        return sum(hs[i] for i in self.LAYERS) / len(self.LAYERS)


def tokenize_reference(codec: BiCodec, features, audio: np.ndarray, device: str) -> tuple[list[int], list[int]]:
    """16 kHz reference recording -> (32 global ids, semantic ids); `features(wav)` gives wav2vec2 features."""
    cfg = codec.config
    wav = volume_normalize(audio) if cfg.volume_normalize else np.asarray(audio, np.float32)
    ref = torch.from_numpy(reference_clip(wav, cfg)).to(device)[None]
    global_ids = codec.global_tokens(ref)[0].tolist()
    semantic_ids = codec.semantic_tokens(features(wav))[0].tolist()
    return global_ids, semantic_ids


class ReferenceTokenizer:
    """`tokenize_reference` with wav2vec2 loaded on first use (registering a voice is rare: its ~1.2 GB
    stay off the GPU until then)."""

    def __init__(self, codec: BiCodec, checkpoint: SparkCheckpoint, device: str) -> None:
        self.codec, self.checkpoint, self.device = codec, checkpoint, device
        self.wav2vec2: Wav2Vec2Features | None = None

    def _features(self, wav: np.ndarray) -> torch.Tensor:
        if self.wav2vec2 is None:
            self.wav2vec2 = Wav2Vec2Features(self.checkpoint.wav2vec2_dir, self.device)
        return self.wav2vec2(wav)

    def __call__(self, audio: np.ndarray) -> tuple[list[int], list[int]]:
        return tokenize_reference(self.codec, self._features, audio, self.device)


def checkpoint_fingerprint(ckpt: SparkCheckpoint) -> str:
    """Identifies the BiCodec + wav2vec2 weights cheaply: config, the safetensors header (names, shapes,
    offsets), the file sizes, and 64 KiB samples spread through the weights. Voices' cached tokens
    live under it, so a different checkpoint re-tokenizes instead of reusing foreign tokens."""
    h = hashlib.sha256()
    for path in (ckpt.bicodec_dir / "config.yaml", ckpt.bicodec_dir / "model.safetensors"):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            for k in range(17):
                f.seek(size * k // 17)
                h.update(f.read(65536))
    for path in sorted(ckpt.wav2vec2_dir.glob("*")) if ckpt.wav2vec2_dir.is_dir() else []:
        if path.is_file():
            h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()[:16]


def voice_store(checkpoint: SparkCheckpoint, tokenize: ReferenceTokenizer,
                voices_dir: str | Path | None = None) -> VoiceStore:
    """The voices of `voices_dir` (default: the cache's voices/), their tokens cached under this
    checkpoint's fingerprint (computed on first need)."""
    root = Path(voices_dir) if voices_dir else cache_dir() / "voices"
    return VoiceStore(root, lambda: checkpoint_fingerprint(checkpoint), tokenize)


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:2])
