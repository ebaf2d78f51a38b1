"""Whisper on TensorRT-LLM's C++ executor, behind the ASREngine contract (voiced/engines/base.py).

Per utterance:
  audio -> 30 s log-mel (the Whisper engine's audio.py) -> [3000, n_mels] tensor in the engine's dtype
  -> executor Request(input_token_ids=<SOT prompt>, encoder_input_features=mel,
     encoder_output_length=1500, end_id=pad_id=<|endoftext|>, beam_width, return_context_logits)
  -> tokens -> Transcript (text, avg_logprob, no_speech_prob, compression ratio, language).

These are the fields ``ModelRunnerCpp.generate`` fills for Whisper (tensorrt_llm/runtime/
model_runner_cpp.py; examples/models/core/whisper/run.py passes ``encoder_input_features=mel.T``,
``encoder_output_lengths=frames // 2``, ``end_id=pad_id=eot``), but we build the ``Request``
ourselves and route responses by id (executor.py) instead of calling ``generate``.

Language detection (``ASROptions.language=None``) is a first pass with the prompt ``[SOT]`` and one
output token; the context logits at SOT, restricted to the language tokens, give the language
probabilities (openai-whisper's ``detect_language``). The same logits in the transcription pass give
the no-speech probability. Both need the decoder built with ``--gather_context_logits`` (build.py
does).

Features go in the encoder engine's dtype (``pretrained_config.dtype``): the executor copies each
request's features into a buffer of that dtype and refuses another one ("Incompatible data types",
cpp/tensorrt_llm/batch_manager/encoderBuffers.cpp). build.py only builds float16 Whisper engines, as
TensorRT-LLM's Whisper example does; engines built elsewhere in bfloat16/float32 get their dtype.

Beam widths: the executor runs requests of one beam width at a time (it will not dequeue a request
whose beam width differs from the one operating while others are in flight, executorImpl.cpp). The
language-detection pass is greedy, so on an engine built with ``--max-beam-width`` > 1 a beam request
does not batch with greedy ones or with its own detection pass: greedy (``beam_size`` 1) is the
default and the fast path.

Not reproduced on this path: openai-whisper's logit filters (blank suppression at the first step,
the non-speech token list, timestamp rules) and temperature fallback; the executor's sampler has no
hook for them without a logits post-processor, which costs a device->host copy per step.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from voiced.engines.base import (
    SAMPLE_RATE,
    ASROptions,
    ASRRequest,
    EngineError,
    EngineOutput,
    Segment,
    Transcript,
)
from voiced.engines.trtllm.executor import ExecutorLike, ExecutorLoop, Flight
from voiced.memory_plan import MemoryPlan

log = logging.getLogger(__name__)

N_SAMPLES = 30 * SAMPLE_RATE  # the 30 s window official checkpoints need
N_FRAMES = 3000
ENCODER_POSITIONS = 1500  # conv2 has stride 2
TIME_PRECISION = 0.02  # seconds per timestamp token
FEATURE_DTYPES = ("float16", "bfloat16", "float32")  # what TensorRT-LLM's converter can build


# ------------------------------------------------------------------------- the integration point


@dataclass
class WhisperFrontend:
    """What the runner needs from the Whisper engine's host-side code (voiced/engines/whisper/).

    features(audio float32 @16 kHz, n_mels) -> [n_mels, 3000] log-mel of the 30 s window
      (``audio.window_features``)
    tokenizer: ``tokenizer.WhisperTokenizer`` (ids ``sot``, ``eot``, ``transcribe``, ``translate``,
      ``sot_prev``, ``no_speech``, ``no_timestamps``, ``timestamp_begin``, ``language_codes``,
      ``language_tokens``; ``encode``, ``decode``)
    """

    features: Callable[[np.ndarray, int], Any]
    tokenizer: Any


def load_frontend(multilingual: bool, num_languages: int, search_dirs: list[Path]) -> WhisperFrontend:
    """The one place that binds us to voiced/engines/whisper/ (audio.py, tokenizer.py).

    They are the PyTorch engine's, exact against openai-whisper; both backends use them so they see
    identical features and token ids.
    """
    from voiced.engines.whisper.audio import window_features
    from voiced.engines.whisper.checkpoint import tokenizer_search_dirs
    from voiced.engines.whisper.tokenizer import WhisperTokenizer

    dirs: list[Path] = []
    for d in search_dirs:
        for x in tokenizer_search_dirs(d):
            if x not in dirs:
                dirs.append(x)
    tok = WhisperTokenizer.load(multilingual, num_languages, dirs)
    return WhisperFrontend(features=lambda audio, n_mels: window_features(audio, n_mels), tokenizer=tok)


# ------------------------------------------------------------------------- engine limits


@dataclass(frozen=True)
class WhisperEngineLimits:
    """Read from the engines' config.json (written by trtllm-build: pretrained_config + build_config)."""

    n_mels: int
    num_languages: int
    vocab_size: int
    max_batch_size: int
    max_beam_width: int
    max_prompt_tokens: int
    max_seq_len: int
    context_logits: bool
    dtype: str = "float16"  # the encoder's, which its input features must match

    @property
    def multilingual(self) -> bool:
        return self.vocab_size >= 51865

    @classmethod
    def from_engine_dir(cls, engine_dir: Path) -> WhisperEngineLimits:
        enc = _read_config(engine_dir / "encoder" / "config.json")
        dec = _read_config(engine_dir / "decoder" / "config.json")
        ep, db = enc["pretrained_config"], dec["build_config"]
        return cls(
            dtype=str(ep.get("dtype", "float16")),
            n_mels=int(ep["n_mels"]),
            num_languages=int(ep.get("num_languages", 99)),
            vocab_size=int(dec["pretrained_config"]["vocab_size"]),
            max_batch_size=int(db["max_batch_size"]),
            max_beam_width=int(db.get("max_beam_width", 1)),
            max_prompt_tokens=int(db["max_input_len"]),
            max_seq_len=int(db["max_seq_len"]),
            context_logits=bool(db.get("gather_context_logits", False)),
        )


