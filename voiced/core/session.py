"""One caller's stream: audio in, speech events and transcripts out (and, in Converse, replies).

The door that took the call feeds `Session.run` the plain input events of voiced.core.events and
turns what it yields into its own protocol; an error that ends the call is raised as SessionError.

A session is a few asyncio tasks joined by queues:

    reader ──frames──▶ segmenter ──utterances──▶ ASR worker (shared, batched)
       │                                               │
       └──────────── events ──▶ outbox ◀── emitter (final transcripts, in turn order)

End of turn: with `segmentation.turn_detection = "smart"` (and the end-of-turn model loaded), the
segmenter reports each short pause inside speech; the turn tracker (voiced.core.turn_tracker, which
holds the pause state machine) asks for the turn's final transcript on the audio so far and the audio
model's answer, the session runs both, and ends the turn (`Segmenter.end_turn`) as soon as the tracker
says the caller is done. Speech coming back cancels all of it, and nothing of it has reached the
caller: the transcript is sent, and the conversation answers, only once the turn is confirmed. For
agents that declare it safe, the conversation prepares the reply during the pause
(voiced.core.conversation). The tracker also finds a pause where the words stop changing while the VAD
hears sound (hold music after the voice), from the interim decodes the session runs for it.

Limits every door gets (config `[server]`): a caller that sends nothing for `idle_timeout_s`, or
whose call lasts `max_session_s`, is ended with TIMEOUT; responses waiting for a caller that does
not read them are bounded by `max_outbound_bytes`, and past it the session ends with OVER_CAPACITY
(the door writes through `Session.writing`, which gives up a write the caller never takes). When
the call ends for any reason, every task and every engine request of the session is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

import numpy as np

from voiced.audio.ingest import AudioFormatError, FrameDecoder, int16_to_float, ms
from voiced.core import segmenter, turns
from voiced.core.conversation import Conversation
from voiced.core.errors import ErrorKind, SessionError, engine_error, invalid
from voiced.core.events import (
    DTMF_DIGITS,
    AudioIn,
    Dtmf,
    HangupOut,
    InputEvent,
    NoticeOut,
    OutputEvent,
    Speak,
    SpeechEnded,
    SpeechStarted,
    Started,
    StopSpeaking,
    TalkEnd,
    TalkStart,
    TranscriptOut,
    TurnWithoutWords,
    UserText,
)
from voiced.core.outbound import cost, over_capacity, too_long
from voiced.core.pauses import Pause, model_clip, recognition_options, smart_segmentation
from voiced.core.segmenter import Segmenter, Utterance
from voiced.core.spec import SessionSpec
from voiced.core.speech import in_caller_time
from voiced.core.turn_tracker import Actions, Decode, TurnTracker
from voiced.engines.base import ASRRequest, CapacityError, EngineError, Transcript, hallucination_reason

log = logging.getLogger(__name__)

LIVE: weakref.WeakSet = weakref.WeakSet()  # sessions running now, every daemon's (`live_sessions`)


def live_sessions(services) -> list:
    """The sessions of `services`' daemon running now (the drain's end ends their input)."""
    return [s for s in list(LIVE) if s.services is services]

_DONE = object()


@dataclass
class Turn:
    turn_id: int
    utterance: Utterance
    ended_at: float  # monotonic time the end of speech was detected
    task: asyncio.Task | None = None  # the recognition of this turn
    backchannel: bool = False  # short speech over a reply ("mm-hmm", a cough): transcribed, not answered
    over_reply: bool = False  # a reply was being spoken during the turn: its words judge it too (Conversation)


class Session:
    def __init__(self, services, spec: SessionSpec, conversational: bool):
        self.services = services
        self.spec = spec
        self.conversational = conversational
        self.decoder = FrameDecoder(spec.input)
        seg = spec.segmentation
        self.turn_model = None  # the end-of-turn model, when this session's turns are decided by it
        if seg.mode == "auto" and seg.turn_detection == "smart":
            self.turn_model = services.turn_model if spec.recognize else None
            if self.turn_model is None:
                # No model on this server (it said so once at start), or no words to read: silence.
                seg = replace(seg, turn_detection="silence")
                self.spec = spec = replace(spec, segmentation=seg)
        self.bounds = turns.bounds(seg.eagerness)
        if self.turn_model is not None:
            seg = smart_segmentation(seg, self.bounds)
        # Speech events only: the segmenter need not keep the audio.
        self.segmenter = Segmenter(replace(seg, keep_audio=spec.recognize))
        self.tracker = TurnTracker(self.segmenter, self.bounds, services.config.asr.interim_interval_ms,
                                   spec.keep_hallucinations)
        # smart: the transcripts of this turn's earlier pauses that go on after speech came back (their words
        # count among the turn's decodes, `_watch_words`); the turn's end cancels them (`_drop_watched`)
        self._watched: list[asyncio.Future] = []
        self._voiced_ms = 0  # the current turn's longest burst of talk (segmenter.voiced_ms)
        self._over_reply = False  # a reply was being spoken during the current turn
        # Unbounded as a queue, bounded in bytes: `send` never blocks a producer (an engine's
        # output, the reader), and a caller who stops reading ends the call at the budget.
        self.outbox: asyncio.Queue = asyncio.Queue()
        self._outbound = 0  # bytes of events waiting in the outbox
        self._error: SessionError | None = None  # what ended the session, once it has
        self._writer: asyncio.Task | None = None  # the door's task while it is in `writing`
        self._writer_cancelled = False
        self._idle: asyncio.TimerHandle | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._last_input = 0.0  # loop time of the caller's last message
        self._reading_done = False  # the caller has finished sending
        self._input_cut = False  # end_input(): the drain's end cut the caller's input here
        self._awaiting_input = False  # the reader waits for the caller's next message
        self._reader: asyncio.Task | None = None
        self._turns: asyncio.Queue[Turn | None] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._interim: asyncio.Task | None = None
        self.conversation = Conversation(self) if conversational else None

    @property
    def turn_id(self) -> int:
        """The current turn's id (the tracker counts them)."""
        return self.tracker.turn_id

    # ------------------------------------------------------------------ plumbing

    async def send(self, event: OutputEvent) -> None:
        """Queue an event for the caller (never blocks: a caller that does not read ends the call)."""
        if self._error is not None:
            return  # the call is over; nothing more goes out
        size = cost(event)
        limit = self.services.config.server.max_outbound_bytes
        if self._outbound + size > limit:
            self.fail(over_capacity(self._outbound + size, limit))
            return
        self._outbound += size
        self.outbox.put_nowait(event)

    def fail(self, error: SessionError) -> None:
        """End the call with `error` at once (the first error wins): `run` raises it instead of the
        events still queued, and a door blocked in `writing` gets it too."""
        if self._error is not None:
            return
        self._error = error
        self.outbox.put_nowait(error)  # wakes `run` if it is waiting for an event
        if self._writer is not None:
            self._writer_cancelled = True
            self._writer.cancel()

    async def writing(self, write) -> None:
        """Await a door's write of one event (`write`: an awaitable); if the session fails meanwhile
        (its caller stopped reading, or a limit ended it), the write is given up and the error raised.

        A caller that stops reading blocks the door's write (flow control), so the door stops taking
        events from `run`; this is how the session's end still reaches that door and frees the call.
        (The write is awaited in the door's own task, which `fail` cancels: no task per event.)"""
        if self._error is not None:
            raise self._error
        self._writer = asyncio.current_task()
        try:
            return await write
        except asyncio.CancelledError:
            if not self._writer_cancelled:
                raise  # the door itself is being cancelled
            uncancel = getattr(self._writer, "uncancel", None)
            if uncancel is not None:
                uncancel()
            raise self._error from None
        finally:
            self._writer = None
            self._writer_cancelled = False

    async def hangup(self, turn_id: int, reason: str) -> None:
        """The agent ended the call: HangupOut, then the end of `run` (which closes everything)."""
        log.info("session %s: the agent ended the call%s", self.spec.session_id, f" ({reason})" if reason else "")
        await self.send(HangupOut(self.spec.session_id, turn_id, reason))
        self.outbox.put_nowait(_DONE)

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=f"{self.spec.session_id}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            # A cancelled task keeps its CancelledError until someone asks for it (gather does not: it makes
            # its own), and the error's traceback keeps the task's frames with their locals: this session, a
            # pause, a reply, each holding the task again. Asked for here, it goes, and a finished call is
            # freed when its last reference goes instead of at the collector's next full pass, which pauses
            # the event loop every caller shares (60 ms at 224 callers on an H200, docs/BENCHMARKS.md).
            with contextlib.suppress(asyncio.CancelledError):
                task.result()

    # ------------------------------------------------------------------ the call

    async def run(self, inputs: AsyncIterator[InputEvent]) -> AsyncIterator[OutputEvent]:
        """Yields the events to send; raises SessionError to end the call with an error. The end of
        `inputs` is the caller hanging up: what is in flight (transcripts, replies) finishes first."""
        await self.send(Started(self.spec.session_id, 0, self.spec))
        self._start_timers()
        reader = self._reader = self.spawn(self._read(inputs), "reader")
        LIVE.add(self)
        emitter = self.spawn(self._emit_transcripts(), "emitter")
        reader.add_done_callback(lambda t: self._reader_done(t, emitter))
        try:
            while True:
                item = await self.outbox.get()
                if item is _DONE:
                    break
                if self._error is not None:
                    raise self._error
                self._outbound -= cost(item)
                yield item
        finally:
            await self.close()

    def _start_timers(self) -> None:
        """Idle and maximum-length limits: loop timers, not a task per message (50 a second per caller)."""
        limits = self.services.config.server
        loop = asyncio.get_running_loop()
        self._last_input = loop.time()
        if limits.idle_timeout_s > 0:
            self._idle = loop.call_at(self._last_input + limits.idle_timeout_s, self._check_idle)
        if limits.max_session_s > 0:
            self._deadline = loop.call_later(limits.max_session_s, self.fail, too_long(limits.max_session_s))

    def _check_idle(self) -> None:
        limit = self.services.config.server.idle_timeout_s
        loop = asyncio.get_running_loop()
        if self._reading_done:
            return  # the caller finished sending; what is in flight finishes on its own
        due = self._last_input + limit
        if loop.time() < due:
            self._idle = loop.call_at(due, self._check_idle)  # messages came meanwhile
            return
        self.fail(SessionError(
            ErrorKind.TIMEOUT,
            f"no message from the caller for {limit:g} s (server.idle_timeout_s); send audio while the "
            "stream is open, or close it between turns and open a new one"))

    def _reader_done(self, reader: asyncio.Task, emitter: asyncio.Task) -> None:
        if reader.cancelled():
            return
        error = reader.exception()
        if error is not None:
            # Bad input ends the call at once: nothing more is sent.
            if not isinstance(error, SessionError):
                log.error("session %s: reader failed", self.spec.session_id, exc_info=error)
                error = SessionError(ErrorKind.INTERNAL, f"internal error ({type(error).__name__}); the server log "
                                                         "has the details")
            self.fail(error)
            return

        async def finish():
            with contextlib.suppress(asyncio.CancelledError):
                await emitter
                if self.conversation is not None:
                    await self.conversation.drain()
            self.outbox.put_nowait(_DONE)

        self.spawn(finish(), "finish")

    def end_input(self) -> None:
        """The caller's input ends here, as if it had hung up (the drain's end): the utterance in progress
        is cut and transcribed, what is in flight finishes, then `run` ends. What was heard is kept."""
        if self._reader is None or self._reader.done() or self._input_cut:
            return
        self._input_cut = True
        if self._awaiting_input:
            self._reader.cancel()  # `_read` takes this cancellation as the end of the input

    async def close(self) -> None:
        """Cancel everything this session started (idempotent)."""
        LIVE.discard(self)
        for timer in (self._idle, self._deadline):
            if timer is not None:
                timer.cancel()
        tasks = [t for t in self._tasks if not t.done()]  # (the conversation's replies among them: `spawn`)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------------ input

    async def _read(self, inputs: AsyncIterator[InputEvent]) -> None:
        loop = asyncio.get_running_loop()
        messages = aiter(inputs)
        while not self._input_cut:
            self._awaiting_input = True
            try:
                item = await anext(messages)
            except StopAsyncIteration:
                break
            except asyncio.CancelledError:
                if not self._input_cut:
                    raise
                asyncio.current_task().uncancel()  # end_input's: the input ends, the session goes on
                break
            finally:
                self._awaiting_input = False
            self._last_input = loop.time()
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
                        if self.tracker.pause is not None:
                            await self._maybe_end_turn()
            else:
                await self._control(item)
        self._reading_done = True
        for frame in self.decoder.flush():
            await self._segment_events(self.segmenter.push(frame))
        await self._segment_events(self.segmenter.flush())
        await self._turns.put(None)

    async def _control(self, item: InputEvent) -> None:
        if isinstance(item, (TalkStart, TalkEnd)):
            name = "talk_start" if isinstance(item, TalkStart) else "talk_end"
            if self.spec.segmentation.mode != "push_to_talk":
                raise invalid(f"control.{name} needs segmentation.mode PUSH_TO_TALK in the config")
            if isinstance(item, TalkStart) and self.segmenter.in_speech:
                raise invalid("control.talk_start came while already talking (a talk_start with no talk_end "
                              "yet); send talk_end to close the span first")
            if isinstance(item, TalkEnd) and not self.segmenter.in_speech:
                raise invalid("control.talk_end came without a talk_start; send talk_start, the audio, then "
                              "talk_end")
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
        elif isinstance(item, UserText):
            if self.conversation is None:
                raise invalid("text (typed user text) is only answered in Converse, which has an agent; "
                              "this session transcribes only")
            await self.conversation.on_text(item.text)
        elif isinstance(item, Dtmf):
            if item.digit not in DTMF_DIGITS:
                raise invalid(f"DTMF digit {item.digit!r} is not one of 0-9, *, #, A-D")
            if self.conversation is not None:
                await self.conversation.on_dtmf(item.digit)
        else:
            raise TypeError(f"a session takes voiced.core.events input events, not {type(item).__name__}")

    def _speaking(self) -> None:
        """The caller is speaking (called on every such frame)."""
        self._voiced_ms = max(self._voiced_ms, self.segmenter.voiced_ms)  # the turn's longest burst
        if self.conversation is not None:
            self._over_reply = self._over_reply or self.conversation.speaking()
            self.conversation.caller_speaking(self.segmenter.voiced_ms)
        decode = self.tracker.interim_due(self.spec.interim_results and self.spec.recognize)
        if decode is not None:
            self._start_interim(decode)

    async def _segment_events(self, events: list) -> None:
        for ev in events:
            if isinstance(ev, segmenter.SpeechStarted):
                self.tracker.started(ev.offset)
                self._voiced_ms = 0
                self._over_reply = False
                await self.send(SpeechStarted(self.spec.session_id, self.turn_id, ms(ev.offset)))
            elif isinstance(ev, segmenter.Paused):
                await self._act(self.tracker.paused())
            elif isinstance(ev, segmenter.Resumed):
                await self._act(self.tracker.resumed(ev.offset))
            elif isinstance(ev, segmenter.SpeechEnded):
                await self.send(SpeechEnded(self.spec.session_id, self.turn_id, ms(ev.offset)))
            elif isinstance(ev, Utterance):
                self._cancel_interim()
                self.services.metrics.utterances_total.inc()
                turn = Turn(self.turn_id, ev, time.monotonic())
                turn.over_reply = self._over_reply
                turn.backchannel = self._over_reply and self._voiced_ms < self.spec.barge_in_min_speech_ms
                pause = self.tracker.ended()
                if pause is not None:
                    # The turn ended in this pause (no voiced frame since): the transcript started at
                    # the pause is this turn's, unless it failed.
                    if pause.detect is not None and pause.detect is not asyncio.current_task():
                        pause.detect.cancel()
                    if not (pause.transcript.done() and (pause.transcript.cancelled()
                                                         or pause.transcript.exception() is not None)):
                        turn.task = pause.transcript
                    elif self.conversation is not None:
                        await self.conversation.cancel_speculation()
                self._drop_watched()
                if turn.task is None and self.spec.recognize and len(ev.audio):
                    turn.task = self.spawn(self._recognize(ev.audio, priority=1), f"asr-{turn.turn_id}")
                await self._turns.put(turn)

    # ------------------------------------------------------------------ recognition

    async def _recognize(self, audio: np.ndarray, priority: int, final: bool = True,
                         words: bool = False) -> Transcript:
        opts = recognition_options(self.spec.asr, len(audio), priority, final, words)
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
                await self.send(NoticeOut(self.spec.session_id, turn.turn_id, code, engine_error(e).message))
                continue
            if result.is_hallucination and not self.spec.keep_hallucinations:
                self.services.metrics.transcripts_dropped.inc()
                why = hallucination_reason(result, self.spec.asr)
                log.info("session %s turn %d: dropped %r as a likely hallucination (%s)", self.spec.session_id,
                         turn.turn_id, result.text, why)
                u = turn.utterance
                await self.send(TurnWithoutWords(self.spec.session_id, turn.turn_id, ms(u.start), ms(u.end),
                                                 result.text, why))
                continue
            if result.words and not self.spec.asr.word_timestamps:
                result = replace(result, words=[])  # read by the end-of-turn rule, not asked for
            latency = time.monotonic() - turn.ended_at
            self.services.metrics.asr_latency.observe(latency)
            u = turn.utterance
            result = in_caller_time(result, u)
            await self.send(TranscriptOut(self.spec.session_id, turn.turn_id, result, is_final=True,
                                          start_ms=ms(u.start), end_ms=ms(u.end), latency_ms=latency * 1000.0))
            if self.conversation is not None and result.text.strip() and not result.is_hallucination:
                await self.conversation.on_transcript(turn, result)

    def _start_interim(self, decode: Decode) -> None:
        """An interim decode of the turn (`TurnTracker.interim_due`): the caller's interim transcript, and,
        under smart turn detection, the words the tracker watches (`_words`)."""
        turn_id, start, smart = decode.turn_id, self.segmenter.speech_start, self.turn_model is not None

        async def interim():
            try:
                try:
                    # Smart: with word times (where the words end dates a pause the words find).
                    result = await self._recognize(decode.audio, priority=0, final=False, words=smart)
                except EngineError:
                    return  # an interim result is best effort; the final one reports errors
                if not self.tracker.current(decode):
                    return
                if smart:
                    await self._words(decode, result)
                if not result.is_hallucination:
                    self.tracker.interim_text = result.text
                    if self.spec.interim_results:
                        await self.send(TranscriptOut(self.spec.session_id, turn_id, replace(result, words=[]),
                                                      is_final=False, start_ms=ms(start),
                                                      end_ms=ms(self.segmenter.offset)))
            finally:
                self.tracker.interim_done(decode)  # (the next may start)

        self._interim = self.spawn(interim(), f"interim-{turn_id}")

    async def _words(self, decode: Decode, result: Transcript) -> None:
        """An interim decode's words to the tracker; the sound after words that stopped changing is decoded
        alone first (no answer: the words alone decide)."""
        acts = self.tracker.words(decode, result)
        if acts.decode is not None:
            alone = None
            with contextlib.suppress(EngineError):
                alone = await self._recognize(acts.decode.audio, priority=0, final=False)
            acts = self.tracker.alone(decode, alone)
        await self._act(acts)

    # ------------------------------------------------------------------ end of turn (smart)

    async def _act(self, acts: Actions) -> None:
        """Do what the tracker said: drop a pause speech ended, work out a new one."""
        if acts.drop is not None:
            await self._drop_pause(acts.drop)
        if acts.open is not None:
            self._open_pause(acts.open)

    def _open_pause(self, pause: Pause) -> None:
        """A pause: its transcript (the turn's, if it ends here) and the detector on it."""
        pause.opened = time.monotonic()
        if pause.result is None:  # a silence's: the transcript of the audio so far
            self._cancel_interim()  # (the tracker dropped it: the pause's transcript supersedes it)
            pause.transcript = self.spawn(self._recognize(pause.audio, priority=1, words=True),
                                          f"asr-{pause.turn_id}-pause")
            self._watch_words(pause)
        else:  # the words found it: the decode that did is its transcript
            pause.transcript = asyncio.get_running_loop().create_future()
            pause.transcript.set_result(pause.result)
            pause.decode_s = 0.0
        pause.detect = self.spawn(self._detect(pause), f"turn-{pause.turn_id}")

    def _watch_words(self, pause: Pause) -> None:
        """A pause's transcript counts among the turn's decodes too (`TurnTracker.pause_words`)."""
        def done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is None:
                self.tracker.pause_words(pause, t.result())

        pause.transcript.add_done_callback(done)

    async def _detect(self, pause: Pause) -> None:
        """Gather the evidence on this pause as it arrives (the audio model's answer, then the fresh
        transcript), end the turn as soon as it says so, and start the speculative reply."""
        p = None
        if self.bounds.audio_decides:  # (else its answer could not change the wait: not asked)
            loop = asyncio.get_running_loop()
            clip = model_clip(pause.audio, pause.audio_end, pause.voice_end)  # what the model hears
            t0 = time.monotonic()
            try:
                # onnxruntime releases the GIL: the model runs beside the loop, not in it.
                p = (await loop.run_in_executor(None, self.turn_model.predict, [clip]))[0]
            except Exception:  # the model is an aid: without its answer the words and the silence decide
                log.exception("session %s: the end-of-turn model failed", self.spec.session_id)
                p = 0.0  # "incomplete": finished words then wait `audio_ms`, not the upper bound
            pause.model_s = time.monotonic() - t0
            self.tracker.model_answer(pause, p)
            await self._maybe_end_turn()
            if self.tracker.pause is not pause:
                return
        try:
            result = await asyncio.shield(pause.transcript)
        except EngineError:
            return  # no words: the silence bound ends the turn; the final transcript reports the error
        if pause.decode_s is None:
            pause.decode_s = time.monotonic() - pause.opened
        text, wait_ms, verdict = self.tracker.transcript(pause, result)
        if log.isEnabledFor(logging.DEBUG):  # the arguments cost more than the line, at every pause
            log.debug("session %s turn %d pause%s: p=%s text=%r (last word p=%s, sentence end after it p=%s, "
                      "end-of-text p=%s) wait %d ms (%s)", self.spec.session_id, pause.turn_id,
                      " (words stopped)" if pause.stalled else "", "-" if p is None else f"{p:.2f}", text,
                      f"{result.words[-1].probability:.2f}" if result.words else "-",
                      "-" if result.stop_prob is None else f"{result.stop_prob:.2f}",
                      "-" if result.end_prob is None else f"{result.end_prob:.2f}", wait_ms, verdict)
            log.debug("session %s turn %d pause words (voice ended at %.2f s): %s", self.spec.session_id,
                      pause.turn_id, pause.speech_end_s,
                      " ".join(f"{w.word}[{w.start_s:.2f}-{w.end_s:.2f} p{w.probability:.2f}]" for w in result.words))
        if self.conversation is not None and text.strip() and wait_ms < self.bounds.max_ms:
            self.conversation.speculate(pause.turn_id, text)
        await self._maybe_end_turn()

    async def _maybe_end_turn(self) -> None:
        if self.tracker.over():
            self._turn_timing(self.tracker.pause)
            await self._segment_events(self.segmenter.end_turn())

    def _turn_timing(self, pause: Pause) -> None:
        """Where an ended turn's time went: the decode (ASR speed: ~20 ms on a GPU, hundreds on a CPU),
        the audio model, and the rule's own wait after both (the silence bound)."""
        now, silence_ms = time.monotonic(), self.tracker.silence_ms(pause)
        decode = pause.decode_s if pause.decode_s is not None else now - pause.opened
        ready = max(decode, pause.model_s or 0.0)
        metrics = self.services.metrics
        metrics.turn_decode.observe(decode)
        metrics.turn_decision.observe(max(0.0, now - pause.opened - ready))
        log.debug("session %s turn %d ended %d ms after the voice%s: pause noticed at %d ms, decode %.0f ms, "
                  "audio model %.0f ms, then the rule waited %.0f ms", self.spec.session_id, pause.turn_id,
                  silence_ms, " (words stopped)" if pause.stalled else "",
                  (pause.audio_end - pause.voice_end) * 1000 // segmenter.RATE, decode * 1000,
                  (pause.model_s or 0.0) * 1000, max(0.0, now - pause.opened - ready) * 1000)

    async def _drop_pause(self, pause: Pause) -> None:
        """Speech came back: nothing worked out in the pause may reach the caller."""
        if pause.detect is not None:
            pause.detect.cancel()
        if self.conversation is not None:
            await self.conversation.cancel_speculation()
        if pause.gap:
            pause.transcript.cancel()  # a gap between words, not a pause
        elif not pause.stalled:
            # Was the sound after it the caller, or something the VAD calls speech (hold music)? Its
            # transcript goes on: its words count among the turn's decodes (`_watch_words`).
            self._watched.append(pause.transcript)

    def _drop_watched(self) -> None:
        """The turn ended: the transcripts of its earlier pauses that went on for their words can change
        nothing now (`_watch_words` reads only the turn in progress), so they are cancelled. Left running,
        they held a batch that every caller shares: where the ASR cannot keep up (a busy CPU), a turn's
        end and a caller's hang-up waited behind each of them (docs/BENCHMARKS.md, session 12)."""
        for transcript in self._watched:
            transcript.cancel()
        self._watched.clear()

    def _cancel_interim(self) -> None:
        if self._interim is not None and not self._interim.done():
            self._interim.cancel()
        self._interim = None
