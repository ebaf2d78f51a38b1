"""The Spark-TTS LM on TensorRT-LLM's executor, streaming semantic tokens to the PyTorch vocoder.

Two layers:

- ``TRTLLMSparkLM``: a stepped engine over a decoder-only executor. ``submit(id, SparkLMRequest)``
  enqueues a *streaming* request (``Request(streaming=True)``; each response carries the tokens new
  since the last one, tensorrt_llm/runtime/model_runner_cpp.py ``_stream``); ``step()`` yields
  ``SemanticDelta``s: new global tokens (controllable voices emit 32 of them first) and new semantic
  tokens, split by id range (DESIGN §6: globals 151665+i, semantics 155761+i, EOS <|im_end|> 151645).
- ``TrtllmSparkEngine``: the TTSEngine the daemon schedules. It gets prompts and the BiCodec
  vocoder from the Spark-TTS engine's host code (voiced/engines/spark/, PyTorch) through
  ``SparkFrontend`` and turns deltas into ``AudioChunk``s.

``load_spark_frontend`` is the single function that binds us to voiced/engines/spark/.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from voiced.engines.base import AudioChunk, EngineError, EngineOutput, TTSOptions, TTSRequest
from voiced.engines.spark.frontend import TOKENS_PER_SECOND, SparkLMRequest
from voiced.engines.spark.voices import LANGUAGES
from voiced.engines.trtllm.executor import ExecutorLike, ExecutorLoop, Flight
from voiced.memory_plan import MemoryPlan

log = logging.getLogger(__name__)

N_GLOBAL_TOKENS = 32
# A cloned voice's prompt besides its transcript, text and reference semantic tokens (DESIGN §6):
# <|task_tts|> <|start_content|> <|end_content|> <|start_global_token|> 32 globals
# <|end_global_token|> <|start_semantic_token|>.
CLONED_PROMPT_OVERHEAD = N_GLOBAL_TOKENS + 6
# What a registered voice must leave of the engine's prompt budget for the text to speak: a sentence.
MIN_TEXT_TOKENS = 32
REBUILD_HINT = "a larger budget: `voiced engines build spark-tts --max-input-len N --max-seq-len M` (docs/TRTLLM.md)"


@dataclass(frozen=True)
class SparkTokenLayout:
    """Where the BiCodec tokens sit in the LM's vocabulary."""

    global_base: int = 151665
    n_global: int = 4096
    semantic_base: int = 155761
    n_semantic: int = 8192
    eos: int = 151645  # <|im_end|>
    pad: int = 151643  # <|endoftext|>

    @classmethod
    def from_added_tokens(cls, path: str | Path) -> SparkTokenLayout:
        """Check the defaults against the checkpoint's added_tokens.json (DESIGN: check when loading)."""
        table = json.loads(Path(path).read_text())
        layout = cls()
        expect = {
            "<|bicodec_global_0|>": layout.global_base,
            f"<|bicodec_global_{layout.n_global - 1}|>": layout.global_base + layout.n_global - 1,
            "<|bicodec_semantic_0|>": layout.semantic_base,
            f"<|bicodec_semantic_{layout.n_semantic - 1}|>": layout.semantic_base + layout.n_semantic - 1,
            "<|im_end|>": layout.eos,
        }
        wrong = {k: (v, table.get(k)) for k, v in expect.items() if table.get(k) != v}
        if wrong:
            detail = ", ".join(f"{k}: expected {v}, found {got}" for k, (v, got) in wrong.items())
            raise EngineError(f"{path} does not match Spark-TTS-0.5B's token layout ({detail})")
        return layout

    def split(self, ids: Sequence[int]) -> tuple[list[int], list[int], bool]:
        """(global indices, semantic indices, saw EOS) for a run of generated ids."""
        globals_, semantics = [], []
        eos = False
        for t in ids:
            t = int(t)
            if t == self.eos:
                eos = True
                break
            if self.semantic_base <= t < self.semantic_base + self.n_semantic:
                semantics.append(t - self.semantic_base)
            elif self.global_base <= t < self.global_base + self.n_global:
                globals_.append(t - self.global_base)
            # anything else (stray text tokens, <|end_global_token|>, ...) carries no audio
        return globals_, semantics, eos


@dataclass
class SemanticDelta:
    """New tokens of one request since the previous delta (indices, not vocabulary ids)."""

    global_ids: list[int]
    semantic_ids: list[int]
    total_semantic: int
    done: bool
    finish: str = ""  # "eos" | "length" | "cap" when done


@dataclass
class _LMState:
    request: SparkLMRequest
    semantic_count: int = 0


