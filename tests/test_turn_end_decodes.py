"""The end of a turn with its decodes still in flight, the session core driven directly: an ASR that
cannot keep up (a busy CPU) and an audio model that answers at once. What the caller notices is how
long the session takes to end after the hang-up: the turn's own transcript, not every decode the turn
ever started (docs/BENCHMARKS.md, 2026-11-27, sessions 11 and 12)."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from tests.speech import RATE, phrase
from voiced.audio.ingest import FRAME_SAMPLES, Format, float_to_int16
from voiced.config import Config
from voiced.core import events as ev
from voiced.core.services import Services
from voiced.core.session import Session
from voiced.core.spec import segmentation_for
from voiced.engines.base import ASRRequest, EngineError, Transcript

TEXT = "Please move the meeting to next Tuesday."


class SaturatedASR:
    """Answers nothing until the test says, then one request at a time in the order they came (a batch
    that every caller shares and that is behind); a request whose caller gives it up leaves at once."""

    def __init__(self) -> None:
        self.waiting: list[tuple[ASRRequest, asyncio.Future]] = []
        self.answered: list[float] = []  # the seconds of audio of each request answered

    async def run(self, request: ASRRequest) -> Transcript:
        entry = (request, asyncio.get_running_loop().create_future())
        self.waiting.append(entry)
        try:
            return await entry[1]
        finally:
            self.waiting = [w for w in self.waiting if w is not entry]

    def answer_next(self) -> None:
        request, done = self.waiting.pop(0)
        if done.done():
            return  # given up (its task has not run since)
        self.answered.append(len(request.audio) / RATE)
        done.set_result(Transcript(TEXT, "en", [1], -0.1, 0.0, 1.0))


class SureModel:
    def predict(self, clips: list) -> list[float]:
        return [0.9] * len(clips)


def _silence(s: float) -> np.ndarray:
    return np.zeros(int(s * RATE), np.float32)



def _dial(session, pcm: np.ndarray, between) -> tuple[asyncio.Task, list, asyncio.Event]:
    """Stream `pcm` into `session` frame by frame (awaiting `between()` after each), then hang up: the
    call's task, the events it collects, and the hang-up."""
    hung_up = asyncio.Event()

    async def caller():
        for i in range(0, len(pcm) - FRAME_SAMPLES + 1, FRAME_SAMPLES):
            yield ev.AudioIn(pcm[i:i + FRAME_SAMPLES].tobytes())
            await between()
        hung_up.set()

    events: list = []

    async def collect():
        async for event in session.run(caller()):
            events.append(event)

    return asyncio.create_task(collect()), events, hung_up


async def _hang_up_mid_turn(audio: np.ndarray) -> tuple[list, SaturatedASR, float]:
    """Streams `audio` (the ASR answers nothing meanwhile), hangs up, then lets the ASR answer one request
    at a time until the session ends: the events, the ASR, and the seconds of audio the turn had."""
    asr = SaturatedASR()
    config = Config()
    services = Services(config=config, asr=asr, turn_model=SureModel())
    services.ready = True
    spec = services.spec(front="test", input=Format("LINEAR16", RATE), agent="echo",
                         segmentation=segmentation_for(config, turn_detection="smart"))
    session = Session(services, spec, conversational=True)
    pcm = float_to_int16(np.concatenate([audio, _silence(-len(audio) % FRAME_SAMPLES / RATE)]))
    # the session's tasks run between frames, as between network reads
    call, events, hung_up = _dial(session, pcm, lambda: asyncio.sleep(0))
    await hung_up.wait()
    assert not asr.answered  # nothing was decoded during the call: no turn could end before the hang-up
    for _ in range(10_000):
        if call.done():
            break
        if asr.waiting:
            asr.answer_next()
        await asyncio.sleep(0.001)
    assert call.done(), f"the session did not end ({len(asr.waiting)} decodes waiting)"
    await call
    return events, asr, len(pcm) / RATE


