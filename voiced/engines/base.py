"""The contract between the daemon's schedulers and every inference engine.

An engine is a *stepped* batch machine owned by exactly one thread (the scheduler's worker):

    engine.submit(request_id, request)   # queue work; it joins the batch at the next step
    engine.cancel(request_id)            # drop it at once and free its batch slot
    outputs = engine.step()              # admit queued work, run one batched step, report results
    engine.has_work()                    # anything queued or in flight?

Faults are held to the request that caused them. Where an engine can tell which request failed
(admitting it, preparing its inputs, taking its tokens), it reports an error output for that request
alone and goes on with the others; a CUDA out-of-memory while admitting a group of requests is
retried with each admitted alone, so only the one that does not fit fails. Where it cannot tell (one
batched forward pass for everyone), `step()` raises, and it must leave every request as it was
before the step (nothing advanced, no output lost): the scheduler then fails the newest request
and steps again without it.

An engine may also offer `step_parts()`: the same step as a generator that yields where it would
wait for the GPU (after launching its work, before reading the results back) and returns the step's
outputs. A thread stepping several engines on one GPU can then launch each engine's work before
waiting on any (`engines.overlap`, voiced.core.scheduler), so one engine's host work and wait overlap
the other's kernels; `step()` is `finish(step_parts())`, the very same code run straight through.

Nothing here is thread-safe on purpose: one owner thread means no locks in the hot loop, and it is
the same discipline TensorRT-LLM's executor needs (its `generate` steals responses across threads).
Engines never see gRPC or asyncio; the daemon never sees tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

SAMPLE_RATE = 16000  # both Whisper and BiCodec speak 16 kHz mono float32 in [-1, 1]
MIN_SPEED, MAX_SPEED = 0.25, 4.0  # TTSOptions.speed: the range OpenAI's speech endpoint and Realtime accept


class EngineError(Exception):
    """A request the engine cannot serve (bad options, out of cache space, ...).

    The message is shown to the caller, so it says what to change.
    """


class CapacityError(EngineError):
    """Not enough cache/batch capacity right now; the request may be retried or queued."""


class EngineFault(EngineError):
    """The engine failed while serving the request (a bug, a device fault), not because of what the
    request asked; the request is lost, the engine and the other requests go on."""


def is_out_of_memory(error: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError, or the RuntimeError older torch raises (without importing torch)."""
    return type(error).__name__ == "OutOfMemoryError" or (
        isinstance(error, RuntimeError) and "out of memory" in str(error).lower())


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
    fault: bool = False  # the error is an EngineFault: the engine failed, not the request


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
    # The probability Whisper gives end-of-text right after the text (how sure it is nothing more was
    # said): read off the word-timing pass, so None without word timings or where a backend lacks it.
    end_prob: float | None = None
    # The probability Whisper gives the text stopping right after the last word (a full stop, question or
    # exclamation mark, ellipsis or end-of-text next, rather than more words or a comma), from the same
    # pass: where it wrote a full stop after half a sentence it is often less sure of that stop than after
    # a whole one (voiced.core.turns).
    stop_prob: float | None = None


def hallucination_reason(t: Transcript, opts: ASROptions) -> str:
    """Which of the filters (ASROptions) judged `t` a hallucination, with its figures, for the caller and
    the log; the filters themselves run in the engines, this only names what they saw."""
    cr = opts.compression_ratio_threshold
    if cr is not None and t.compression_ratio > cr:
        return f"compression ratio {t.compression_ratio:.2f} over {cr:g}: the words repeat"
    ns, lp = opts.no_speech_threshold, opts.logprob_threshold
    if ns is not None and t.no_speech_prob > ns:
        unsure = f", average log-probability {t.avg_logprob:.2f} under {lp:g}" if lp is not None else ""
        return f"no-speech probability {t.no_speech_prob:.2f} over {ns:g}{unsure}: likely silence or noise"
    return "judged a hallucination by the engine's filters"


StepParts = Generator[None, None, list["EngineOutput"]]


def finish(parts: StepParts) -> list[EngineOutput]:
    """Run a step's parts (`step_parts`) straight through; its outputs."""
    while True:
        try:
            next(parts)
        except StopIteration as done:
            return done.value


def resumed_in(parts: StepParts, context: Callable[[], AbstractContextManager]) -> StepParts:
    """`parts`, with `context()` entered around each resume and left at each yield. An engine's CUDA
    stream and inference mode are thread state: held across a yield, they would be in force while
    another engine launches its work."""
    while True:
        with context():
            try:
                next(parts)
            except StopIteration as done:
                return done.value
        try:
            yield
        except GeneratorExit:
            with context():
                parts.close()
            raise


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
    languages: tuple[str, ...]  # ISO 639-1 codes the model transcribes (what front doors advertise)

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
    # Speaking rate, 0.25-4.0 (OpenAI's range): a Piper voice divides its length scale by it. Spark-TTS takes
    # a rate as its preset's speed label in the voice name (core.speech.resolve_voice) and reads nothing here.
    speed: float = 1.0
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
    languages: tuple[str, ...]  # languages the model speaks (ISO 639-1)

    def active_requests(self) -> int: ...


def fault_output(request_id: int, engine: str, error: BaseException) -> EngineOutput:
    """The error output for a request an engine fault was held to: out of memory is a capacity
    problem (retry later); anything else is an internal error (the message names it, never a traceback)."""
    if is_out_of_memory(error):
        return EngineOutput(request_id, error=f"the {engine} engine ran out of GPU memory for this request; "
                                              "retry later (or send less)", busy=True)
    return EngineOutput(request_id, error=f"internal error in the {engine} engine while serving this request "
                                          f"({type(error).__name__}: {error}); other requests go on", fault=True)
