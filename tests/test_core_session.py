"""The session core driven directly, as every front door drives it: plain events in, plain events
out, no transport. A tiny IVR agent answers keys and ends the call; admission is one limit for
every door."""

from __future__ import annotations

import asyncio

import pytest

from tests.spark_fixtures import make_spark_checkpoint
from voiced.audio.ingest import Format
from voiced.config import Config
from voiced.core import events as ev
from voiced.core.agents import AgentRegistry, EndCall
from voiced.core.errors import ErrorKind, SessionError, invalid
from voiced.core.scheduler import EngineWorker
from voiced.core.services import Services
from voiced.core.session import Session

PHONE = Format("MULAW", 8000)


class MenuAgent:
    """What an IVR plug-in looks like: 1 says the hours and hangs up, # hangs up at once."""

    async def reply(self, text):
        yield "Press 1 for our opening hours."

    async def on_dtmf(self, digit):
        if digit == "1":
            yield "We open at nine."
            yield EndCall("menu done")
        elif digit == "#":
            raise EndCall("caller left the menu")
        else:
            yield f"Key {digit} is not on the menu."


@pytest.fixture(scope="module")
def tts_worker(tmp_path_factory):
    from voiced.engines.spark.engine import SparkTTSEngine

    root = tmp_path_factory.mktemp("spark")
    engine = SparkTTSEngine.load(str(make_spark_checkpoint(root / "Spark-TTS-0.5B", seed=0)), device="cpu",
                                 max_batch=2, voices_dir=root / "voices")
    worker = EngineWorker(engine, "tts")
    worker.start()
    yield worker
    worker.stop()


def services_with(tts=None) -> Services:
    config = Config()
    config.tts.max_seconds = 0.4  # random weights never stop on their own
    config.tts.first_chunk_tokens, config.tts.chunk_tokens = 5, 10
    agents = AgentRegistry(config.agent)
    agents.register("menu", lambda cfg, prompt: MenuAgent())
    s = Services(config=config, tts=tts, agents=agents)
    s.ready = True
    return s


async def call(services: Services, inputs: list, conversational: bool = True) -> list:
    """Feeds `inputs`, then keeps the line open (a caller who does not hang up) until the session ends."""
    spec = services.spec(front="test", input=PHONE, agent="menu")
    session = Session(services, spec, conversational)
    held = asyncio.Event()

    async def caller():
        for item in inputs:
            yield item
        await held.wait()  # never set: only the agent can end this call

    try:
        return [e async for e in session.run(caller())]
    finally:
        await session.close()


def test_a_key_reaches_the_agent_which_speaks_then_hangs_up(tts_worker):
    events = asyncio.run(asyncio.wait_for(call(services_with(tts_worker), [ev.Dtmf("1")]), 120))
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "Started" and kinds[-1] == "HangupOut"
    assert events[-1].reason == "menu done"
    assert [e.text for e in events if isinstance(e, ev.AgentTextOut)] == ["We open at nine."]
    audio = [e for e in events if isinstance(e, ev.AudioOut)]
    assert audio and audio[-1].last and all(len(a.audio) for a in audio)
    # the whole reply is out (and has played) before the hang-up
    last_audio = max(i for i, k in enumerate(kinds) if k == "AudioOut")
    assert last_audio < kinds.index("ReplyFinished") == len(kinds) - 2


def test_an_agent_may_end_the_call_without_a_word_and_bad_keys_are_refused():
    events = asyncio.run(asyncio.wait_for(call(services_with(), [ev.Dtmf("#")]), 30))
    assert [type(e).__name__ for e in events] == ["Started", "HangupOut"]
    assert events[-1].reason == "caller left the menu"

    with pytest.raises(SessionError) as e:
        asyncio.run(asyncio.wait_for(call(services_with(), [ev.Dtmf("x")]), 30))
    assert e.value.kind is ErrorKind.BAD_INPUT and "DTMF digit 'x'" in e.value.message


def test_a_key_without_tts_is_answered_in_text_and_a_listening_session_ignores_keys():
    async def scenario():
        s = services_with()
        spec = s.spec(front="test", input=PHONE, agent="menu")
        session = Session(s, spec, conversational=True)
        out = []
        answered = asyncio.Event()

        async def caller():
            yield ev.Dtmf("5")
            await answered.wait()  # the caller hangs up once the answer is complete

        async for e in session.run(caller()):
            out.append(e)
            if isinstance(e, ev.ReplyFinished):
                answered.set()
        listening = Session(s, s.spec(front="test", input=PHONE), conversational=False)
        quiet = [e async for e in listening.run(_items(ev.Dtmf("5")))]
        return out, quiet

    out, quiet = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert [e.text for e in out if isinstance(e, ev.ReplyStarted)] == ["Key 5 is not on the menu."]
    assert not any(isinstance(e, ev.HangupOut) for e in out)
    assert [type(e).__name__ for e in quiet] == ["Started"]


async def _items(*items):
    for item in items:
        yield item


async def converse(services: Services, agent: str, first: list, react, conversational: bool = True) -> list:
    """A call the test steers: `first` goes in, then `react(event)` returns what to send next (None in
    the list: hang up)."""
    inbox: asyncio.Queue = asyncio.Queue()
    for item in first:
        inbox.put_nowait(item)

    async def caller():
        while (item := await inbox.get()) is not None:
            yield item

    session = Session(services, services.spec(front="test", input=PHONE, agent=agent), conversational)
    out = []
    try:
        async for e in session.run(caller()):
            out.append(e)
            for item in react(e):
                inbox.put_nowait(item)
    finally:
        await session.close()
    return out


