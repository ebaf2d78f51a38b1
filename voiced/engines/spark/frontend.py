"""The Spark-TTS host code for an LM that runs elsewhere (the TensorRT-LLM runner,
voiced/engines/trtllm/spark_runner.py, which imports this module; never the other way round):
prompts in, semantic tokens to streamed audio out.

`SparkFrontend` is a thin adapter over what SparkTTSEngine itself uses, so both backends speak the
same prompts and the same sample-exact streamed audio:

- `lm_request(TTSRequest)` -> `SparkLMRequest`: the voice's prompt (`prompt.build_prompt`) and the
  request's sampling options. The runner makes one LM request per TTS request, so the whole text is
  one prompt (the PyTorch engine speaks long text sentence by sentence in the same row instead).
- `open_stream(TTSRequest)` -> `SparkVocoderStream`: feed it the tokens the LM writes; it releases
  audio through the same `ChunkPlanner` windows (left context + lookahead of the receptive radius)
  and `decode_jobs` as the engine, so the joined stream equals the offline decode of the tokens.

Loading needs no LM weights: the tokenizer, the special-token check, BiCodec and the voice store.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from voiced.engines.base import SAMPLE_RATE, EngineError, TTSOptions, TTSRequest

from .bicodec import BiCodec, load_bicodec
from .checkpoint import SpecialTokens, TextTokenizer, load_special_tokens, resolve
from .prompt import N_GLOBAL, TOKENS_PER_SECOND, build_prompt
from .reference import ReferenceTokenizer, voice_store
from .streaming import ChunkPlanner, DecodeJob, decode_jobs
from .voices import Voice

log = logging.getLogger(__name__)

__all__ = ["TOKENS_PER_SECOND", "SparkFrontend", "SparkLMRequest", "SparkVocoderStream"]


@dataclass
class SparkLMRequest:
    """One LM generation for an LM that runs elsewhere (what `SparkFrontend.lm_request` returns)."""

    prompt_ids: list[int]
    max_new_tokens: int  # LM budget: global tokens (controllable voices) + semantic tokens + EOS
    max_semantic_tokens: int | None = None  # audio cap (TOKENS_PER_SECOND per second); None: only max_new_tokens
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    seed: int | None = None
    priority: int = 0


class SparkVocoderStream:
    """One request's incremental BiCodec decode: `push` new tokens, get the chunks that became ready."""

    def __init__(self, codec: BiCodec, device: str, radius: int, options: TTSOptions,
                 global_ids: Sequence[int] | None = None) -> None:
        self.codec, self.device = codec, device
        self.planner = ChunkPlanner(radius, options.first_chunk_tokens, options.chunk_tokens)
        self.global_ids: list[int] = list(global_ids or [])
        self.semantic: list[int] = []
        self.speaker: torch.Tensor | None = None
        self.finished = False

    def push(self, semantic_ids: Sequence[int], global_ids: Sequence[int] = ()) -> list[np.ndarray]:
        """Take the LM's new tokens (indices, not vocabulary ids); returns released audio chunks."""
        if self.finished:
            raise EngineError("this stream already finished")
        if global_ids and len(self.global_ids) < N_GLOBAL:
            self.global_ids += [int(g) for g in global_ids][: N_GLOBAL - len(self.global_ids)]
        self.semantic += [int(s) for s in semantic_ids]
        return self._release(ended=False)

    def finish(self) -> list[np.ndarray]:
        """The LM is done: release the rest (the last window ends at the utterance's true end)."""
        out = self._release(ended=True) if self.semantic else []
        self.finished = True
        return out

    def _release(self, ended: bool) -> list[np.ndarray]:
        if not self.semantic:
            return []
        if self.speaker is None:
            if len(self.global_ids) < N_GLOBAL:
                if ended:
                    raise EngineError(f"the LM wrote {len(self.global_ids)} of {N_GLOBAL} global tokens: no speaker")
                return []  # semantic tokens before the speaker is known: hold them
            g = torch.tensor([self.global_ids], dtype=torch.long, device=self.device)
            with torch.no_grad():
                self.speaker = self.codec.speaker_vector(g)[0]
        windows = self.planner.windows(len(self.semantic), ended=ended)
        if not windows:
            return []
        return decode_jobs(self.codec, [DecodeJob(self.semantic, self.speaker, w) for w in windows])


class SparkFrontend:
    """Prompts, voices and the streaming BiCodec vocoder of a Spark-TTS-0.5B checkpoint."""

    sample_rate = SAMPLE_RATE

    def __init__(self, model_dir: str | Path, device: str | None = None, voices_dir: str | Path | None = None,
                 codec_dtype: torch.dtype | None = None) -> None:
        self.checkpoint = ckpt = resolve(model_dir)
        self.device = device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = TextTokenizer(ckpt.llm_dir)
        self.special: SpecialTokens = load_special_tokens(ckpt.llm_dir, self.tokenizer)
        dtype = codec_dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
        self.codec = load_bicodec(ckpt.bicodec_dir, ckpt.root_config, device, dtype)
        self.radius = self.codec.receptive_radius()
        self._tokenize_reference = ReferenceTokenizer(self.codec, ckpt, device)  # wav2vec2 on first use
        self.voices = voice_store(ckpt, self._tokenize_reference, voices_dir)

    @classmethod
    def load(cls, model: str | Path, device: str = "cuda", voices_dir: str | Path | None = None) -> SparkFrontend:
        return cls(model, device=device, voices_dir=voices_dir)

    def _voice(self, request: TTSRequest) -> Voice:
        return self.voices.resolve((request.options or TTSOptions()).voice)

    def lm_request(self, request: TTSRequest) -> SparkLMRequest:
        opts = request.options or TTSOptions()
        text = " ".join((request.text or "").split())
        if not text:
            raise EngineError("the text is empty; send something to say")
        if opts.max_seconds <= 0:
            raise EngineError("max_seconds must be positive")
        voice = self._voice(request)
        prompt = build_prompt(self.special, self.tokenizer.encode, voice, text)
        cap = max(1, int(opts.max_seconds * TOKENS_PER_SECOND))
        extra = N_GLOBAL + 2 if voice.kind == "preset" else 2  # a controllable voice writes its speaker first
        return SparkLMRequest(prompt_ids=prompt, max_new_tokens=cap + extra, max_semantic_tokens=cap,
                              temperature=float(opts.temperature), top_k=int(opts.top_k), top_p=float(opts.top_p),
                              seed=opts.seed, priority=int(opts.priority))

    def open_stream(self, request: TTSRequest) -> SparkVocoderStream:
        opts = request.options or TTSOptions()
        voice = self._voice(request)
        return SparkVocoderStream(self.codec, self.device, self.radius, opts,
                                  voice.global_ids if voice.kind == "cloned" else None)
