"""The contract between the daemon's schedulers and every inference engine.

An engine is a *stepped* batch machine owned by exactly one thread (the scheduler's worker):

    engine.submit(request_id, request)   # queue work; it joins the batch at the next step
    engine.cancel(request_id)            # drop it at once and free its batch slot
    outputs = engine.step()              # admit queued work, run one batched step, report results
    engine.has_work()                    # anything queued or in flight?

Nothing here is thread-safe on purpose: one owner thread means no locks in the hot loop, and it is
the same discipline TensorRT-LLM's executor needs (its `generate` steals responses across threads).
Engines never see gRPC or asyncio; the daemon never sees tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

SAMPLE_RATE = 16000  # both Whisper and BiCodec speak 16 kHz mono float32 in [-1, 1]


class EngineError(Exception):
    """A request the engine cannot serve (bad options, out of cache space, ...).

    The message is shown to the caller, so it says what to change.
    """


class CapacityError(EngineError):
    """Not enough cache/batch capacity right now; the request may be retried or queued."""


@dataclass
class EngineOutput:
    """One result from `step()`.

    `final` marks the last output of a request; after it the request id is forgotten.
    `error` is set (and `value` is None) when the request failed; it is always final.
    """

    request_id: int
    value: Any = None
    final: bool = True
    error: str | None = None
    busy: bool = False  # the error is a CapacityError: out of cache or queue space, retry later


# ----------------------------------------------------------------------------------------- ASR


@dataclass
class ASROptions:
    language: str | None = None  # None: detect
    task: str = "transcribe"  # or "translate"
    beam_size: int = 1  # 1: greedy
    timestamps: bool = False
    # Word start/end times and probabilities (Transcript.words): one more decoder pass over the
    # result and a time warping, so off unless asked.
    word_timestamps: bool = False
    initial_prompt: str | None = None
    max_new_tokens: int | None = None  # None: half the text context, as openai-whisper
    min_new_tokens: int = 0  # end-of-text is suppressed until this many tokens (forced lengths, benchmarks)
    # Hallucination filters (openai-whisper's transcribe() defaults). A result is flagged
    # `is_hallucination` when no_speech_prob > no_speech_threshold and avg_logprob < logprob_threshold,
    # or when compression_ratio > compression_ratio_threshold. None switches a filter off.
    no_speech_threshold: float | None = 0.6
    logprob_threshold: float | None = -1.0
    compression_ratio_threshold: float | None = 2.4
    priority: int = 0  # larger runs first when slots are scarce


@dataclass
class ASRRequest:
    audio: np.ndarray  # float32 mono at SAMPLE_RATE, at most 30 s
    options: ASROptions = field(default_factory=ASROptions)


@dataclass
class Segment:
    start: float  # seconds from the start of the utterance
    end: float
    text: str
    tokens: list[int]


@dataclass
class Word:
    word: str  # as written in the text, without surrounding spaces; punctuation stays attached
    # Seconds from the start of the audio the engine was given; the session core hands doors words
    # in the caller's audio time (voiced.core.speech.in_caller_time).
    start_s: float
    end_s: float
    probability: float  # mean probability of its tokens


@dataclass
class Transcript:
    text: str
    language: str
    tokens: list[int]  # decoded ids: prompt excluded, end token excluded
    avg_logprob: float
    no_speech_prob: float
    compression_ratio: float
    is_hallucination: bool = False
    segments: list[Segment] = field(default_factory=list)
    language_probs: dict[str, float] | None = None
    words: list[Word] = field(default_factory=list)  # only when ASROptions.word_timestamps


@runtime_checkable
class SteppedEngine(Protocol):
    def submit(self, request_id: int, request: Any) -> None: ...

    def cancel(self, request_id: int) -> None: ...

    def step(self) -> list[EngineOutput]: ...

    def has_work(self) -> bool: ...


@runtime_checkable
class ASREngine(SteppedEngine, Protocol):
    """`submit(id, ASRRequest)`; `step()` yields one final EngineOutput whose value is a Transcript."""

    model_name: str
    backend: str  # "torch" | "trtllm"
    device: str

    def active_requests(self) -> int: ...  # requests holding a batch slot or queued

    def transcribe(self, request: ASRRequest) -> Transcript: ...  # one-shot helper (CLI)


# ----------------------------------------------------------------------------------------- TTS


@dataclass
class TTSOptions:
    voice: str | None = None  # None: the engine's default preset
    seed: int | None = None
    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 0.95
    max_seconds: float = 30.0  # cap on the audio of one request
    first_chunk_tokens: int = 10  # semantic tokens (20 ms each) before the first audio chunk
    chunk_tokens: int = 25  # tokens per later chunk
    priority: int = 0


@dataclass
class TTSRequest:
    text: str
    options: TTSOptions = field(default_factory=TTSOptions)


@dataclass
class AudioChunk:
    """A piece of a request's audio; `value` of TTS EngineOutputs."""

    samples: np.ndarray  # float32 mono at SAMPLE_RATE
    sequence: int  # 0, 1, 2, ... per request
    offset: int  # samples already sent before this chunk
    last: bool
    tokens: int = 0  # semantic tokens covered so far


@runtime_checkable
class TTSEngine(SteppedEngine, Protocol):
    """`submit(id, TTSRequest)`; `step()` yields AudioChunks, the last one with final=True."""

    model_name: str
    backend: str
    device: str

    def active_requests(self) -> int: ...
