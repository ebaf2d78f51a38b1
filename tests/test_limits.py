"""Limits that protect the daemon, in the session core (so every door has them): idle streams,
a maximum length, callers that stop reading, callers that vanish mid-reply, agents that crash or
never answer, and control messages out of order. Driven as a door drives the core."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from voiced.audio.ingest import Format
from voiced.config import Config
from voiced.core import events as ev
from voiced.core.agents import AgentRegistry
from voiced.core.errors import ErrorKind, SessionError
from voiced.core.services import Services
from voiced.core.session import Session

L16 = Format("LINEAR16", 16000)
FRAME = np.zeros(320, "<i2").tobytes()  # 20 ms of silence


def services(**server) -> Services:
    config = Config()
    for key, value in server.items():
        setattr(config.server, key, value)
    s = Services(config=config, agents=AgentRegistry(config.agent))
    s.ready = True
    return s


def session(s: Services, conversational=False, **spec) -> Session:
    return Session(s, s.spec(front="test", input=L16, **spec), conversational)


async def forever():
    await asyncio.Event().wait()


async def collect(sess: Session, inputs) -> tuple[list, SessionError | None]:
    out = []
    try:
        async for e in sess.run(inputs):
            out.append(e)
    except SessionError as e:
        return out, e
    finally:
        await sess.close()
    return out, None


def ptt(s: Services) -> Session:
    return session(s, recognize=False, segmentation=_ptt())


def _ptt():
    from voiced.core.spec import segmentation_for

    return segmentation_for(Config(), mode="push_to_talk")


def test_a_stream_that_sends_its_config_then_nothing_ends_with_a_timeout():
    async def caller():
        await forever()
        yield  # pragma: no cover

    s = services(idle_timeout_s=0.2)
    events, error = asyncio.run(collect(session(s), caller()))
    assert [type(e).__name__ for e in events] == ["Started"]
    assert error.kind is ErrorKind.TIMEOUT and "no message from the caller for 0.2 s" in error.message
    assert "server.idle_timeout_s" in error.message


def test_a_stream_that_keeps_sending_ends_at_its_maximum_length():
    async def caller():
        while True:
            yield ev.AudioIn(FRAME)
            await asyncio.sleep(0.02)

    s = services(max_session_s=0.3)
    events, error = asyncio.run(collect(session(s), caller()))
    assert error.kind is ErrorKind.TIMEOUT and "maximum length of 0.3 s (server.max_session_s)" in error.message


@pytest.mark.parametrize("marks,words", [
    ([ev.TalkEnd()], "talk_end came without a talk_start"),
    ([ev.TalkStart(), ev.TalkEnd(), ev.TalkEnd()], "talk_end came without a talk_start"),
    ([ev.TalkStart(), ev.TalkStart()], "talk_start came while already talking"),
])
def test_push_to_talk_marks_out_of_order_are_refused(marks, words):
    async def caller():
        for m in marks:
            yield m
        await forever()

    events, error = asyncio.run(collect(ptt(services()), caller()))
    assert error.kind is ErrorKind.BAD_INPUT and words in error.message


def test_a_caller_that_stops_reading_ends_with_over_capacity_and_others_are_unaffected():
    """Each talk_start/talk_end pair gives two speech events; the slow caller's door can write one and
    then its socket is full (the caller stopped reading). Its responses wait in the session up to
    server.max_outbound_bytes, then the session ends; a caller on the same server reading normally
    gets every event."""
    s = services(max_outbound_bytes=65536)
    pairs = 2000  # 4000 events: more than 65536 bytes at 64 bytes an event

    async def flood():
        for _ in range(pairs):
            for mark in (ev.TalkStart(), ev.TalkEnd()):
                yield mark
                await asyncio.sleep(0)  # a message read from the network lets the loop run

    async def slow_door():
        sess = ptt(s)
        stuck = asyncio.Event()  # the write that never completes: the caller's window is full
        written = 0
        try:
            async for event in sess.run(flood()):
                if written == 0:
                    await sess.writing(asyncio.sleep(0))
                else:
                    await sess.writing(stuck.wait())
                written += 1
        except SessionError as e:
            return e, written, sess
        finally:
            await sess.close()

    async def good_door():
        sess = ptt(s)
        got = []

        async def write(e):
            got.append(e)

        async for event in sess.run(flood()):
            await sess.writing(write(event))
        return got

    async def scenario():
        return await asyncio.gather(slow_door(), good_door())

    (error, written, slow), good = asyncio.run(scenario())
    assert error.kind is ErrorKind.OVER_CAPACITY
    assert "not reading its responses" in error.message and "server.max_outbound_bytes" in error.message
    assert written == 1  # one went out; the second write was given up when the session ended
    assert slow._outbound <= 65536  # what waited never passed the bound
    assert not slow._tasks and s.active_sessions == 0
    assert len(good) == 1 + 2 * pairs  # Started, then every speech event


class Flaky:
    """An agent plug-in with bugs: key 1 crashes it, key 2 is never answered, key 3 works."""

    async def reply(self, text):
        yield "hello"

    async def on_dtmf(self, digit):
        if digit == "1":
            raise RuntimeError("database connection lost")
        if digit == "2":
            await forever()
        yield f"you pressed {digit}"


def test_an_agent_that_crashes_or_never_answers_fails_that_reply_not_the_call():
    s = services()
    s.config.agent.reply_timeout_s = 0.2
    s.agents.register("flaky", lambda config, prompt: Flaky())

    async def scenario():
        sess = session(s, conversational=True, agent="flaky")
        done = asyncio.Event()

        async def caller():
            for digit in "123":
                yield ev.Dtmf(digit)
            await done.wait()

        out = []
        async for e in sess.run(caller()):
            out.append(e)
            if isinstance(e, ev.ReplyFinished):
                done.set()
        return out

    events = asyncio.run(scenario())
    notices = [(e.code, e.message) for e in events if isinstance(e, ev.NoticeOut)]
    assert [code for code, _ in notices] == ["AGENT_FAILED", "AGENT_TIMEOUT"]
    assert "RuntimeError: database connection lost" in notices[0][1] and "the call goes on" in notices[0][1]
    assert "no answer within 0.2 s (agent.reply_timeout_s)" in notices[1][1]
    assert [e.text for e in events if isinstance(e, ev.ReplyStarted)] == ["you pressed 3"]


def test_an_agent_that_cannot_be_created_refuses_the_call_with_an_internal_error():
    s = services()

    def broken(config, prompt):
        raise ImportError("no module named 'crm_client'")

    s.agents.register("broken", broken)
    with pytest.raises(SessionError) as e:
        session(s, conversational=True, agent="broken")
    assert e.value.kind is ErrorKind.INTERNAL and "the agent 'broken' could not be started" in e.value.message


# ----------------------------------------------------------------------------- engine side


@pytest.fixture(scope="module")
def tts_worker(tmp_path_factory):
    from tests.spark_fixtures import cached_spark_checkpoint
    from voiced.core.scheduler import EngineWorker
    from voiced.engines.spark.engine import SparkTTSEngine

    root = tmp_path_factory.mktemp("voices")
    engine = SparkTTSEngine.load(str(cached_spark_checkpoint(tmp_path_factory)), device="cpu", max_batch=2,
                                 voices_dir=root)
    worker = EngineWorker(engine, "tts")
    worker.start()
    yield worker
    worker.stop()


def test_a_caller_vanishing_mid_reply_frees_its_engine_work_within_one_step(tts_worker):
    """Seen from the engine: the engine thread is held inside a step while the caller vanishes (the
    door closes the session); the step in progress is the last one that carries the reply."""
    engine = tts_worker.engine
    s = services()
    s.tts, s.voices = tts_worker, engine.voices
    s.config.tts.first_chunk_tokens, s.config.tts.chunk_tokens = 5, 5
    s.config.tts.max_seconds = 10.0  # far longer than the test lets it run
    steps: list[set[int]] = []  # the request ids in the batch at each step
    park, parked, release, cancelled = (threading.Event() for _ in range(4))
    real_step, real_cancel = engine.step, engine.cancel

    def step():
        steps.append({r.rid for r in engine._active} | {r.rid for r in engine._queue})
        if park.is_set() and not parked.is_set():
            parked.set()
            release.wait(60)
        return real_step()

    def cancel(rid):
        real_cancel(rid)
        cancelled.set()

    engine.step, engine.cancel = step, cancel
    try:
        async def scenario():
            sess = session(s, conversational=True, agent="client")

            async def caller():
                yield ev.Speak("Thank you for holding, an agent will be with you shortly.")
                await forever()

            async for e in sess.run(caller()):
                if isinstance(e, ev.AudioOut):
                    break  # the reply is streaming
            park.set()
            await asyncio.to_thread(parked.wait, 60)
            at = len(steps) - 1  # the step the engine thread is inside now
            in_flight = steps[at]
            await sess.close()  # what every door does when its caller is gone
            release.set()
            await asyncio.to_thread(cancelled.wait, 60)
            return at, in_flight

        at, in_flight = asyncio.run(asyncio.wait_for(scenario(), 300))
        assert len(in_flight) == 1
        rid = next(iter(in_flight))
        assert all(rid not in ids for ids in steps[at + 1 :])  # not one more step after the one under way
        assert engine.active_requests() == 0 and tts_worker.pending == 0
    finally:
        release.set()
        engine.step, engine.cancel = real_step, real_cancel