class TRTLLMSparkLM(ExecutorLoop):
    """Streaming semantic-token generation over a TensorRT-LLM decoder-only executor."""

    def __init__(self, executor: ExecutorLike, tle: Any, *, max_batch_size: int, max_seq_len: int,
                 max_input_len: int | None = None, layout: SparkTokenLayout | None = None,
                 poll_timeout_s: float = 0.005) -> None:
        """`max_input_len` / `max_seq_len`: the engine's build_config. The executor refuses a prompt over
        max_input_len (LlmRequest::validate); None leaves only max_seq_len to bound it."""
        super().__init__(executor, max_in_flight=max_batch_size, poll_timeout_s=poll_timeout_s)
        self.tle = tle
        self.max_seq_len = max_seq_len
        # At least one token must remain to generate.
        self.max_input_len = min(max_input_len or max_seq_len, max_seq_len - 1)
        self.layout = layout or SparkTokenLayout()

    def submit(self, request_id: int, request: SparkLMRequest) -> None:  # type: ignore[override]
        if not request.prompt_ids:
            raise EngineError("empty prompt")
        n = len(request.prompt_ids)
        if n > self.max_input_len:
            # Refused here rather than by the executor, whose message names no remedy.
            raise EngineError(
                f"the prompt is {n} tokens, over this TensorRT-LLM engine's max_input_len {self.max_input_len} "
                f"(a cloned voice's reference clip takes {TOKENS_PER_SECOND} tokens a second of it, the text the "
                "rest): use a shorter reference clip or text, or rebuild the engine with "
                f"{REBUILD_HINT}")
        super().submit(request_id, _LMState(request), priority=request.priority)

    def make_request(self, flight: Flight) -> Any:
        st: _LMState = flight.payload
        r = st.request
        tle = self.tle
        max_tokens = max(1, min(r.max_new_tokens, self.max_seq_len - len(r.prompt_ids)))
        sampling = tle.SamplingConfig(1, top_k=r.top_k, top_p=r.top_p, temperature=r.temperature, seed=r.seed)
        return tle.Request(
            input_token_ids=list(r.prompt_ids),
            max_tokens=max_tokens,
            streaming=True,
            sampling_config=sampling,
            output_config=tle.OutputConfig(exclude_input_from_output=True),
            end_id=self.layout.eos,
            pad_id=self.layout.pad,
        )

    def on_result(self, flight: Flight, result: Any) -> list[EngineOutput]:
        st: _LMState = flight.payload
        # Streaming responses carry only the new tokens of beam 0.
        new = list(result.output_token_ids[0]) if result.output_token_ids else []
        g, s, eos = self.layout.split(new)
        cap = st.request.max_semantic_tokens
        room = len(s) if cap is None else max(0, cap - st.semantic_count)
        capped = len(s) > room
        s = s[:room]
        st.semantic_count += len(s)
        done = bool(result.is_final) or eos or capped
        finish = ""
        if done:
            finish = "eos" if eos else ("cap" if capped else "length")
        delta = SemanticDelta(g, s, st.semantic_count, done, finish)
        return [EngineOutput(flight.request_id, delta, final=done)]


# ------------------------------------------------------------------------- the TTS engine


class VocoderStream(Protocol):
    """One request's incremental BiCodec decode (voiced/engines/spark/, PyTorch)."""

    def push(self, semantic_ids: Sequence[int], global_ids: Sequence[int]) -> list[np.ndarray]: ...

    def finish(self) -> list[np.ndarray]: ...


class SparkFrontend(Protocol):
    """What the Spark-TTS engine's host code provides to this runner."""

    sample_rate: int
    voices: Any  # voiced.engines.spark.voices.VoiceStore: list / add / delete / resolve

    def lm_request(self, request: TTSRequest) -> SparkLMRequest: ...

    def open_stream(self, request: TTSRequest) -> VocoderStream: ...


def load_spark_frontend(model: str | Path, device: str = "cuda", voices_dir: str | None = None) -> SparkFrontend:
    """The one place that binds us to voiced/engines/spark/ (prompt building, BiCodec, streaming).

    It expects ``voiced.engines.spark.frontend.SparkFrontend.load(model, device=, voices_dir=)``
    providing ``lm_request`` and ``open_stream`` as typed above; the Spark-TTS engine owns that code
    (voices, prompts, the BiCodec decode windows), we only feed it tokens.
    """
    from voiced.engines.spark.frontend import SparkFrontend as _Frontend

    return _Frontend.load(model, device=device, voices_dir=voices_dir)


@dataclass
class _Speech:
    request: TTSRequest
    stream: VocoderStream
    sequence: int = 0
    offset: int = 0
    tokens: int = 0
    pending: list[np.ndarray] = field(default_factory=list)


