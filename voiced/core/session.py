"""One caller's stream: audio in, speech events and transcripts out (and, in Converse, replies).

The door that took the call feeds `Session.run` the plain input events of voiced.core.events and
turns what it yields into its own protocol; an error that ends the call is raised as SessionError.

A session is a few asyncio tasks joined by queues:

    reader ──frames──▶ segmenter ──utterances──▶ ASR worker (shared, batched)
       │                                               │
       └──────────── events ──▶ outbox ◀── emitter (final transcripts, in turn order)

The outbox is bounded, so a caller that stops reading slows only its own reader. When the call
ends for any reason, every task and every engine request of the session is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import numpy as np

from voiced.audio.ingest import AudioFormatError, FrameDecoder, int16_to_float, ms
from voiced.core import segmenter
from voiced.core.conversation import Conversation
from voiced.core.events import (
    DTMF_DIGITS,
    AudioIn,
    Dtmf,
    ErrorKind,
    HangupOut,
    InputEvent,
    NoticeOut,
    OutputEvent,
    SessionError,
    Speak,
    SpeechEnded,
    SpeechStarted,
    Started,
    StopSpeaking,
    TalkEnd,
    TalkStart,
    TranscriptOut,
    invalid,
)
from voiced.core.segmenter import Segmenter, Utterance
from voiced.core.spec import SessionSpec
from voiced.core.speech import in_caller_time
from voiced.engines.base import ASRRequest, CapacityError, EngineError, Transcript

log = logging.getLogger(__name__)

OUTBOX_SIZE = 256
_DONE = object()


@dataclass
class Turn:
    turn_id: int
    utterance: Utterance
    ended_at: float  # monotonic time the end of speech was detected
    task: asyncio.Task | None = None  # the recognition of this turn


class Session:
    def __init__(self, services, spec: SessionSpec, conversational: bool):
        self.services = services
        self.spec = spec
        self.conversational = conversational
        self.turn_id = 0
        self.decoder = FrameDecoder(spec.input)
        # Speech events only: the segmenter need not keep the audio.
        self.segmenter = Segmenter(replace(spec.segmentation, keep_audio=spec.recognize))
        self.outbox: asyncio.Queue = asyncio.Queue(OUTBOX_SIZE)
        self._turns: asyncio.Queue[Turn | None] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._interim: asyncio.Task | None = None
        self._next_interim = 0
        self.conversation = Conversation(self) if conversational else None

    # ------------------------------------------------------------------ plumbing

    async def send(self, event: OutputEvent) -> None:
        await self.outbox.put(event)

    async def hangup(self, turn_id: int, reason: str) -> None:
        """The agent ended the call: HangupOut, then the end of `run` (which closes everything)."""
        log.info("session %s: the agent ended the call%s", self.spec.session_id, f" ({reason})" if reason else "")
        await self.send(HangupOut(self.spec.session_id, turn_id, reason))
        await self.outbox.put(_DONE)

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=f"{self.spec.session_id}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ the call

    async def run(self, inputs: AsyncIterator[InputEvent]) -> AsyncIterator[OutputEvent]:
        """Yields the events to send; raises SessionError to end the call with an error. The end of
        `inputs` is the caller hanging up: what is in flight (transcripts, replies) finishes first."""
        await self.send(Started(self.spec.session_id, 0, self.spec))
        reader = self.spawn(self._read(inputs), "reader")
        emitter = self.spawn(self._emit_transcripts(), "emitter")
        reader.add_done_callback(lambda t: self._reader_done(t, emitter))
        try:
            while True:
                item = await self.outbox.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            await self.close()

    def _reader_done(self, reader: asyncio.Task, emitter: asyncio.Task) -> None:
        if reader.cancelled():
            return
        error = reader.exception()
        if error is not None:
            # Bad input ends the call at once: nothing more is sent.
            if not isinstance(error, SessionError):
                log.error("session %s: reader failed", self.spec.session_id, exc_info=error)
                error = SessionError(ErrorKind.INTERNAL, f"internal error: {error}")
            self._put_error(error)
            return

        async def finish():
            with contextlib.suppress(asyncio.CancelledError):
                await emitter
                if self.conversation is not None:
                    await self.conversation.drain()
            await self.outbox.put(_DONE)

        self.spawn(finish(), "finish")

    def _put_error(self, item) -> None:
        # An error must reach the caller even when the outbox is full of events it will never read.
        while True:
            try:
                self.outbox.put_nowait(item)
                return
            except asyncio.QueueFull:
                self.outbox.get_nowait()

    async def close(self) -> None:
        """Cancel everything this session started (idempotent)."""
        tasks = [t for t in self._tasks if not t.done()]
        if self.conversation is not None:
            tasks += self.conversation.tasks()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ input

    async def _read(self, inputs: AsyncIterator[InputEvent]) -> None:
        async for item in inputs:
            if type(item) is AudioIn:
                try:
                    frames = self.decoder.feed(item.data)
                except AudioFormatError as e:
                    raise invalid(str(e)) from None
                for frame in frames:
                    # Inline and synchronous for the common frame that changes nothing: this loop
                    # runs 50 times a second for every caller.
                    events = self.segmenter.push(frame)
                    if events:
                        await self._segment_events(events)
                    if self.segmenter.in_speech:
                        self._speaking()
            else:
                await self._control(item)
        for frame in self.decoder.flush():
            await self._segment_events(self.segmenter.push(frame))
        await self._segment_events(self.segmenter.flush())
        await self._turns.put(None)

    async def _control(self, item: InputEvent) -> None:
        if isinstance(item, (TalkStart, TalkEnd)):
            name = "talk_start" if isinstance(item, TalkStart) else "talk_end"
            if self.spec.segmentation.mode != "push_to_talk":
                raise invalid(f"control.{name} needs segmentation.mode PUSH_TO_TALK in the config")
            events = self.segmenter.talk_start() if isinstance(item, TalkStart) else self.segmenter.talk_end()
            await self._segment_events(events)
        elif isinstance(item, (Speak, StopSpeaking)):
            if self.conversation is None:
                name = "speak" if isinstance(item, Speak) else "stop_speaking"
                raise invalid(f"control.{name} is only available in Converse")
            if isinstance(item, Speak):
                await self.conversation.speak(item.text)
            else:
                await self.conversation.interrupt()
        elif isinstance(item, Dtmf):
            if item.digit not in DTMF_DIGITS:
                raise invalid(f"DTMF digit {item.digit!r} is not one of 0-9, *, #, A-D")
            if self.conversation is not None:
                await self.conversation.on_dtmf(item.digit)
        else:
            raise TypeError(f"a session takes voiced.core.events input events, not {type(item).__name__}")

    def _speaking(self) -> None:
        """The caller is speaking (called on every such frame)."""
        if self.conversation is not None:
            self.conversation.caller_speaking(self.segmenter.speech_ms)
        if self.spec.interim_results and self.spec.recognize:
            self._maybe_interim()

    async def _segment_events(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, segmenter.SpeechStarted):
                self.turn_id += 1
                self._next_interim = self.services.config.asr.interim_interval_ms
                await self.send(SpeechStarted(self.spec.session_id, self.turn_id, ms(ev.offset)))
            elif isinstance(ev, segmenter.SpeechEnded):
                await self.send(SpeechEnded(self.spec.session_id, self.turn_id, ms(ev.offset)))
            elif isinstance(ev, Utterance):
                self._cancel_interim()
                self.services.metrics.utterances_total.inc()
                turn = Turn(self.turn_id, ev, time.monotonic())
                if self.spec.recognize and len(ev.audio):
                    turn.task = self.spawn(self._recognize(ev.audio, priority=1), f"asr-{turn.turn_id}")
                await self._turns.put(turn)

    # ------------------------------------------------------------------ recognition

    async def _recognize(self, audio: np.ndarray, priority: int, final: bool = True) -> Transcript:
        opts = self.spec.asr
        if opts.priority != priority or (opts.word_timestamps and not final):
            # Interim results are replaced within a second: no word timings for them.
            opts = replace(opts, priority=priority, word_timestamps=opts.word_timestamps and final)
        return await self.services.asr.run(ASRRequest(int16_to_float(audio), opts))

    async def _emit_transcripts(self) -> None:
        """Final transcripts leave in turn order, whatever order the batch finishes them in."""
        while (turn := await self._turns.get()) is not None:
            if turn.task is None:
                continue
            try:
                result = await turn.task
            except EngineError as e:
                # The turn is lost, the session is not: say so and go on with the next one.
                code = "ASR_BUSY" if isinstance(e, CapacityError) else "ASR_FAILED"
                await self.send(NoticeOut(self.spec.session_id, turn.turn_id, code, str(e)))
                continue
            if result.is_hallucination and not self.spec.keep_hallucinations:
                self.services.metrics.transcripts_dropped.inc()
                log.debug("session %s turn %d: dropped %r as a hallucination", self.spec.session_id,
                          turn.turn_id, result.text)
                continue
            latency = time.monotonic() - turn.ended_at
            self.services.metrics.asr_latency.observe(latency)
            u = turn.utterance
            result = in_caller_time(result, u)
            await self.send(TranscriptOut(self.spec.session_id, turn.turn_id, result, is_final=True,
                                          start_ms=ms(u.start), end_ms=ms(u.end), latency_ms=latency * 1000.0))
            if self.conversation is not None and result.text.strip() and not result.is_hallucination:
                await self.conversation.on_transcript(turn, result)

    def _maybe_interim(self) -> None:
        if self.segmenter.speech_ms < self._next_interim or (self._interim and not self._interim.done()):
            return
        self._next_interim = self.segmenter.speech_ms + self.services.config.asr.interim_interval_ms
        turn_id, start, audio = self.turn_id, self.segmenter.speech_start, self.segmenter.current_audio()

        async def interim():
            try:
                result = await self._recognize(audio, priority=0, final=False)
            except EngineError:
                return  # an interim result is best effort; the final one reports errors
            if self.turn_id == turn_id and self.segmenter.in_speech and not result.is_hallucination:
                await self.send(TranscriptOut(self.spec.session_id, turn_id, result, is_final=False,
                                              start_ms=ms(start), end_ms=ms(self.segmenter.offset)))

        self._interim = self.spawn(interim(), f"interim-{turn_id}")

    def _cancel_interim(self) -> None:
        if self._interim is not None and not self._interim.done():
            self._interim.cancel()
        self._interim = None
