"""One thread owns a TensorRT-LLM executor; requests are routed to their callers by id.

Why: ``ModelRunnerCpp.generate`` enqueues its batch and then collects *whatever* responses the
executor hands out (``executor.await_responses()`` with no id; tensorrt_llm/runtime/
model_runner_cpp.py, ``_initialize_and_fill_output``), so two threads calling it at once steal
each other's results. We never call ``generate``. The engine's owner thread (the scheduler's worker,
see voiced/engines/base.py) talks to the executor directly:

    enqueue_request(request) -> executor id          one per admitted request
    await_responses(timeout=timedelta) -> [Response] all ready responses, any request
    cancel_request(executor id)                      the executor frees the slot and answers once
                                                     more with a final, CANCELLED result

and this module maps executor ids back to the daemon's request ids, drops the late responses of
cancelled requests, and turns results into ``EngineOutput``s.

The executor interface is the Python binding of ``tensorrt_llm::executor::Executor``
(cpp/tensorrt_llm/pybind/executor/executor.cpp: ``enqueue_request(request)``,
``await_responses(timeout=None)`` / ``await_responses(id, timeout=None)``,
``cancel_request(id)``, ``can_enqueue_requests()``, ``shutdown()``). A ``Response`` has
``request_id``, ``has_error()``, ``error_msg`` and ``result``; a ``Result`` has ``is_final``,
``output_token_ids`` (one list per beam), ``cum_log_probs``, ``log_probs``, ``context_logits``,
``finish_reasons`` (cpp/tensorrt_llm/pybind/executor/request.cpp). Those names are stable from
0.17 to 1.2. The LLM-API path (llmapi.py) presents the same interface, so both paths share this
loop.
"""

from __future__ import annotations

import datetime
import heapq
import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from voiced.engines.base import EngineError, EngineOutput

log = logging.getLogger(__name__)


class ExecutorLike(Protocol):
    """The part of ``tensorrt_llm.bindings.executor.Executor`` we use."""

    def enqueue_request(self, request: Any) -> int: ...

    def await_responses(self, timeout: datetime.timedelta | None = None) -> list[Any]: ...

    def cancel_request(self, id: int) -> None: ...

    def shutdown(self) -> None: ...


@dataclass
class Flight:
    """A request the loop knows about: queued here, or in the executor under `executor_id`."""

    request_id: int
    payload: Any  # the runner's own per-request state
    priority: int = 0
    executor_id: int | None = None
    phase: str = "main"  # runners with two passes (Whisper language detection) track it here
    extra: dict = field(default_factory=dict)