class CheckedVoices:
    """The front end's voice store, refusing at registration a cloned voice too long for this engine.

    Every prompt of a cloned voice carries its reference clip's semantic tokens (TOKENS_PER_SECOND a
    second) and its transcript, and the executor refuses prompts over the engine's max_input_len: a
    clip too long for the engine would fail every request that used it. The daemon's AddVoice maps
    the EngineError raised here to INVALID_ARGUMENT.
    """

    def __init__(self, store: Any, frontend: SparkFrontend, max_input_len: int) -> None:
        self._store = store
        self._frontend = frontend
        self.max_input_len = max_input_len

    def __getattr__(self, name: str) -> Any:  # list, delete, resolve, ...: the store's own
        return getattr(self._store, name)

    def add(self, name: str, audio: np.ndarray, transcript: str) -> Any:
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        seconds = audio.shape[0] / self._frontend.sample_rate
        budget = self.max_input_len - MIN_TEXT_TOKENS
        # Before any work is done or stored: a lower bound from the clip's length alone (its semantic
        # tokens come one per 20 ms frame of a 25 ms window), which catches the usual case.
        per_token = self._frontend.sample_rate // TOKENS_PER_SECOND
        at_least = CLONED_PROMPT_OVERHEAD + max(0, audio.shape[0] // per_token - 1)
        if at_least > budget:
            raise self._refusal(f"the reference clip is {seconds:.1f} s: its tokens alone make a prompt of at "
                                f"least {at_least} tokens", shorter=f"a clip of at most about "
                                f"{(budget - CLONED_PROMPT_OVERHEAD) / TOKENS_PER_SECOND:.0f} s")
        info = self._store.add(name, audio, transcript)
        # Exactly, now that the clip is tokenized: the prompt of a one-token text in this voice.
        used = len(self._frontend.lm_request(TTSRequest("a", TTSOptions(voice=name))).prompt_ids) - 1
        if used > budget:
            self._store.delete(name)
            raise self._refusal(f"the reference clip ({seconds:.1f} s) and its transcript make a prompt of "
                                f"{used} tokens", shorter="a shorter clip or transcript")
        return info

    def _refusal(self, what: str, shorter: str) -> EngineError:
        return EngineError(f"{what}, and this TensorRT-LLM engine's max_input_len {self.max_input_len} must also "
                           f"hold the text ({MIN_TEXT_TOKENS} tokens kept for it). Give {shorter}, or rebuild the "
                           f"engine with {REBUILD_HINT}")


class TrtllmSparkEngine:
    """TTSEngine: LM on TensorRT-LLM, vocoder in PyTorch, both stepped by the owner thread."""

    backend = "trtllm"
    device = "cuda"
    languages = LANGUAGES

    def __init__(self, lm: TRTLLMSparkLM, frontend: SparkFrontend, *, model_name: str = "Spark-TTS-0.5B") -> None:
        self.lm = lm
        self.frontend = frontend
        self.model_name = model_name
        self._speech: dict[int, _Speech] = {}
        # What the daemon lists and registers voices through (services.voices).
        self.voices = CheckedVoices(frontend.voices, frontend, lm.max_input_len)

    @classmethod
    def load(cls, engine_dir: str | Path, model: str | Path, plan: MemoryPlan, device: str = "cuda",
             dtype: str | None = None, max_batch: int | None = None, voices_dir: str | None = None,
             kv_cache_bytes: int | None = None) -> TrtllmSparkEngine:
        """What voiced/engines/loader.py calls. `dtype` and `kv_cache_bytes` belong to the PyTorch
        backend: the engine's precision is fixed at build time and its KV pool comes from `plan`."""
        if dtype:
            log.info("dtype %s ignored: a TensorRT-LLM engine's precision is set when it is built", dtype)
        return load_spark_tts_engine(engine_dir, model, plan, device=device, max_batch=max_batch,
                                     voices_dir=voices_dir)

    def submit(self, request_id: int, request: TTSRequest) -> None:
        lm_req = self.frontend.lm_request(request)
        # Cap the LM at the request's audio budget (50 semantic tokens per second).
        cap = int(request.options.max_seconds * TOKENS_PER_SECOND)
        lm_req.max_semantic_tokens = cap if lm_req.max_semantic_tokens is None else min(cap, lm_req.max_semantic_tokens)
        budget = cap + N_GLOBAL_TOKENS + 2  # globals, the semantic cap, and room for <|im_end|>
        lm_req.max_new_tokens = min(lm_req.max_new_tokens, budget) if lm_req.max_new_tokens else budget
        self.lm.submit(request_id, lm_req)
        self._speech[request_id] = _Speech(request, self.frontend.open_stream(request))

    def cancel(self, request_id: int) -> None:
        self.lm.cancel(request_id)
        self._speech.pop(request_id, None)

    def has_work(self) -> bool:
        return self.lm.has_work() or bool(self._speech)

    def active_requests(self) -> int:
        return len(self._speech)

    def step(self) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        for out in self.lm.step():
            sp = self._speech.get(out.request_id)
            if sp is None:
                continue
            if out.error:
                self._speech.pop(out.request_id, None)
                outputs.append(out)
                continue
            delta: SemanticDelta = out.value
            try:
                chunks = sp.stream.push(delta.semantic_ids, delta.global_ids)
                if delta.done:
                    chunks += sp.stream.finish()
            except Exception as e:
                log.exception("vocoder failed for request %s", out.request_id)
                if not delta.done:
                    self.lm.cancel(out.request_id)
                self._speech.pop(out.request_id, None)
                outputs.append(EngineOutput(out.request_id, None, final=True, error=f"vocoder failed: {e}"))
                continue
            sp.tokens = delta.total_semantic
            outputs.extend(self._emit(out.request_id, sp, chunks, last=delta.done))
            if delta.done:
                self._speech.pop(out.request_id, None)
        return outputs

    def _emit(self, rid: int, sp: _Speech, chunks: list[np.ndarray], last: bool) -> list[EngineOutput]:
        chunks = [np.asarray(c, dtype=np.float32).reshape(-1) for c in chunks if c is not None]
        chunks = [c for c in chunks if c.size] or ([np.zeros(0, np.float32)] if last else [])
        outs = []
        for i, c in enumerate(chunks):
            is_last = last and i == len(chunks) - 1
            outs.append(EngineOutput(rid, AudioChunk(c, sp.sequence, sp.offset, is_last, sp.tokens), final=is_last))
            sp.sequence += 1
            sp.offset += c.shape[0]
        return outs

    def shutdown(self) -> None:
        self.lm.shutdown()


def load_spark_lm(engine_dir: str | Path, plan: MemoryPlan, *, load_order: tuple[str, ...] = ("whisper", "tts"),
                  max_batch_size: int | None = None, layout: SparkTokenLayout | None = None) -> TRTLLMSparkLM:
    """Open engines/<name>/llm on the GPU with the plan's TTS fraction.

    ``ModelRunnerCpp.from_dir(engine_dir, max_batch_size=..., kv_cache_free_gpu_memory_fraction=...)``
    (tensorrt_llm/runtime/model_runner_cpp.py, 0.17 - 1.2); only its ``executor`` is kept.
    """
    from voiced.engines.trtllm import versions

    info = versions.detect()
    if not info.installed:
        raise EngineError(versions.missing_message("the TensorRT-LLM Spark-TTS engine"))
    if not info.engine_path:
        raise EngineError(f"TensorRT-LLM {info.version} has no TensorRT engine runtime; use a release in "
                          f"{versions.ENGINE_PATH_RELEASES} or --backend torch")
    import tensorrt_llm.bindings.executor as tle
    from tensorrt_llm.runtime import ModelRunnerCpp

    llm_dir = Path(engine_dir) / "llm"
    try:
        build_cfg = json.loads((llm_dir / "config.json").read_text())["build_config"]
    except FileNotFoundError:
        raise EngineError(f"{llm_dir} has no config.json; build it with `voiced engines build spark-tts`") from None
    plan.validate()
    fraction = plan.executor_fractions(load_order)["tts"]
    bs = max_batch_size or int(build_cfg["max_batch_size"])
    runner = ModelRunnerCpp.from_dir(engine_dir=str(llm_dir), max_batch_size=bs,
                                     kv_cache_free_gpu_memory_fraction=fraction)
    return TRTLLMSparkLM(runner.executor, tle, max_batch_size=bs, max_seq_len=int(build_cfg["max_seq_len"]),
                         max_input_len=int(build_cfg["max_input_len"]), layout=layout)


def load_spark_tts_engine(engine_dir: str | Path, model: str | Path, plan: MemoryPlan, *, device: str = "cuda",
                          max_batch: int | None = None, voices_dir: str | None = None,
                          load_order: tuple[str, ...] = ("whisper", "tts")) -> TrtllmSparkEngine:
    """LM engine from engines/<name>/, prompts and vocoder from the Spark-TTS checkpoint `model`."""
    from voiced.engines.spark import checkpoint as spark_ckpt

    ckpt = spark_ckpt.resolve(model)
    added = ckpt.llm_dir / "added_tokens.json"
    layout = SparkTokenLayout.from_added_tokens(added) if added.is_file() else SparkTokenLayout()
    lm = load_spark_lm(engine_dir, plan, load_order=load_order, max_batch_size=max_batch, layout=layout)
    return TrtllmSparkEngine(lm, load_spark_frontend(model, device=device, voices_dir=voices_dir),
                             model_name=Path(str(model)).name)
