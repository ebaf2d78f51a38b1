"""The executor-owning loop: routing responses to callers by id, cancellation, admission."""

from __future__ import annotations

import threading

import pytest

from tests.trtllm_fakes import BINDINGS, FakeExecutor
from voiced.engines.base import EngineError, EngineOutput
from voiced.engines.trtllm.executor import ExecutorLoop, Flight


class TokenLoop(ExecutorLoop):
    """The smallest runner: payload is a prompt; the output is the generated tokens."""

    def make_request(self, flight: Flight):
        if flight.payload == "bad":
            raise EngineError("bad request")
        return BINDINGS.Request(input_token_ids=list(flight.payload), max_tokens=8)

    def on_result(self, flight: Flight, result):
        flight.extra.setdefault("tokens", []).extend(result.output_token_ids[0])
        if result.is_final:
            return [EngineOutput(flight.request_id, flight.extra["tokens"], final=True)]
        return [EngineOutput(flight.request_id, list(result.output_token_ids[0]), final=False)]


def make(max_in_flight=8):
    ex = FakeExecutor()
    return ex, TokenLoop(ex, max_in_flight=max_in_flight)


def test_responses_reach_their_own_caller_in_any_order():
    ex, loop = make()
    loop.submit(1, [11])
    loop.submit(2, [22])
    loop.submit(3, [33])
    assert loop.step() == []  # admitted, nothing ready yet
    e1, e2, e3 = ex.id_for([11]), ex.id_for([22]), ex.id_for([33])
    # The executor answers out of order, mixing requests in one await_responses batch.
    ex.answer(e3, [3, 3])
    ex.answer(e1, [1], final=False)
    ex.answer(e2, [2, 2])
    out = {(o.request_id, o.final): o.value for o in loop.step()}
    assert out == {(3, True): [3, 3], (1, False): [1], (2, True): [2, 2]}
    ex.answer(e1, [1, 1])
    (o,) = loop.step()
    assert (o.request_id, o.value, o.final) == (1, [1, 1, 1], True)
    assert not loop.has_work() and loop.active_requests() == 0


def test_cancel_in_flight_frees_the_slot_and_drops_late_responses():
    ex, loop = make()
    loop.submit(1, [11])
    loop.submit(2, [22])
    loop.step()
    e1, e2 = ex.id_for([11]), ex.id_for([22])
    ex.answer(e1, [5], final=False)  # a partial already on its way when the caller hangs up
    loop.cancel(1)
    assert ex.cancelled == [e1]
    assert loop.active_requests() == 1
    ex.answer(e2, [7])
    out = loop.step()
    # Neither the partial nor the executor's final CANCELLED response for request 1 comes out.
    assert [(o.request_id, o.value) for o in out] == [(2, [7])]
    assert loop.in_flight() == 0 and not loop.has_work()


def test_cancel_while_queued_never_reaches_the_executor():
    ex, loop = make(max_in_flight=1)
    loop.submit(1, [11])
    loop.submit(2, [22])
    loop.step()
    assert len(ex.requests) == 1  # request 2 waits here: max_in_flight
    loop.cancel(2)
    ex.answer(ex.id_for([11]), [1])
    out = loop.step()
    assert [o.request_id for o in out] == [1]
    assert len(ex.requests) == 1 and ex.cancelled == []
    assert not loop.has_work()


def test_request_id_is_reusable_after_cancel():
    ex, loop = make()
    loop.submit(1, [11])
    loop.step()
    old = ex.id_for([11])
    loop.cancel(1)
    loop.submit(1, [12])
    loop.step()
    new = ex.id_for([12])
    ex.answer(new, [9])
    out = loop.step()  # also drains the CANCELLED answer of the old executor id
    assert [(o.request_id, o.value) for o in out] == [(1, [9])]
    assert old != new and loop.in_flight() == 0


def test_admission_respects_max_in_flight_and_priority():
    ex, loop = make(max_in_flight=2)
    loop.submit(1, [1], priority=0)
    loop.submit(2, [2], priority=0)
    loop.submit(3, [3], priority=0)
    loop.submit(4, [4], priority=5)  # jumps the local queue
    loop.step()
    assert [r.input_token_ids for r in ex.requests.values()] == [[4], [1]]
    ex.answer(ex.id_for([4]), [0])
    loop.step()  # one slot freed -> the next in line (2) is admitted in the same step
    assert [r.input_token_ids for r in ex.requests.values()] == [[4], [1], [2]]


def test_executor_error_and_rejection_become_final_errors():
    ex, loop = make()
    loop.submit(1, [11])
    loop.submit(2, "bad")
    out = loop.step()
    assert [(o.request_id, o.final, o.error) for o in out] == [(2, True, "bad request")]
    ex.fail(ex.id_for([11]), "out of KV blocks")
    (o,) = loop.step()
    assert o.request_id == 1 and o.final and "out of KV blocks" in o.error
    ex.reject = "Maximum input length exceeds"
    loop.submit(3, [33])
    (o,) = loop.step()
    assert o.request_id == 3 and "rejected" in o.error and "Maximum input length" in o.error
    assert not loop.has_work()


def test_duplicate_id_and_closed_engine_are_refused():
    ex, loop = make()
    loop.submit(1, [1])
    with pytest.raises(EngineError, match="already active"):
        loop.submit(1, [1])
    loop.step()
    loop.shutdown()
    assert ex.shut and ex.cancelled  # in-flight work cancelled on shutdown
    with pytest.raises(EngineError, match="shut down"):
        loop.submit(2, [2])


def test_step_without_work_does_not_block_on_the_executor():
    ex, loop = make()
    assert loop.step() == []
    assert ex.timeouts == []  # nothing in flight: await_responses is not called


def test_a_second_thread_is_refused():
    _ex, loop = make()
    loop.submit(1, [1])
    errors = []

    def other():
        try:
            loop.step()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert errors and "two threads" in errors[0]


def test_runner_failure_cancels_and_reports():
    class Broken(TokenLoop):
        def on_result(self, flight, result):
            raise ValueError("boom")

    ex = FakeExecutor()
    loop = Broken(ex, max_in_flight=4)
    loop.submit(1, [1])
    loop.step()
    eid = ex.id_for([1])
    ex.answer(eid, [1], final=False)
    (o,) = loop.step()
    assert o.final and "boom" in o.error
    assert ex.cancelled == [eid]
    loop.step()  # the CANCELLED answer is swallowed
    assert loop.in_flight() == 0