def _read_config(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineError(f"{path} is missing: not a Whisper engine folder (build it with `voiced engines build "
                          "whisper --model NAME`)") from None


# ------------------------------------------------------------------------- per-request state


@dataclass
class _Utterance:
    request: ASRRequest
    features: Any  # torch.Tensor [3000, n_mels], fp16, on the GPU
    language: str | None
    language_probs: dict[str, float] | None = None


class TrtllmWhisperEngine(ExecutorLoop):
    """ASREngine over a TensorRT-LLM encoder-decoder executor. One owner thread (see executor.py)."""

    backend = "trtllm"
    device = "cuda"

    def __init__(self, executor: ExecutorLike, tle: Any, limits: WhisperEngineLimits, frontend: WhisperFrontend,
                 *, model_name: str, device: str = "cuda", max_in_flight: int | None = None,
                 poll_timeout_s: float = 0.005) -> None:
        super().__init__(executor, max_in_flight=max_in_flight or limits.max_batch_size,
                         poll_timeout_s=poll_timeout_s)
        if limits.dtype not in FEATURE_DTYPES:
            raise EngineError(f"the Whisper encoder engine's dtype is {limits.dtype!r}; expected one of "
                              f"{', '.join(FEATURE_DTYPES)} (rebuild it with `voiced engines build whisper`)")
        self.tle = tle  # tensorrt_llm.bindings.executor (Request, SamplingConfig, OutputConfig)
        self.limits = limits
        self.frontend = frontend
        self.model_name = model_name
        self.device = device  # where the features tensor is made: the executor takes GPU tensors
        if limits.max_beam_width > 1:
            log.warning("this Whisper engine was built with max_beam_width %d: TensorRT-LLM's executor runs "
                        "one beam width at a time, so beam requests and greedy ones (the default, and every "
                        "language-detection pass) do not batch together; keep beam_size 1 for throughput",
                        limits.max_beam_width)
        tok = frontend.tokenizer
        self._lang_tokens = list(tok.language_tokens)
        self._lang_codes = list(tok.language_codes)

    @classmethod
    def load(cls, engine_dir: str | Path, plan: MemoryPlan, max_batch: int | None = None,
             **kw: Any) -> TrtllmWhisperEngine:
        """What voiced/engines/loader.py calls: ``TrtllmWhisperEngine.load(dir, plan=..., max_batch=...)``."""
        return load_whisper_engine(engine_dir, plan, max_batch_size=max_batch, **kw)

    @property
    def languages(self) -> tuple[str, ...]:
        return tuple(self._lang_codes) if self.limits.multilingual else ("en",)

    # ---------------------------------------------------------------- contract

    def submit(self, request_id: int, request: ASRRequest) -> None:  # type: ignore[override]
        opts = request.options
        if opts.beam_size > self.limits.max_beam_width:
            raise EngineError(f"beam_size {opts.beam_size} exceeds this engine's max_beam_width "
                              f"{self.limits.max_beam_width}; rebuild it with --max-beam-width {opts.beam_size}")
        if opts.task not in ("transcribe", "translate"):
            raise EngineError(f"task must be transcribe or translate, got {opts.task!r}")
        if opts.word_timestamps:
            # They need the decoder's cross-attention weights, which the TensorRT-LLM engine does not return.
            raise EngineError("word timestamps are not available from the TensorRT-LLM backend; "
                              "serve Whisper with asr.backend = \"torch\" to get them")
        language = opts.language
        if language is not None and self.limits.multilingual and language not in self._lang_codes:
            raise EngineError(f"unknown language {language!r}")
        if not self.limits.multilingual:
            language = "en"
        audio = np.asarray(request.audio, dtype=np.float32).reshape(-1)
        if audio.shape[0] > N_SAMPLES:
            raise EngineError(f"utterance is {audio.shape[0] / SAMPLE_RATE:.1f} s; Whisper takes at most 30 s")
        utt = _Utterance(request, self._features(audio), language)
        super().submit(request_id, utt, priority=opts.priority)
        if language is None:
            self._flights[request_id].phase = "detect"

    def transcribe(self, request: ASRRequest) -> Transcript:
        rid = -1
        while rid in self._flights:
            rid -= 1
        self.submit(rid, request)
        while True:
            for out in self.step():
                if out.request_id == rid and out.final:
                    if out.error:
                        raise EngineError(out.error)
                    return out.value

    # ---------------------------------------------------------------- requests

    def _features(self, audio: np.ndarray) -> Any:
        mel = np.asarray(_to_numpy(self.frontend.features(audio, self.limits.n_mels)), dtype=np.float32)
        if mel.shape != (self.limits.n_mels, N_FRAMES):
            raise EngineError(f"log-mel has shape {mel.shape}, expected ({self.limits.n_mels}, {N_FRAMES})")
        # The encoder engine takes [frames, n_mels] per request (run.py transposes before generate()).
        return _features_tensor(np.ascontiguousarray(mel.T), self.limits.dtype, self.device)

    def prompt(self, utt: _Utterance, phase: str) -> list[int]:
        tok = self.frontend.tokenizer
        if phase == "detect":
            return [tok.sot]
        opts = utt.request.options
        task = [tok.sot]
        if self.limits.multilingual:
            task.append(self._lang_tokens[self._lang_codes.index(utt.language)])
            task.append(tok.translate if opts.task == "translate" else tok.transcribe)
        if not opts.timestamps:
            task.append(tok.no_timestamps)
        prefix: list[int] = []
        if opts.initial_prompt:
            room = self.limits.max_prompt_tokens - len(task) - 1
            if room > 0:
                prefix = [tok.sot_prev] + tok.encode(" " + opts.initial_prompt.strip())[-room:]
        return prefix + task

    def make_request(self, flight: Flight) -> Any:
        utt: _Utterance = flight.payload
        tle = self.tle
        tok = self.frontend.tokenizer
        prompt = self.prompt(utt, flight.phase)
        flight.extra["prompt"] = prompt
        if len(prompt) > self.limits.max_prompt_tokens:
            raise EngineError(f"prompt of {len(prompt)} tokens exceeds the engine's {self.limits.max_prompt_tokens}")
        if flight.phase == "detect":
            max_tokens, beams = 1, 1
        else:
            wanted = utt.request.options.max_new_tokens or 224  # openai-whisper: half the 448 text context
            max_tokens = max(1, min(wanted, self.limits.max_seq_len - len(prompt)))
            beams = utt.request.options.beam_size
        return tle.Request(
            input_token_ids=prompt,
            max_tokens=max_tokens,
            streaming=False,
            sampling_config=tle.SamplingConfig(beams),
            output_config=tle.OutputConfig(
                return_log_probs=True,
                return_context_logits=self.limits.context_logits,
                exclude_input_from_output=True,
            ),
            end_id=tok.eot,
            pad_id=tok.eot,
            encoder_input_features=utt.features,
            encoder_output_length=ENCODER_POSITIONS,
        )

    # ---------------------------------------------------------------- results

    def on_result(self, flight: Flight, result: Any) -> list[EngineOutput] | None:
        if not result.is_final:
            return []  # non-streaming requests answer once; ignore anything partial
        utt: _Utterance = flight.payload
        if flight.phase == "detect":
            probs = self._language_probs(result, sot_index=0)
            if probs is None:
                # No context logits: take the language token the model emitted after SOT.
                tokens = list(result.output_token_ids[0])
                code = self._lang_codes[self._lang_tokens.index(tokens[0])] if tokens and \
                    tokens[0] in self._lang_tokens else "en"
                probs = {code: 1.0}
            utt.language_probs = probs
            utt.language = max(probs, key=probs.get)
            flight.phase = "transcribe"
            return None  # enqueue the transcription pass
        return [EngineOutput(flight.request_id, self._transcript(flight, result), final=True)]

    def _language_probs(self, result: Any, sot_index: int) -> dict[str, float] | None:
        logits = _context_row(result, sot_index)
        if logits is None or not self.limits.multilingual:
            return None
        lang = logits[self._lang_tokens]
        p = np.exp(lang - lang.max())
        p /= p.sum()
        return {code: float(v) for code, v in zip(self._lang_codes, p)}

    def _transcript(self, flight: Flight, result: Any) -> Transcript:
        utt: _Utterance = flight.payload
        opts = utt.request.options
        tok = self.frontend.tokenizer
        tokens = [int(t) for t in result.output_token_ids[0]]
        while tokens and tokens[-1] == tok.eot:
            tokens.pop()
        if tok.eot in tokens:
            tokens = tokens[: tokens.index(tok.eot)]
        prompt = flight.extra.get("prompt", [])
        sot_index = prompt.index(tok.sot) if tok.sot in prompt else 0
        no_speech_prob = 0.0
        row = _context_row(result, sot_index)
        if row is not None:
            z = row - row.max()
            no_speech_prob = float(np.exp(z[tok.no_speech]) / np.exp(z).sum())
        cum = getattr(result, "cum_log_probs", None)
        sum_logprob = float(cum[0]) if cum else 0.0
        avg_logprob = sum_logprob / (len(tokens) + 1)  # openai-whisper counts the end token too
        text_tokens = [t for t in tokens if t < tok.eot]
        text = tok.decode(text_tokens).strip()
        ratio = compression_ratio(text)
        segments = split_segments(tokens, tok) if opts.timestamps else []
        return Transcript(
            text=text,
            language=utt.language or "en",
            tokens=tokens,
            avg_logprob=avg_logprob,
            no_speech_prob=no_speech_prob,
            compression_ratio=ratio,
            is_hallucination=is_hallucination(opts, avg_logprob, no_speech_prob, ratio),
            segments=segments,
            language_probs=utt.language_probs,
        )


# ------------------------------------------------------------------------- helpers


def compression_ratio(text: str) -> float:
    """openai-whisper's gzip ratio: highly repetitive (looping) output compresses well."""
    data = text.encode("utf-8")
    if not data:
        return 0.0
    return len(data) / len(zlib.compress(data))


def is_hallucination(opts: ASROptions, avg_logprob: float, no_speech_prob: float, ratio: float) -> bool:
    """The filters of openai-whisper's transcribe(), with the thresholds from ASROptions."""
    if opts.compression_ratio_threshold is not None and ratio > opts.compression_ratio_threshold:
        return True
    # Silence: the model thinks nobody spoke *and* is unsure of its text (openai-whisper's rule).
    silent = opts.no_speech_threshold is not None and no_speech_prob > opts.no_speech_threshold
    unsure = opts.logprob_threshold is None or avg_logprob < opts.logprob_threshold
    return silent and unsure


def split_segments(tokens: list[int], tok: Any) -> list[Segment]:
    """Cut a timestamped token sequence at <|t0|> text <|t1|> pairs."""
    begin = tok.timestamp_begin
    segments: list[Segment] = []
    start: float | None = None
    text_tokens: list[int] = []
    for t in tokens:
        if t >= begin:
            ts = (t - begin) * TIME_PRECISION
            if start is None:
                start = ts
            else:
                if text_tokens:
                    segments.append(Segment(start, ts, tok.decode(text_tokens).strip(), text_tokens))
                start, text_tokens = None, []
        elif t < tok.eot:
            text_tokens.append(t)
    if text_tokens:  # text after the last timestamp: closes at the end of the window
        segments.append(Segment(start or 0.0, 30.0, tok.decode(text_tokens).strip(), text_tokens))
    return segments


def _context_row(result: Any, index: int) -> np.ndarray | None:
    logits = getattr(result, "context_logits", None)
    if logits is None:
        return None
    arr = _to_numpy(logits).astype(np.float32)
    arr = arr.reshape(-1, arr.shape[-1])  # [prompt_len, vocab] (a leading beam/batch 1 is dropped)
    if index >= arr.shape[0]:
        return None
    return arr[index]


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    return np.asarray(x)


def _features_tensor(a: np.ndarray, dtype: str, device: str) -> Any:
    import torch

    return torch.from_numpy(a).to(device=device, dtype=getattr(torch, dtype)).contiguous()


# ------------------------------------------------------------------------- loading


def load_whisper_engine(engine_dir: str | Path, plan: MemoryPlan, *, load_order: tuple[str, ...] = ("whisper", "tts"),
                        max_batch_size: int | None = None, model_name: str | None = None) -> TrtllmWhisperEngine:
    """Open engines/<name>/ (encoder/ + decoder/) on the GPU with the memory plan's fractions.

    ``ModelRunnerCpp.from_dir(engine_dir, is_enc_dec=True, max_batch_size, max_input_len=3000,
    max_beam_width, kv_cache_free_gpu_memory_fraction, cross_kv_cache_fraction)`` (signature of
    tensorrt_llm/runtime/model_runner_cpp.py, 0.17 - 1.2) builds the executor config from the
    engine's JSON for us; we keep only its ``executor`` and never call ``generate``.
    """
    from voiced.engines.trtllm import versions

    info = versions.detect()
    if not info.installed:
        raise EngineError(versions.missing_message("the TensorRT-LLM Whisper engine"))
    if not info.engine_path:
        raise EngineError(
            f"TensorRT-LLM {info.version} has no TensorRT engine runtime (removed in the newest releases); "
            f"use a release in {versions.ENGINE_PATH_RELEASES} (our Dockerfile pins one) or --backend torch"
        )
    import tensorrt_llm.bindings.executor as tle
    from tensorrt_llm.runtime import ModelRunnerCpp

    from voiced.engines.trtllm.manifest import Manifest

    engine_dir = Path(engine_dir)
    limits = WhisperEngineLimits.from_engine_dir(engine_dir)
    if max_batch_size is not None and max_batch_size > limits.max_batch_size:
        log.warning("max batch %d exceeds the engine's %d; using %d (rebuild with --max-batch-size)",
                    max_batch_size, limits.max_batch_size, limits.max_batch_size)
        max_batch_size = limits.max_batch_size
    if not limits.context_logits:
        log.warning("%s was built without --gather_context_logits: no_speech_prob is 0 and language "
                    "detection uses the first emitted token", engine_dir)
    plan.validate()
    fraction = plan.executor_fractions(load_order)["whisper"]
    runner = ModelRunnerCpp.from_dir(
        engine_dir=str(engine_dir),
        is_enc_dec=True,
        max_batch_size=max_batch_size or limits.max_batch_size,
        max_input_len=N_FRAMES,
        max_beam_width=limits.max_beam_width,
        kv_cache_free_gpu_memory_fraction=fraction,
        cross_kv_cache_fraction=plan.whisper_cross_kv_fraction,
    )
    frontend = load_frontend(limits.multilingual, limits.num_languages, [engine_dir])
    manifest = Manifest.read(engine_dir)
    name = model_name or (manifest.model if manifest else engine_dir.name)
    log.info("TensorRT-LLM Whisper %s loaded from %s (KV fraction %.3f, cross %.2f)", name, engine_dir,
             fraction, plan.whisper_cross_kv_fraction)
    return TrtllmWhisperEngine(runner.executor, tle, limits, frontend, model_name=name,
                               max_in_flight=max_batch_size or limits.max_batch_size)

