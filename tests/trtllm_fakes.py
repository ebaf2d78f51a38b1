"""An in-test stand-in for TensorRT-LLM's executor *interface* (the external library).

It implements the documented Python binding surface we call, with the same keyword names, taken
from TensorRT-LLM's cpp/tensorrt_llm/pybind/executor/{executor,request}.cpp:

    Executor.enqueue_request(request) -> int
    Executor.await_responses(timeout: datetime.timedelta | None) -> list[Response]
    Executor.cancel_request(id)             (a final CANCELLED response follows)
    Executor.shutdown()
    Request(input_token_ids, max_tokens, *, streaming, sampling_config, output_config, end_id, pad_id,
            encoder_input_features, encoder_output_length, ...)
    SamplingConfig(beam_width=1, *, top_k, top_p, temperature, seed, ...)
    OutputConfig(return_log_probs, return_context_logits, return_generation_logits,
                 exclude_input_from_output, ...)
    Response.request_id / has_error() / error_msg / result
    Result.is_final / output_token_ids / cum_log_probs / context_logits / finish_reasons

The test decides what the "model" answers (`script`); the subject under test is our routing,
cancellation and post-processing. Two request checks of the real executor are reproduced, with its
messages, because a user hits them at request time:

- ``LlmRequest::validate`` (cpp/tensorrt_llm/batch_manager/llmRequest.cpp): a prompt longer than the
  engine's ``max_input_len`` fails with "Prompt length (N) exceeds maximum input length (M)";
- ``EncoderBuffers::setFromInputs`` copies each request's encoder features into a buffer of the
  engine's dtype (``modelConfig.getDataType()``), and the buffer manager's copy refuses another dtype
  ("Incompatible data types").
"""

from __future__ import annotations

import datetime
import itertools
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any


class SamplingConfig:
    def __init__(self, beam_width: int = 1, *, top_k=None, top_p=None, top_p_min=None, top_p_reset_ids=None,
                 top_p_decay=None, seed=None, temperature=None, min_tokens=None, beam_search_diversity_rate=None,
                 repetition_penalty=None, presence_penalty=None, frequency_penalty=None, length_penalty=None,
                 early_stopping=None, no_repeat_ngram_size=None, num_return_sequences=None, min_p=None,
                 beam_width_array=None):
        self.beam_width, self.top_k, self.top_p, self.temperature, self.seed = beam_width, top_k, top_p, temperature, seed


class OutputConfig:
    def __init__(self, return_log_probs=False, return_context_logits=False, return_generation_logits=False,
                 exclude_input_from_output=False, return_encoder_output=False, return_perf_metrics=False,
                 additional_model_outputs=None):
        self.return_log_probs = return_log_probs
        self.return_context_logits = return_context_logits
        self.exclude_input_from_output = exclude_input_from_output


class Request:
    def __init__(self, input_token_ids, max_tokens, *, streaming=False, sampling_config=None, output_config=None,
                 end_id=None, pad_id=None, position_ids=None, bad_words=None, stop_words=None, embedding_bias=None,
                 external_draft_tokens_config=None, prompt_tuning_config=None, multimodal_input=None,
                 multimodal_embedding=None, mrope_config=None, lora_config=None, lookahead_config=None,
                 kv_cache_retention_config=None, logits_post_processor_name=None, logits_post_processor=None,
                 encoder_input_token_ids=None, client_id=None, return_all_generated_tokens=False, priority=0.5,
                 type=None, context_phase_params=None, encoder_input_features=None, encoder_output_length=None,
                 cross_attention_mask=None, num_return_sequences=1, eagle_config=None, skip_cross_attn_blocks=None,
                 guided_decoding_params=None, language_adapter_uid=None, allotted_time_ms=None, cache_salt_id=None):
        assert isinstance(input_token_ids, list) and all(isinstance(t, int) for t in input_token_ids)
        assert isinstance(max_tokens, int) and max_tokens > 0
        self.input_token_ids = input_token_ids
        self.max_tokens = max_tokens
        self.streaming = streaming
        self.sampling_config = sampling_config or SamplingConfig()
        self.output_config = output_config or OutputConfig()
        self.end_id, self.pad_id = end_id, pad_id
        self.encoder_input_features = encoder_input_features
        self.encoder_output_length = encoder_output_length


BINDINGS = SimpleNamespace(Request=Request, SamplingConfig=SamplingConfig, OutputConfig=OutputConfig)


@dataclass
class Result:
    is_final: bool
    output_token_ids: list[list[int]]
    cum_log_probs: list[float] | None = None
    context_logits: Any = None
    finish_reasons: list[str] = field(default_factory=list)


class Response:
    def __init__(self, request_id: int, result: Result | None = None, error_msg: str | None = None):
        self.request_id = request_id
        self._result = result
        self.error_msg = error_msg or ""

    def has_error(self) -> bool:
        return self._result is None

    @property
    def result(self) -> Result:
        if self._result is None:
            raise RuntimeError("response has an error")  # as the binding does
        return self._result


def _dtype_name(tensor: Any) -> str:
    """'float16' for a torch.float16 tensor or a numpy float16 array."""
    return str(getattr(tensor, "dtype", "")).removeprefix("torch.")


class FakeExecutor:
    """Requests run when the test says so: `answer(eid, ...)` queues responses for await_responses.

    `max_input_len` and `encoder_dtype` stand for the engine's build config (None: not checked).
    """

    def __init__(self, first_id: int = 1000, *, max_input_len: int | None = None,
                 encoder_dtype: str | None = None):
        self._ids = itertools.count(first_id)
        self.requests: dict[int, Request] = {}
        self.live: set[int] = set()
        self.cancelled: list[int] = []
        self.ready: deque[Response] = deque()
        self.timeouts: list[datetime.timedelta | None] = []
        self.shut = False
        self.reject: str | None = None
        self.max_input_len = max_input_len
        self.encoder_dtype = encoder_dtype

    # ---- the binding's interface
    def enqueue_request(self, request: Request) -> int:
        if self.reject:
            raise RuntimeError(self.reject)
        eid = next(self._ids)
        self.requests[eid] = request
        self.live.add(eid)
        prompt = len(request.input_token_ids)
        if self.max_input_len is not None and prompt > self.max_input_len:
            self.fail(eid, f"Prompt length ({prompt}) exceeds maximum input length ({self.max_input_len}).")
        features = request.encoder_input_features
        if self.encoder_dtype is not None and features is not None and _dtype_name(features) != self.encoder_dtype:
            self.fail(eid, "Incompatible data types")
        return eid

    def await_responses(self, timeout: datetime.timedelta | None = None) -> list[Response]:
        assert timeout is None or isinstance(timeout, datetime.timedelta)
        self.timeouts.append(timeout)
        out = list(self.ready)
        self.ready.clear()
        return out

    def cancel_request(self, id: int) -> None:
        self.cancelled.append(id)
        if id in self.live:
            self.live.discard(id)
            self.ready.append(Response(id, Result(True, [[]], finish_reasons=["CANCELLED"])))

    def shutdown(self) -> None:
        self.shut = True

    # ---- the test's controls
    def answer(self, eid: int, tokens: list[int], final: bool = True, **kw) -> None:
        if final:
            self.live.discard(eid)
        self.ready.append(Response(eid, Result(final, [tokens], **kw)))

    def fail(self, eid: int, msg: str) -> None:
        self.live.discard(eid)
        self.ready.append(Response(eid, None, msg))

    def id_for(self, prompt: list[int]) -> int:
        return next(e for e, r in self.requests.items() if r.input_token_ids == prompt and e in self.live)
