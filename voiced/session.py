"""One caller's stream: audio in, speech events and transcripts out (and, in Converse, replies).

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

import grpc
import numpy as np
from voiced_client.proto import voiced_pb2 as pb

from voiced.audio.ingest import RATE, AudioFormatError, FrameDecoder, int16_to_float
from voiced.engines.base import ASRRequest, CapacityError, EngineError, Transcript
from voiced.core.segmenter import Segmenter, SpeechEnded, SpeechStarted, Utterance
from voiced.wire import SessionError, SessionSpec, invalid, transcript_to_proto

log = logging.getLogger(__name__)

OUTBOX_SIZE = 256
_DONE = object()


def ms(samples: int) -> int:
    return samples * 1000 // RATE


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
        self.conversation = None
        if conversational:
            from voiced.conversation import Conversation

            self.conversation = Conversation(self)

    # ------------------------------------------------------------------ plumbing

    def event(self, **kwargs) -> pb.SessionEvent:
        return pb.SessionEvent(session_id=self.spec.session_id, turn_id=self.turn_id, **kwargs)

    async def send(self, event: pb.SessionEvent) -> None:
        await self.outbox.put(event)

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=f"{self.spec.session_id}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ------------------------------------------------------------------ the call

    async def run(self, requests: AsyncIterator[pb.SessionRequest]) -> AsyncIterator[pb.SessionEvent]:
        """Yields the events to send; raises SessionError to end the call with a status."""
        await self.send(self.event(started=pb.SessionStarted(session_id=self.spec.session_id,
                                                             effective_config=self.spec.effective)))
        reader = self.spawn(self._read(requests), "reader")
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
                error = SessionError(grpc.StatusCode.INTERNAL, f"internal error: {error}")
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

    async def _read(self, requests: AsyncIterator[pb.SessionRequest]) -> None:
        async for request in requests:
            kind = request.WhichOneof("request")
            if kind == "audio":
                try:
                    frames = self.decoder.feed(request.audio)
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
            elif kind == "control":
                await self._control(request.control)
            elif kind == "config":
                raise invalid("config was already sent; send it once, as the first message of the stream")
            else:
                raise invalid("empty request: set one of config, audio or control")
        for frame in self.decoder.flush():
            await self._segment_events(self.segmenter.push(frame))
        await self._segment_events(self.segmenter.flush())
        await self._turns.put(None)

    async def _control(self, control: pb.Control) -> None:
        kind = control.WhichOneof("event")
        if kind in ("talk_start", "talk_end"):
            if self.spec.segmentation.mode != "push_to_talk":
                raise invalid(f"control.{kind} needs segmentation.mode PUSH_TO_TALK in the config")
            events = self.segmenter.talk_start() if kind == "talk_start" else self.segmenter.talk_end()
            await self._segment_events(events)
        elif kind in ("speak", "stop_speaking"):
            if self.conversation is None:
                raise invalid(f"control.{kind} is only available in Converse")
            await self.conversation.control(control)
        else:
            raise invalid("empty control: set talk_start, talk_end, speak or stop_speaking")

    def _speaking(self) -> None:
        """The caller is speaking (called on every such frame)."""
        if self.conversation is not None:
            self.conversation.caller_speaking(self.segmenter.speech_ms)
        if self.spec.interim_results and self.spec.recognize:
            self._maybe_interim()

    async def _segment_events(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, SpeechStarted):
                self.turn_id += 1
                self._next_interim = self.services.config.asr.interim_interval_ms
                await self.send(self.event(speech=pb.SpeechActivity(
                    type=pb.SpeechActivity.SPEECH_STARTED, offset_ms=ms(ev.offset))))
            elif isinstance(ev, SpeechEnded):
                await self.send(self.event(speech=pb.SpeechActivity(
                    type=pb.SpeechActivity.SPEECH_ENDED, offset_ms=ms(ev.offset))))
            elif isinstance(ev, Utterance):
                self._cancel_interim()
                self.services.metrics.utterances_total.inc()
                turn = Turn(self.turn_id, ev, time.monotonic())
                if self.spec.recognize and len(ev.audio):
                    turn.task = self.spawn(self._recognize(ev.audio, priority=1), f"asr-{turn.turn_id}")
                await self._turns.put(turn)

    # ------------------------------------------------------------------ recognition

    async def _recognize(self, audio: np.ndarray, priority: int) -> Transcript:
        opts = self.spec.asr
        if opts.priority != priority:
            opts = replace(opts, priority=priority)
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
                await self.send(pb.SessionEvent(session_id=self.spec.session_id, turn_id=turn.turn_id,
                                                notice=pb.Notice(code=code, message=str(e))))
                continue
            if result.is_hallucination and not self.spec.keep_hallucinations:
                self.services.metrics.transcripts_dropped.inc()
                log.debug("session %s turn %d: dropped %r as a hallucination", self.spec.session_id,
                          turn.turn_id, result.text)
                continue
            latency = time.monotonic() - turn.ended_at
            self.services.metrics.asr_latency.observe(latency)
            u = turn.utterance
            await self.send(pb.SessionEvent(
                session_id=self.spec.session_id, turn_id=turn.turn_id,
                transcript=transcript_to_proto(result, is_final=True, start_ms=ms(u.start), end_ms=ms(u.end),
                                               latency_ms=latency * 1000.0)))
            if self.conversation is not None and result.text.strip() and not result.is_hallucination:
                await self.conversation.on_transcript(turn, result)

    def _maybe_interim(self) -> None:
        if self.segmenter.speech_ms < self._next_interim or (self._interim and not self._interim.done()):
            return
        self._next_interim = self.segmenter.speech_ms + self.services.config.asr.interim_interval_ms
        turn_id, start, audio = self.turn_id, self.segmenter.speech_start, self.segmenter.current_audio()

        async def interim():
            try:
                result = await self._recognize(audio, priority=0)
            except EngineError:
                return  # an interim result is best effort; the final one reports errors
            if self.turn_id == turn_id and self.segmenter.in_speech and not result.is_hallucination:
                await self.send(pb.SessionEvent(
                    session_id=self.spec.session_id, turn_id=turn_id,
                    transcript=transcript_to_proto(result, is_final=False, start_ms=ms(start),
                                                   end_ms=ms(self.segmenter.offset))))

        self._interim = self.spawn(interim(), f"interim-{turn_id}")

    def _cancel_interim(self) -> None:
        if self._interim is not None and not self._interim.done():
            self._interim.cancel()
        self._interim = None