def test_typed_text_is_answered_as_speech_is_and_stopped_as_speech_is(tts_worker):
    def react(e):
        if isinstance(e, ev.AudioOut) and e.reply_id == 1 and e.sequence == 0:
            return [ev.StopSpeaking()]  # cut the first answer short, as a caller's cancel does
        if isinstance(e, ev.ReplyInterrupted):
            return [ev.UserText("And\ttomorrow?\n")]
        return [None] if isinstance(e, ev.ReplyFinished) else []

    out = asyncio.run(asyncio.wait_for(converse(services_with(tts_worker), "echo", [ev.UserText("  What time is it? ")],
                                                react), 120))
    said = [e.text for e in out if isinstance(e, ev.AgentTextOut)]
    assert said == ["What time is it?", "And tomorrow?"]  # the agent heard the cleaned text
    kinds = [type(e).__name__ for e in out if not isinstance(e, (ev.Started, ev.AgentTextOut))]
    assert kinds[0] == "ReplyStarted" and kinds[1] == "AudioOut" and "ReplyInterrupted" in kinds
    second = [e for e in out if getattr(e, "reply_id", None) == 2]
    assert isinstance(second[-1], ev.ReplyFinished) and any(isinstance(e, ev.AudioOut) and e.last for e in second)
    assert not any(isinstance(e, (ev.SpeechStarted, ev.TranscriptOut)) for e in out)  # nothing was heard


def test_typed_text_without_tts_is_answered_in_text():
    out = asyncio.run(asyncio.wait_for(converse(
        services_with(), "echo", [ev.UserText("Hello there.")],
        lambda e: [None] if isinstance(e, ev.ReplyFinished) else []), 30))
    assert [type(e).__name__ for e in out] == ["Started", "AgentTextOut", "ReplyStarted", "ReplyFinished"]
    assert out[1].text == "Hello there." and out[1].last and out[2].text == "Hello there."


def test_bad_typed_text_is_refused_and_a_client_driven_agent_says_it_will_not_answer():
    from voiced.core.spec import MAX_TEXT_CHARS

    for text, words in (("  \n ", "text is empty"), ("\x00\x1b", "text is empty"),
                        ("a" * (MAX_TEXT_CHARS + 1), f"text is {MAX_TEXT_CHARS + 1} characters")):
        with pytest.raises(SessionError) as e:
            asyncio.run(asyncio.wait_for(converse(services_with(), "echo", [ev.UserText(text)], lambda e: []), 30))
        assert e.value.kind is ErrorKind.BAD_INPUT and words in e.value.message
    with pytest.raises(SessionError) as e:  # a transcription-only session has no agent to ask
        asyncio.run(asyncio.wait_for(converse(services_with(), "echo", [ev.UserText("Hi.")], lambda e: [],
                                              conversational=False), 30))
    assert e.value.kind is ErrorKind.BAD_INPUT and "only answered in Converse" in e.value.message
    # An emoji is a fair question (only text to speak must hold words); the client agent never answers.
    out = asyncio.run(asyncio.wait_for(converse(
        services_with(), "client", [ev.UserText("👍"), ev.Speak("I heard you.")],
        lambda e: [None] if isinstance(e, ev.ReplyFinished) else []), 30))
    assert [type(e).__name__ for e in out] == ["Started", "NoticeOut", "ReplyStarted", "ReplyFinished"]
    assert out[1].code == "NO_AGENT" and "'client'" in out[1].message and out[2].text == "I heard you."


def test_admission_is_one_limit_for_every_door():
    async def scenario():
        s = services_with()
        s.config.server.max_sessions = 2
        async with s.admit("grpc"), s.admit("audiosocket"):
            assert s.active_sessions == 2 and s.peak_sessions == 2
            with pytest.raises(SessionError) as full:
                async with s.admit("wyoming"):
                    pass
            assert full.value.kind is ErrorKind.OVER_CAPACITY and "server.max_sessions" in full.value.message
        with pytest.raises(SessionError):
            async with s.admit("audiosocket"):
                raise invalid("a malformed frame")
        assert s.active_sessions == 0
        s.draining = True
        with pytest.raises(SessionError) as draining:
            async with s.admit("grpc"):
                pass
        assert draining.value.kind is ErrorKind.UNAVAILABLE
        return s.metrics.registry

    registry = asyncio.run(scenario())

    def count(**labels):
        return registry.get_sample_value("voiced_sessions_total", labels) or 0

    assert count(front="grpc", outcome="ok") == 1
    assert count(front="audiosocket", outcome="ok") == 1
    assert count(front="wyoming", outcome="over_capacity") == 1
    assert count(front="audiosocket", outcome="bad_input") == 1
    assert count(front="grpc", outcome="unavailable") == 1
    assert registry.get_sample_value("voiced_sessions_active", {"front": "audiosocket"}) == 0


def test_spec_for_fills_defaults_and_refuses_bad_settings_with_the_setting_named():
    s = services_with()
    spec = s.spec(front="audiosocket", input=PHONE, voice="female", language="de")
    assert spec.output == PHONE and spec.front == "audiosocket" and spec.agent == "echo"
    assert spec.tts.voice == "female" and spec.asr.language == "de"
    assert spec.barge_in_min_speech_ms == s.config.barge_in.min_speech_ms
    for kwargs, words in (
        (dict(input=Format("MULAW", 4000)), "sample_rate_hz 4000"),
        (dict(input=PHONE, agent="nobody"), "agent.name 'nobody' is not available"),
        (dict(input=PHONE, barge_in_min_speech_ms=1), "barge_in.min_speech_ms 1"),
    ):
        with pytest.raises(SessionError) as e:
            s.spec(front="test", **kwargs)
        assert e.value.kind is ErrorKind.BAD_INPUT and words in e.value.message