def test_after_a_hang_up_mid_turn_the_session_waits_for_the_turn_s_transcript_alone():
    # Two pauses the caller talked on after (each pause's transcript goes on, for its words), then a
    # third, short one, and the caller hangs up: the turn ends there, on the third pause's transcript.
    audio = np.concatenate([_silence(0.3), phrase("Please move the meeting"), _silence(0.6), phrase("to next"),
                            _silence(0.6), phrase("Tuesday."), _silence(0.3)])
    events, asr, seconds = asyncio.run(asyncio.wait_for(_hang_up_mid_turn(audio), 60))

    finals = [e for e in events if isinstance(e, ev.TranscriptOut) and e.is_final]
    assert [e.transcript.text for e in finals] == [TEXT]
    assert [e.text for e in events if isinstance(e, ev.AgentTextOut)] == [TEXT]
    assert isinstance(events[-1], ev.ReplyFinished)
    # The session ended as soon as the turn's own transcript (all of its audio) was decoded: the earlier
    # pauses' decodes, which nothing reads once the turn is over, were given up, not waited behind.
    assert len(asr.answered) == 1, asr.answered
    assert asr.answered[0] == pytest.approx(seconds, abs=0.5)


class RandomASR:
    """Answers each request after a random number of loop turns (sometimes a few ms), now and then with
    an error: the orders a loaded engine can give."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.fails = rng.choice([0.0, 0.0, 0.05])
        self.most = rng.choice([2, 20, 200])

    async def run(self, request: ASRRequest) -> Transcript:
        for _ in range(self.rng.randrange(self.most)):
            await asyncio.sleep(0)
        if self.rng.random() < 0.2:
            await asyncio.sleep(self.rng.random() * 0.005)
        if self.rng.random() < self.fails:
            raise EngineError("the decode failed")
        return Transcript(self.rng.choice([TEXT, "Please move the meeting."]), "en", [1], -0.1, 0.0, 1.0)


async def _hang_up_anywhere(seed: int, audio: np.ndarray) -> tuple[list, bool]:
    rng = random.Random(seed)
    config = Config()
    services = Services(config=config, asr=RandomASR(rng), turn_model=SureModel())
    services.ready = True
    spec = services.spec(front="test", input=Format("LINEAR16", RATE), agent="echo",
                         interim_results=rng.random() < 0.5,
                         segmentation=segmentation_for(config, turn_detection="smart"))
    session = Session(services, spec, conversational=True)
    pcm = float_to_int16(audio)[:rng.randrange(len(audio))]
    async def between():
        for _ in range(rng.randrange(3)):
            await asyncio.sleep(0)

    call, events, hung_up = _dial(session, pcm, between)
    await hung_up.wait()
    try:
        await asyncio.wait_for(asyncio.shield(call), 5)
    except asyncio.TimeoutError:
        call.cancel()
        await session.close()
        return events, False
    return events, True


def test_a_hang_up_at_any_moment_ends_the_session_with_its_turns_answered():
    # Pauses, speech coming back, speculative replies, decodes answering in any order or failing, and
    # the caller hanging up at a random frame: the session always ends, each turn's transcript answered.
    audio = np.concatenate([_silence(0.3), phrase("Please move the meeting"), _silence(0.6), phrase("to next"),
                            _silence(0.3), phrase("Tuesday."), _silence(1.0)] * 2)

    async def all_seeds():
        return [await _hang_up_anywhere(seed, audio) for seed in range(200)]

    for seed, (events, ended) in enumerate(asyncio.run(all_seeds())):
        assert ended, f"seed {seed}: the session did not end after the hang-up"
        finals = [e for e in events if isinstance(e, ev.TranscriptOut) and e.is_final]
        notices = [e for e in events if isinstance(e, ev.NoticeOut)]
        answers = [e for e in events if isinstance(e, ev.AgentTextOut)]
        # each turn got its transcript (or a notice that its decode failed), answered at most once (not
        # at all where it was a backchannel over a reply)
        assert sum(isinstance(e, ev.SpeechStarted) for e in events) == len(finals) + len(notices), seed
        assert len(answers) <= len(finals), seed
