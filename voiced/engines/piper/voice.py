"""One Piper voice: its config (the `.onnx.json` beside the model) and its VITS graph run with onnxruntime.

The graph takes a sentence's phoneme ids (`input`, int64 [1, n]), their count (`input_lengths`), three
scales (`scales`, float32: noise_scale, length_scale, noise_w) and, for a voice of several speakers, a
speaker id (`sid`); it returns the sentence's audio at the voice's rate (22,050 Hz for medium and high
quality voices). The scales default to the voice's `inference` section (0.667, 1.0, 0.8 where it names
none), and a sentence synthesized whole (`audio`) is scaled to a peak of 1.0, as piper-tts does by default
(`SynthesisConfig.normalize_audio`). A stream (`stream`) runs the graph cut in three (graph.py) and scales
every piece by one gain a voice (`gain`).

Threads: onnxruntime's CPU provider takes one thread per core by default; a voice here takes
`threads` (intra-op) and one inter-op thread, so recognition on the same machine keeps the other cores.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from voiced.engines.base import EngineError

from .graph import CONTEXT_FRAMES, SplitGraph, chunks, split
from .phonemize import merge_vowel_clusters, phoneme_ids, phonemize, split_clauses

log = logging.getLogger(__name__)

DEFAULT_NOISE_SCALE, DEFAULT_LENGTH_SCALE, DEFAULT_NOISE_W = 0.667, 1.0, 0.8
GAIN_TEXT = "Hello, how can I help you today?"  # a voice's streamed loudness is set by this sentence (`gain`)


@dataclass(frozen=True)
class VoiceConfig:
    """What a voice's `.onnx.json` says that synthesis needs."""

    sample_rate: int
    espeak_voice: str
    phoneme_id_map: dict[str, list[int]]
    num_speakers: int = 1
    speaker_id_map: dict[str, int] = field(default_factory=dict)
    noise_scale: float = DEFAULT_NOISE_SCALE
    length_scale: float = DEFAULT_LENGTH_SCALE
    noise_w: float = DEFAULT_NOISE_W
    language: str = ""  # e.g. en_US
    quality: str = ""
    phoneme_type: str = "espeak"
    vowel_clusters: frozenset[tuple[str, ...]] = frozenset()

    @staticmethod
    def read(path: str | Path) -> VoiceConfig:
        path = Path(path)
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            inference = d.get("inference", {})
            config = VoiceConfig(
                sample_rate=int(d["audio"]["sample_rate"]), espeak_voice=d["espeak"]["voice"],
                phoneme_id_map={k: list(v) for k, v in d["phoneme_id_map"].items()},
                num_speakers=int(d.get("num_speakers", 1)), speaker_id_map=dict(d.get("speaker_id_map") or {}),
                noise_scale=float(inference.get("noise_scale", DEFAULT_NOISE_SCALE)),
                length_scale=float(inference.get("length_scale", DEFAULT_LENGTH_SCALE)),
                noise_w=float(inference.get("noise_w", DEFAULT_NOISE_W)),
                language=(d.get("language") or {}).get("code", ""), quality=d.get("audio", {}).get("quality", ""),
                phoneme_type=d.get("phoneme_type", "espeak"),
                vowel_clusters=frozenset(tuple(c) for c in d.get("vowel_clusters") or ()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise EngineError(f"{path} is not a Piper voice config ({type(e).__name__}: {e}); pull the voice again "
                              "(`voiced models pull piper:<voice>`)") from None
        if config.phoneme_type != "espeak":
            raise EngineError(f"{path}: phoneme_type {config.phoneme_type!r} is not supported (only espeak voices "
                              "are; that covers the English, European and most other voices)")
        return config


class PiperVoice:
    """A loaded voice: text -> sentences of phoneme ids -> audio (float32 at `config.sample_rate`)."""

    def __init__(self, model: str | Path, config: VoiceConfig, threads: int = 1,
                 espeak_data: str | Path | None = None) -> None:
        import onnxruntime as ort

        self.model_path, self.config = Path(model), config
        self.espeak_data = espeak_data
        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, threads)
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        providers = ["CPUExecutionProvider"]
        self.graph: SplitGraph | None = None
        self.session = None
        try:
            self.graph = split(self.model_path, options, providers)
            if self.graph is None:
                self.session = ort.InferenceSession(str(model), sess_options=options, providers=providers)
        except Exception as e:  # onnx and onnxruntime raise their own types for a missing or broken file
            raise EngineError(f"{model} could not be loaded as a Piper voice ({e}); pull the voice again") from None
        first = self.graph.encoder if self.graph is not None else self.session
        self._inputs = {i.name for i in first.get_inputs()}
        if not {"input", "input_lengths", "scales"} <= self._inputs:
            raise EngineError(f"{model} is not a Piper voice (its inputs are {sorted(self._inputs)})")
        self._gain: float | None = None

    @classmethod
    def load(cls, model: str | Path, threads: int = 1, espeak_data: str | Path | None = None) -> PiperVoice:
        """A voice from its `.onnx` file (its config is the `.onnx.json` beside it)."""
        model = Path(model)
        return cls(model, VoiceConfig.read(model.with_name(model.name + ".json")), threads, espeak_data)

    def sentences(self, text: str) -> list[list[int]]:
        """`text`'s sentences as phoneme ids."""
        return [self._ids(p) for p in phonemize(text, self.config.espeak_voice, self.espeak_data)]

    def units(self, text: str) -> list[list[int]]:
        """`text` as the pieces a stream synthesizes, in order, as phoneme ids: the first sentence clause by
        clause (its first audio is out after one clause), then each later sentence whole, as Piper speaks
        it (while the audio before it plays)."""
        sentences = phonemize(text, self.config.espeak_voice, self.espeak_data)
        if not sentences:
            return []
        return [self._ids(p) for p in (*split_clauses(sentences[0]), *sentences[1:])]

    def _ids(self, phonemes: list[str]) -> list[int]:
        c = self.config
        return phoneme_ids(merge_vowel_clusters(phonemes, set(c.vowel_clusters)), c.phoneme_id_map)

    def _feed(self, ids: list[int], noise_scale: float | None, length_scale: float | None, noise_w: float | None,
              speaker: int | None) -> dict[str, np.ndarray]:
        c = self.config
        scales = np.array([c.noise_scale if noise_scale is None else noise_scale,
                           c.length_scale if length_scale is None else length_scale,
                           c.noise_w if noise_w is None else noise_w], dtype=np.float32)
        feed = {"input": np.array([ids], dtype=np.int64), "input_lengths": np.array([len(ids)], dtype=np.int64),
                "scales": scales}
        if c.num_speakers > 1 and "sid" in self._inputs:
            feed["sid"] = np.array([speaker or 0], dtype=np.int64)
        return feed

    def audio(self, ids: list[int], noise_scale: float | None = None, length_scale: float | None = None,
              noise_w: float | None = None, speaker: int | None = None, normalize: bool = True) -> np.ndarray:
        """One sentence's audio, float32 mono at the voice's rate (peak 1.0 where `normalize`), as piper-tts makes it."""
        feed = self._feed(ids, noise_scale, length_scale, noise_w, speaker)
        if self.graph is not None:
            z = self.graph.latents(self.graph.prior(feed))
            audio = self.graph.decode(z, 0, z.shape[2])
        else:
            audio = np.asarray(self.session.run(None, feed)[0], dtype=np.float32).reshape(-1)
        if normalize:
            peak = float(np.max(np.abs(audio))) if audio.size else 0.0
            audio = audio / peak if peak >= 1e-8 else np.zeros_like(audio)
        return np.clip(audio, -1.0, 1.0).astype(np.float32)

    @property
    def gain(self) -> float:
        """What a streamed piece is scaled by: 1 / the peak of GAIN_TEXT synthesized whole (noise off).

        piper-tts scales each sentence to a peak of 1.0, which a sentence decoded chunk by chunk cannot know
        before its last chunk; one gain a voice keeps its loudness from jumping between pieces instead."""
        if self._gain is None:
            raw = np.concatenate([self.audio(ids, noise_scale=0.0, noise_w=0.0, normalize=False)
                                  for ids in self.sentences(GAIN_TEXT)])
            self._gain = 1.0 / max(float(np.max(np.abs(raw))), 1e-3)
        return self._gain

    def stream(self, ids: list[int], length_scale: float | None = None) -> Iterator[tuple[np.ndarray, bool]]:
        """A piece's audio chunk by chunk (graph.py), each with whether it is the piece's last; the first after
        the piece's prior and one short window. A voice whose graph is not cut gives the piece whole.
        `length_scale` (None: the voice's own) stretches its phonemes: 2 speaks at half the pace."""
        if self.graph is None:
            yield self.audio(ids, length_scale=length_scale), True
            return
        prior = self.graph.prior(self._feed(ids, None, length_scale, None, None))
        frames = prior[0].shape[2]
        spans = chunks(frames)
        if not spans:
            yield np.zeros(0, np.float32), True
        z = None
        for i, (start, end) in enumerate(spans):
            if i == 0 and len(spans) > 1:  # the first window's latents alone: its audio before the flow's rest
                head = self.graph.latents(prior, min(frames, end + CONTEXT_FRAMES))
                audio = self.graph.decode(head, start, end)
            else:
                z = z if z is not None else self.graph.latents(prior)
                audio = self.graph.decode(z, start, end)
            yield np.clip(audio * self.gain, -1.0, 1.0), i == len(spans) - 1

    def speak(self, text: str, **scales) -> np.ndarray:
        """The whole of `text`, sentence after sentence, at the voice's rate (what G's turn sets and the
        benches voice with)."""
        parts = [self.audio(ids, **scales) for ids in self.sentences(text)]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)
