"""PiperEngine: speech on the CPU with Piper voices, a stepped TTS engine (see engines/base.py).

A request's text is cut into pieces (PiperVoice.units: the first sentence clause by clause, then whole
sentences); each piece's prior is made in one run of the voice's encoder, and its latents and audio window
by window (PiperVoice.stream, graph.py), resampled from the voice's rate (22,050 Hz) to the engine contract's
16 kHz by one streaming resampler per request, so the chunks join as the whole would. Each chunk is one
AudioChunk: the first leaves once the first clause's prior and its first 0.19 s are made.

The graph runs on one synthesis thread of the engine's own, one piece at a time, with the voice's
`threads` onnxruntime threads: the engine thread that steps this engine (shared with recognition on a
CPU) never waits on a piece for more than POLL_S, and the CPU the voice takes is bounded. Which
request's piece runs next: requests with no audio out yet first (highest priority, then oldest), then
the request with the least audio ahead of real time.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from voiced.audio.ingest import Resampler
from voiced.engines.base import (
    MAX_SPEED,
    MIN_SPEED,
    SAMPLE_RATE,
    AudioChunk,
    EngineError,
    EngineOutput,
    TTSOptions,
    TTSRequest,
    fault_output,
)

from . import registry
from .voice import PiperVoice
from .voices import ATTRIBUTION, PiperVoices, language_codes

log = logging.getLogger(__name__)

POLL_S = 0.01  # the longest a step waits for the piece being synthesized (the engine thread's other engines go on)
WARMUP_TEXT = "Hello, this is a test."


@dataclass
class _Request:
    id: int
    text: str
    voice: PiperVoice
    priority: int
    arrival: int
    budget: int  # samples at SAMPLE_RATE (TTSOptions.max_seconds)
    resample: Resampler
    length_scale: float  # the voice's own, divided by TTSOptions.speed
    units: list[list[int]] | None = None  # pieces still to synthesize; None until the text is phonemized
    chunks: Iterator[tuple[np.ndarray, bool]] | None = None  # the piece being decoded (PiperVoice.stream)
    sequence: int = 0
    offset: int = 0
    first_at: float | None = None
    done: bool = False
    history: list[float] = field(default_factory=list)  # seconds each piece took (benchmarks)

    def ahead_s(self, now: float) -> float:
        """Audio sent beyond what has played since the first chunk left."""
        return self.offset / SAMPLE_RATE - (now - self.first_at) if self.first_at is not None else 0.0


class PiperEngine:
    """Piper voices with onnxruntime on the CPU. Build with `PiperEngine.load(...)`; drive from one thread."""

    backend = "onnxruntime"
    device = "cpu"
    memory_need = None  # nothing on a GPU
    attribution = ATTRIBUTION

    def __init__(self, voices: PiperVoices) -> None:
        self.voices = voices
        self.model_name = registry.PREFIX + voices.default_name
        self.languages = language_codes(voices.list()) or ("en",)
        self._requests: dict[int, _Request] = {}
        self._arrival = itertools.count()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="piper")
        self._job: tuple[_Request, Future] | None = None

    @classmethod
    def load(cls, model: str | Path = registry.PYPI_NAME, threads: int = 1, root: Path | None = None,
             espeak_data: str | Path | None = None) -> PiperEngine:
        """The engine speaking with `model` (a voice name, `piper:<voice>`, `piper-joe-pypi`, or a `.onnx` file)
        by default, and with every other voice in the cache on request; `threads` onnxruntime threads a voice."""
        voice = PiperVoice.load(registry.resolve(model, root), threads, espeak_data)
        return cls(PiperVoices(voice, threads, root, espeak_data))

    def warmup(self) -> None:
        """One sentence streamed through the default voice: onnxruntime plans its kernels on the first run
        (~3x the time of a later one) and the voice's gain is set, neither then on a caller's time."""
        voice = self.voices.voice(None)
        for ids in voice.units(WARMUP_TEXT):
            for _ in voice.stream(ids):
                pass

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------- the contract

    def submit(self, request_id: int, request: TTSRequest) -> None:
        opts = request.options or TTSOptions()
        if not request.text.strip():
            raise EngineError("the text is empty; send something to say")
        if not MIN_SPEED <= opts.speed <= MAX_SPEED:  # NaN too
            raise EngineError(f"speed {opts.speed} is outside {MIN_SPEED:g}..{MAX_SPEED:g}; 1 is the voice's own pace, "
                              "2 twice as fast")
        voice = self.voices.voice(opts.voice)
        self._requests[request_id] = _Request(
            request_id, request.text, voice, opts.priority, next(self._arrival), int(opts.max_seconds * SAMPLE_RATE),
            Resampler(voice.config.sample_rate, SAMPLE_RATE), voice.config.length_scale / opts.speed)

    def cancel(self, request_id: int) -> None:
        r = self._requests.pop(request_id, None)
        if r is not None:
            r.done = True  # a piece being synthesized for it is dropped when it comes back

    def has_work(self) -> bool:
        return bool(self._requests) or self._job is not None

    def active_requests(self) -> int:
        return len(self._requests)

    def step(self) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        if self._job is not None:
            r, job = self._job
            if not job.done():
                wait_for([job], timeout=POLL_S)
            if job.done():
                self._job = None
                if not r.done:
                    outputs.append(self._output(r, job))
        if self._job is None:
            self._start_next()
        return outputs

    # ------------------------------------------------------------------------------- inside

    def _start_next(self) -> None:
        waiting = [r for r in self._requests.values() if not r.done]
        if not waiting:
            return
        fresh = [r for r in waiting if r.first_at is None]
        if fresh:
            r = min(fresh, key=lambda r: (-r.priority, r.arrival))
        else:
            now = time.monotonic()
            r = min(waiting, key=lambda r: (r.ahead_s(now), r.arrival))
        self._job = (r, self._pool.submit(_synthesize_next, r))

    def _output(self, r: _Request, job: Future) -> EngineOutput:
        try:
            samples, last = job.result()
        except EngineError as e:
            self._requests.pop(r.id, None)
            return EngineOutput(r.id, error=str(e))
        except Exception as e:  # a fault in one request's piece fails that request, not the engine
            log.exception("piper: synthesis failed for request %d", r.id)
            self._requests.pop(r.id, None)
            return fault_output(r.id, "Piper", e)
        if r.offset + len(samples) >= r.budget:
            samples, last = samples[: max(0, r.budget - r.offset)], True
        chunk = AudioChunk(np.ascontiguousarray(samples, dtype=np.float32), r.sequence, r.offset, last)
        if r.first_at is None:
            r.first_at = time.monotonic()
        r.sequence += 1
        r.offset += len(samples)
        if last:
            r.done = True
            self._requests.pop(r.id, None)
        return EngineOutput(r.id, chunk, final=last)

    # ------------------------------------------------------------------------------- one-shot

    def synthesize(self, text: str, options: TTSOptions | None = None) -> np.ndarray:
        """The whole of `text` at SAMPLE_RATE, through the same steps a caller's request takes."""
        self.submit(-1, TTSRequest(text, options or TTSOptions()))
        pieces = []
        while self.has_work():
            for out in self.step():
                if out.error:
                    raise EngineError(out.error)
                pieces.append(out.value.samples)
        return np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def _synthesize_next(r: _Request) -> tuple[np.ndarray, bool]:
    """The request's next chunk at SAMPLE_RATE and whether it is its last (on the synthesis thread); the text
    is phonemized first, and each piece's latents are made with its first chunk."""
    t0 = time.perf_counter()
    if r.units is None:
        r.units = r.voice.units(r.text)
    if r.chunks is None:
        if not r.units:
            return r.resample(np.zeros(0, np.float32), last=True), True
        r.chunks = r.voice.stream(r.units.pop(0), length_scale=r.length_scale)
    audio, piece_done = next(r.chunks)
    if piece_done:
        r.chunks = None
    last = piece_done and not r.units
    out = r.resample(audio, last=last)
    r.history.append(time.perf_counter() - t0)
    return out, last