class ExecutorLoop:
    """The routing and cancellation core shared by the Whisper and Spark runners.

    A runner subclasses it and supplies two functions:
      ``make_request(flight) -> executor Request``   build the request for the flight's phase
      ``on_result(flight, result) -> list[EngineOutput] | None``
          turn one non-error result into outputs. Return None to keep the flight alive with a
          new executor request (the runner changed ``flight.phase``; the loop re-enqueues it).

    Public methods follow voiced/engines/base.py: submit / cancel / step / has_work /
    active_requests, all from one owner thread.
    """

    def __init__(
        self,
        executor: ExecutorLike,
        *,
        max_in_flight: int,
        poll_timeout_s: float = 0.005,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.poll_timeout = datetime.timedelta(seconds=poll_timeout_s)
        self._pending: list[tuple[int, int, int]] = []  # heap of (-priority, seq, request_id)
        self._seq = itertools.count()
        self._flights: dict[int, Flight] = {}  # request_id -> flight (queued or in flight)
        self._by_executor_id: dict[int, int] = {}  # executor id -> request_id
        self._cancelled: set[int] = set()  # executor ids cancelled, awaiting their final response
        self._owner: int | None = None
        self._closed = False

    # ------------------------------------------------------------------ runner hooks

    def make_request(self, flight: Flight) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def on_result(self, flight: Flight, result: Any) -> list[EngineOutput] | None:  # pragma: no cover
        raise NotImplementedError

    # ------------------------------------------------------------------ engine contract

    def submit(self, request_id: int, payload: Any, priority: int = 0) -> None:
        self._check_owner()
        if self._closed:
            raise EngineError("the TensorRT-LLM engine is shut down")
        if request_id in self._flights:
            raise EngineError(f"request id {request_id} is already active")
        self._flights[request_id] = Flight(request_id, payload, priority)
        heapq.heappush(self._pending, (-priority, next(self._seq), request_id))

    def cancel(self, request_id: int) -> None:
        """Forget the request now; if the executor has it, tell it to stop and free its KV pages."""
        self._check_owner()
        flight = self._flights.pop(request_id, None)
        if flight is None or flight.executor_id is None:
            return  # unknown, or still queued here: the heap entry is skipped when popped
        eid = flight.executor_id
        self._by_executor_id.pop(eid, None)
        self._cancelled.add(eid)
        try:
            self.executor.cancel_request(eid)
        except Exception as e:  # noqa: BLE001 - the binding raises bare RuntimeErrors
            log.debug("cancel_request(%s) failed: %s", eid, e)
            self._cancelled.discard(eid)

    def has_work(self) -> bool:
        return bool(self._flights)

    def active_requests(self) -> int:
        return len(self._flights)

    def in_flight(self) -> int:
        """Requests the executor holds for us (cancelled ones included until they answer)."""
        return len(self._by_executor_id) + len(self._cancelled)

    def step(self) -> list[EngineOutput]:
        """Admit queued requests, then collect whatever responses are ready (waiting briefly)."""
        self._check_owner()
        outputs: list[EngineOutput] = []
        self._admit(outputs)
        if not self._by_executor_id and not self._cancelled:
            return outputs
        responses = self.executor.await_responses(timeout=self.poll_timeout)
        for response in responses:
            self._route(response, outputs)
        # A two-pass runner may have re-queued a flight while routing: start it without a step's delay.
        self._admit(outputs)
        return outputs

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in list(self._flights):
            self.cancel(rid)
        self.executor.shutdown()

    # ------------------------------------------------------------------ internals

    def _admit(self, outputs: list[EngineOutput]) -> None:
        # Keep at most max_in_flight requests in the executor: the rest wait here, where a cancel
        # costs nothing and priority still applies (the executor's own queue is first-come).
        while self._pending and self.in_flight() < self.max_in_flight:
            _, _, rid = heapq.heappop(self._pending)
            flight = self._flights.get(rid)
            if flight is None or flight.executor_id is not None:
                continue  # cancelled while queued
            self._enqueue(flight, outputs)

    def _enqueue(self, flight: Flight, outputs: list[EngineOutput]) -> None:
        try:
            request = self.make_request(flight)
            eid = self.executor.enqueue_request(request)
        except EngineError as e:
            self._fail(flight, str(e), outputs)
            return
        except Exception as e:  # noqa: BLE001 - the binding raises RuntimeError for invalid requests
            log.warning("request %s rejected by TensorRT-LLM: %s", flight.request_id, e)
            self._fail(flight, f"TensorRT-LLM rejected the request: {e}", outputs)
            return
        flight.executor_id = eid
        self._by_executor_id[eid] = flight.request_id

    def _route(self, response: Any, outputs: list[EngineOutput]) -> None:
        eid = response.request_id
        if eid in self._cancelled:
            # The late answer of a cancelled request. Only its final response frees our bookkeeping.
            if response.has_error() or _is_final(response):
                self._cancelled.discard(eid)
            return
        rid = self._by_executor_id.get(eid)
        if rid is None:
            log.debug("response for unknown executor id %s dropped", eid)
            return
        flight = self._flights[rid]
        if response.has_error():
            self._by_executor_id.pop(eid, None)
            self._fail(flight, f"TensorRT-LLM error: {response.error_msg}", outputs)
            return
        result = response.result
        final = bool(result.is_final)
        if final:
            self._by_executor_id.pop(eid, None)
        try:
            produced = self.on_result(flight, result)
        except Exception as e:
            log.exception("post-processing request %s failed", rid)
            if not final:
                self._by_executor_id.pop(eid, None)
                self._cancelled.add(eid)
                try:
                    self.executor.cancel_request(eid)
                except Exception:  # noqa: BLE001 - already finished
                    self._cancelled.discard(eid)
            self._fail(flight, f"post-processing failed: {e}", outputs)
            return
        if produced is None:
            # The runner wants another pass (e.g. Whisper: detected the language, now transcribe).
            if not final:
                raise RuntimeError("on_result may only ask for another pass on a final result")
            flight.executor_id = None
            heapq.heappush(self._pending, (-flight.priority - 1_000_000, next(self._seq), rid))
            return
        outputs.extend(produced)
        if any(o.final for o in produced):
            self._flights.pop(rid, None)
            if not final:  # the runner finished early (e.g. a cap on audio length): free the slot
                self._by_executor_id.pop(eid, None)
                self._cancelled.add(eid)
                try:
                    self.executor.cancel_request(eid)
                except Exception:  # noqa: BLE001 - already finished
                    self._cancelled.discard(eid)
        elif final:
            # The executor is done but the runner did not say so: close the request rather than leak it.
            self._flights.pop(rid, None)
            outputs.append(EngineOutput(rid, None, final=True, error="the request ended without a result"))

    def _fail(self, flight: Flight, message: str, outputs: list[EngineOutput]) -> None:
        self._flights.pop(flight.request_id, None)
        outputs.append(EngineOutput(flight.request_id, None, final=True, error=message))

    def _check_owner(self) -> None:
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise RuntimeError(
                "a TensorRT-LLM engine was called from two threads; it must be owned by one thread "
                "(responses are routed by that thread alone)"
            )


def _is_final(response: Any) -> bool:
    try:
        return bool(response.result.is_final)
    except Exception:  # noqa: BLE001 - an unreadable response counts as final
        return True
