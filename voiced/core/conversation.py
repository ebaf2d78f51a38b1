"""The speaking half of a Converse session: agent replies spoken back, and barge-in.

Each final transcript, each piece of typed user text (UserText), and each DTMF key (for agents that
take them) goes to the session's agent; each piece of its answer is spoken with the session's voice,
and the audio leaves in the caller's output format chunk by chunk while the TTS engine is still
writing it (a server without TTS sends the answer's text alone). Replies are spoken one
after another. Caller speech over a reply is judged by its words (voiced.core.overtalk: the burst is
decoded through the session's ASR as it goes and when the voice pauses): a stop request ("stop", "no",
"wait", "hold on") cancels the reply in flight as soon as its decode lands, however short; an
acknowledgement ("mm hmm", "okay", "I see") lets it go on however long, and is not answered; other
words, or none (a cough), cancel it once the burst lasts the barge-in minimum (`barge_in.min_speech_ms`,
counted to the caller's last voiced frame) and a decode of that much says it is no acknowledgement
(without a decode: at once; a decode later than `overtalk.WORDS_WAIT_MS` more talk is not waited for). Cancelling frees the reply's TTS batch slot, no further chunk of it is
sent, and ReplyInterrupted says how much audio went out. An agent that ends the call gets its last words spoken; then
the session emits HangupOut and ends.

Speculative replies: while smart turn detection waits out a pause whose words look finished, an agent
that declares it safe (`speculative = True`: answering has no side effect, and `rollback()` forgets a
reply) is asked already, and its answer is spoken into a holding list. The instant the turn is
confirmed with the same words, what is held goes out and the reply goes on live; if the caller speaks
again first, it is cancelled and rolled back, and nothing of it reaches the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from dataclasses import dataclass, replace

from voiced.audio.ingest import FrameEncoder, ms
from voiced.core import overtalk
from voiced.core.agents import AgentError, EndCall
from voiced.core.errors import ErrorKind, SessionError, engine_error
from voiced.core.events import AgentTextOut, AudioOut, NoticeOut, ReplyFinished, ReplyInterrupted, ReplyStarted
from voiced.core.spec import check_text, check_user_text
from voiced.core.speech import check_voice
from voiced.engines.base import CapacityError, EngineError, TTSRequest

log = logging.getLogger(__name__)


@dataclass
class Reply:
    reply_id: int
    turn_id: int
    ended_at: float | None  # end of the caller's speech this answers (None: a Speak, typed text or a key)
    text: str | None = None  # fixed text (Speak); None: ask the agent
    question: str = ""
    digit: str | None = None  # a DTMF key for the agent's on_dtmf
    end_call: str | None = None  # set when the agent ended the call in this reply: the reason
    held: Held | None = None  # a speculative reply: what it sends waits here until the turn is confirmed
    task: asyncio.Task | None = None  # a speculative reply's task, already running


@dataclass
class Burst:
    """Caller speech over a reply, one turn's: what its decodes said so far (voiced.core.overtalk)."""
    turn_id: int
    voiced_ms: int = 0  # the longest burst of talk so far (to its last voiced frame)
    kind: overtalk.Kind | None = None  # what the latest decode's words ask for (None: not decoded yet)
    decoded_ms: int = -1  # how much talk the latest decode heard
    decoded_to: int = 0  # the stream sample where the voice had reached at the latest decode
    next_ms: int = overtalk.FIRST_MS  # talk at which the next decode is due while the voice goes on
    task: asyncio.Task | None = None  # the decode in flight
    failed: bool = False  # a decode failed: the length alone decides
    long_since: int | None = None  # the stream sample where the talk reached the barge-in minimum


class Held:
    """A speculative reply's output, held back until the turn it answers is confirmed."""

    def __init__(self, send):
        self._send = send  # the session's
        self._events: list = []
        self.released = asyncio.Event()
        self.released_at = 0.0

    async def send(self, event) -> None:
        if self.released.is_set():
            await self._send(event)
        else:
            self._events.append(event)

    async def release(self, ended_at: float, metrics) -> None:
        """Send what is held, in order; the latencies it carries are counted from the confirmed end of
        the turn (what the caller waited), not from the pause."""
        self.released_at = time.monotonic()
        texts = audios = 0
        for event in self._events:
            if isinstance(event, AgentTextOut) and texts == 0:
                texts += 1
                event = replace(event, latency_ms=_since(ended_at))
                metrics.agent_latency.observe(event.latency_ms / 1000)
            elif isinstance(event, AudioOut) and audios == 0:
                audios += 1
                event = replace(event, latency_ms=_since(ended_at))
                metrics.voice_to_voice.observe(event.latency_ms / 1000)
            await self._send(event)
        self._events.clear()
        self.released.set()


class Conversation:
    def __init__(self, session):
        # The session owns its conversation; the way back is weak, so that nothing of a finished call is
        # left in a reference cycle for the collector (see `Session.spawn`)
        self._session = weakref.ref(session)
        self.services = session.services
        self.spec = session.spec
        if self.services.tts is not None:
            check_voice(self.services, self.spec.tts.voice, "speech.voice")
        try:
            self.agent = self.services.agents.create(self.spec.agent, self.spec.system_prompt)
        except Exception as e:  # a plug-in's bug refuses this call, not the server
            log.exception("agent %r could not be created", self.spec.agent)
            raise SessionError(ErrorKind.INTERNAL, f"the agent {self.spec.agent!r} could not be started "
                                                   f"({type(e).__name__}: {e})") from None
        self._queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._worker: asyncio.Task | None = None
        self._current: asyncio.Task | None = None  # the reply being spoken
        self._current_reply: Reply | None = None
        self._sent_samples = 0  # of the current reply, in the caller's output format and rate
        self._reply_ids = 0
        self._interrupted: dict[int, int] = {}  # reply id -> caller audio time (ms) of the cut
        self._speculation: Reply | None = None  # a reply prepared during a pause (module docstring)
        self._burst: Burst | None = None  # caller speech over the reply in the current turn

    @property
    def session(self):
        return self._session()

    # ------------------------------------------------------------------ inputs

    async def on_transcript(self, turn, transcript) -> None:
        if self.agent is None:
            return  # client-driven: the caller decides what to say
        if turn.over_reply and self._backchannel(turn, transcript):
            log.debug("session %s turn %d: %r over the reply is a backchannel, not answered",
                      self.spec.session_id, turn.turn_id, transcript.text)
            await self.cancel_speculation()
            return
        spec = self._speculation
        if spec is not None and spec.turn_id == turn.turn_id and spec.question == transcript.text:
            self._speculation = None
            spec.ended_at = turn.ended_at
            self._reply_ids = spec.reply_id
            self._queue.put_nowait(spec)
            self._start_worker()
            return
        await self.cancel_speculation()
        self._enqueue(Reply(self._next_id(), turn.turn_id, turn.ended_at, question=transcript.text))

    def speculate(self, turn_id: int, text: str) -> None:
        """Prepare the answer to `text` while the turn's end is not yet confirmed (module docstring):
        only for an agent that declares it safe, and only when nothing else is being said."""
        if (self.agent is None or not getattr(self.agent, "speculative", False) or self.speaking()
                or not self._queue.empty() or self._speculation is not None):
            return
        reply = Reply(self._reply_ids + 1, turn_id, None, question=text)  # the id it takes if confirmed
        reply.held = Held(self.session.send)
        reply.task = self.session.spawn(self._speak(reply), f"reply-{reply.reply_id}-speculative")
        self._speculation = reply

    async def cancel_speculation(self) -> None:
        """The caller spoke again (or the turn's words differ): drop the prepared reply, unsent, and
        let the agent forget it."""
        reply, self._speculation = self._speculation, None
        if reply is None:
            return
        reply.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reply.task  # the agent's own clean-up runs before it rolls back
        rollback = getattr(self.agent, "rollback", None)
        if rollback is not None:
            rollback()

    def speaking(self) -> bool:
        """A reply is being spoken (or played out) now."""
        return self._current is not None and not self._current.done()

    async def on_text(self, text: str) -> None:
        """Typed user text: answered by the agent on the same path as a final transcript."""
        text = check_user_text(text, "text")
        if self.agent is None:
            await self.session.send(NoticeOut(
                self.spec.session_id, self.session.turn_id, "NO_AGENT",
                f"the agent {self.spec.agent!r} does not answer by itself, so typed text gets no reply; "
                "choose another agent, or send what to say with speak"))
            return
        self._enqueue(Reply(self._next_id(), self.session.turn_id, None, question=text))

    async def speak(self, text: str) -> None:
        text = check_text(text, "speak.text")
        self._enqueue(Reply(self._next_id(), self.session.turn_id, None, text=text))

    async def on_dtmf(self, digit: str) -> None:
        if self.agent is None or not hasattr(self.agent, "on_dtmf"):
            log.debug("session %s: key %s ignored (the agent takes no keys)", self.spec.session_id, digit)
            return
        if self.spec.barge_in:
            self._cancel_current()  # a key press interrupts the prompt, as on any phone menu
        self._enqueue(Reply(self._next_id(), self.session.turn_id, None, digit=digit))

    def caller_speaking(self, speech_ms: int) -> None:
        """Called for every frame of caller speech with how long the caller has talked (to the last
        voiced frame); barge-in once the words, or the length, say so (module docstring)."""
        if not (self.spec.barge_in and self.speaking()):
            return
        turn_id = self.session.turn_id
        if self._burst is None or self._burst.turn_id != turn_id:
            self._burst = Burst(turn_id)
        burst = self._burst
        burst.voiced_ms = max(burst.voiced_ms, speech_ms)
        if burst.long_since is None and burst.voiced_ms >= self.spec.barge_in_min_speech_ms:
            burst.long_since = self.session.segmenter.offset
        if self._reads_words():
            self._maybe_decode(burst)
        self._judge(burst)

    def _backchannel(self, turn, transcript) -> bool:
        """Whether a turn said over a reply is a backchannel (transcribed, not answered): its words are an
        acknowledgement, or, words aside, it was shorter than the barge-in minimum (`turn.backchannel`). A
        stop request is answered: the agent hears what the caller wanted."""
        kind = overtalk.classify(transcript.text, transcript.language or self.spec.asr.language)
        burst = self._burst if self._burst is not None and self._burst.turn_id == turn.turn_id else None
        if kind is overtalk.Kind.STOP or (burst is not None and burst.kind is overtalk.Kind.STOP):
            return False
        return kind is overtalk.Kind.ACK or turn.backchannel

    def _reads_words(self) -> bool:
        language = self.spec.asr.language
        return self.spec.recognize and (language is None or overtalk.covered(language))

    def _maybe_decode(self, burst: Burst) -> None:
        """Decode the burst when the voice pauses (a word may have ended), every `overtalk.EVERY_MS` of
        talk while it goes on, and once it reaches the barge-in minimum: one decode at a time."""
        if burst.failed or (burst.task is not None and not burst.task.done()):
            return
        seg = self.session.segmenter
        paused = seg.silence_ms >= overtalk.GAP_MS and seg.voiced_end > burst.decoded_to
        minimum = burst.voiced_ms >= self.spec.barge_in_min_speech_ms > burst.decoded_ms
        if not (paused or minimum or burst.voiced_ms >= burst.next_ms):
            return
        burst.next_ms = burst.voiced_ms + overtalk.EVERY_MS
        burst.decoded_to = seg.voiced_end
        burst.task = self.session.spawn(self._decode(burst, seg.current_audio(), burst.voiced_ms),
                                        f"overtalk-{burst.turn_id}")

    async def _decode(self, burst: Burst, audio, voiced_ms: int) -> None:
        try:
            # The latency-bound priority of a turn's transcript: the reply waits on these words.
            result = await self.session._recognize(audio, priority=1, final=False)
        except EngineError:
            burst.failed = True  # no words: the length decides, as without a decoder
        else:
            text = "" if result.is_hallucination else result.text
            burst.kind = overtalk.classify(text, result.language or self.spec.asr.language)
            burst.decoded_ms = voiced_ms
            log.debug("session %s turn %d: over the reply after %d ms of talk: %r (%s)", self.spec.session_id,
                      burst.turn_id, voiced_ms, result.text, burst.kind.value)
        self._judge(burst)

    def _judge(self, burst: Burst) -> None:
        if not (self.spec.barge_in and self.speaking()):
            return
        decoded = burst.decoded_ms if self._reads_words() and not burst.failed else None
        since = self.session.segmenter.offset if burst.long_since is None else burst.long_since
        waited = ms(self.session.segmenter.offset - since)
        if overtalk.decide(burst.kind, burst.voiced_ms, self.spec.barge_in_min_speech_ms, decoded, waited) \
                is not overtalk.Action.STOP:
            return
        self.services.metrics.barge_ins.inc()
        # Cancel synchronously, on this very frame (or decode): no chunk is sent after this point.
        self._cancel_current()

    async def drain(self) -> None:
        """End of the caller's stream: finish speaking what is queued."""
        if self._worker is not None:
            await self._queue.join()

    async def interrupt(self) -> None:
        self._cancel_current()

    # ------------------------------------------------------------------ speaking

    def _next_id(self) -> int:
        self._reply_ids += 1
        return self._reply_ids

    def _enqueue(self, reply: Reply) -> None:
        if self._speculation is not None:
            # Something else is to be said first; the prepared reply would take its id. (Rare: a
            # control or a key during the pause. The reply is asked again once the turn ends.)
            spec, self._speculation = self._speculation, None
            spec.task.cancel()
            rollback = getattr(self.agent, "rollback", None)
            if rollback is not None:
                spec.task.add_done_callback(lambda _: rollback())
        self._queue.put_nowait(reply)
        self._start_worker()

    def _start_worker(self) -> None:
        if self._worker is None:
            self._worker = self.session.spawn(self._speak_replies(), "replies")

    def _cancel_current(self) -> None:
        # Cancelling the task stops it at its current await, so not one more chunk of this reply
        # reaches the outbox; ReplyInterrupted follows once the task has unwound.
        if self.speaking() and self._current_reply is not None:
            self._interrupted[self._current_reply.reply_id] = ms(self.session.segmenter.offset)
            self._current.cancel()

    async def _speak_replies(self) -> None:
        sid = self.spec.session_id
        while True:
            reply = await self._queue.get()
            try:
                self._current_reply = reply
                if reply.task is not None:  # a speculative reply, confirmed: out with what it holds
                    self._current = reply.task
                    await reply.held.release(reply.ended_at, self.services.metrics)
                else:
                    self._sent_samples = 0
                    self._current = self.session.spawn(self._speak(reply), f"reply-{reply.reply_id}")
                try:
                    await self._current
                except asyncio.CancelledError:
                    if reply.reply_id not in self._interrupted:
                        raise  # the session is closing, not a barge-in
                except Exception:  # a bug in one reply must not silence the session
                    log.exception("session %s: reply %d failed", sid, reply.reply_id)
                    await self.session.send(NoticeOut(sid, reply.turn_id, "REPLY_FAILED",
                                                      "internal error while speaking; the server log has the "
                                                      "details"))
                if reply.reply_id in self._interrupted:
                    cut_at = self._interrupted.pop(reply.reply_id)
                    await self.session.send(ReplyInterrupted(sid, reply.turn_id, reply.reply_id,
                                                             self._sent_ms(), cut_at))
            finally:
                self._current = None
                self._current_reply = None
                self._queue.task_done()
            if reply.end_call is not None:
                await self.session.hangup(reply.turn_id, reply.end_call)
                return

    def _sent_ms(self) -> int:
        return ms(self._sent_samples, self.spec.output.sample_rate)

    async def _speak(self, reply: Reply) -> None:
        send = reply.held.send if reply.held is not None else self.session.send
        if reply.held is not None:
            self._sent_samples = 0  # speculation runs only while no other reply is being spoken
        sid, turn_id, reply_id = self.spec.session_id, reply.turn_id, reply.reply_id
        started = False
        sequence = 0
        first_sent: float | None = None  # when the first chunk left
        encoder = FrameEncoder(self.spec.output)
        metrics = self.services.metrics
        try:
            async for piece, last_piece in _pieces(self._texts(reply)):
                if reply.text is None:
                    await send(AgentTextOut(
                        sid, turn_id, piece, last_piece,
                        latency_ms=_since(reply.ended_at) if sequence == 0 and not started else 0.0))
                    if not started and reply.ended_at is not None:
                        metrics.agent_latency.observe(_since(reply.ended_at) / 1000)
                if not started:
                    await send(ReplyStarted(sid, turn_id, reply_id, piece))
                    started = True
                if self.services.tts is None:
                    continue  # listening-only server: the agent's text is the reply
                requested = time.monotonic()
                request = TTSRequest(piece, replace(self.spec.tts, priority=1 if sequence == 0 else 0))
                async with contextlib.aclosing(self.services.tts.stream(request)) as chunks:
                    async for chunk in chunks:
                        last = chunk.last and last_piece
                        data = encoder.encode(chunk.samples, last=last)
                        latency = 0.0
                        if sequence == 0:
                            metrics.tts_first_chunk.observe(time.monotonic() - requested)
                            if reply.ended_at is not None:
                                latency = _since(reply.ended_at)
                                metrics.voice_to_voice.observe(latency / 1000)
                        await send(AudioOut(sid, turn_id, reply_id, sequence, self._sent_ms(), last, data,
                                            latency_ms=latency))
                        if first_sent is None:
                            first_sent = time.monotonic()
                        sequence += 1
                        self._sent_samples += len(data) // self.spec.output.bytes_per_sample
            if started:
                if reply.held is not None:
                    await reply.held.released.wait()  # playback starts when the caller gets it
                    first_sent = max(first_sent or 0.0, reply.held.released_at) if first_sent else None
                # Audio leaves faster than real time; the caller is still hearing the reply until
                # it has played, so the reply (and barge-in on it) lasts until then.
                if first_sent is not None:
                    await asyncio.sleep(max(0.0, first_sent + self._sent_ms() / 1000 - time.monotonic()))
                await send(ReplyFinished(sid, turn_id, reply_id, self._sent_ms(), ms(self.session.segmenter.offset)))
        except AgentError as e:
            await send(NoticeOut(sid, turn_id, e.code, str(e)))
        except EngineError as e:
            code = "TTS_BUSY" if isinstance(e, CapacityError) else "TTS_FAILED"
            await send(NoticeOut(sid, turn_id, code, engine_error(e).message))

    async def _texts(self, reply: Reply):
        """The reply's text pieces; an EndCall from the agent (yielded or raised) ends them and marks
        the reply as the last of the call."""
        if reply.text is not None:
            yield reply.text
            return
        name = self.spec.agent
        timeout = self.services.config.agent.reply_timeout_s or None
        pieces = None
        try:
            pieces = self.agent.on_dtmf(reply.digit) if reply.digit is not None else self.agent.reply(reply.question)
            while True:
                try:
                    # The agent's own await is cancelled at the timeout, so it can clean up.
                    piece = await _within(anext(pieces), timeout)
                except StopAsyncIteration:
                    return
                if isinstance(piece, EndCall):
                    reply.end_call = piece.reason
                    return
                if not isinstance(piece, str):
                    raise TypeError(f"the agent yielded a {type(piece).__name__}, not text")
                if piece.strip():
                    yield piece.strip()
        except EndCall as e:
            reply.end_call = e.reason
        except asyncio.TimeoutError:
            raise AgentError("AGENT_TIMEOUT", f"the agent {name!r} gave no answer within {timeout:g} s "
                                              "(agent.reply_timeout_s); the call goes on") from None
        except (AgentError, asyncio.CancelledError):
            raise
        except Exception as e:  # a plug-in's bug fails this reply, not the call or the server
            log.exception("session %s: agent %r failed", self.spec.session_id, name)
            raise AgentError("AGENT_FAILED", f"the agent {name!r} failed ({type(e).__name__}: {e}); "
                                             "the call goes on") from None
        finally:
            aclose = getattr(pieces, "aclose", None)  # let the agent's own clean-up run now
            if aclose is not None:
                await aclose()


async def _pieces(texts):
    """Pairs each piece with whether it is the last (one piece of look-ahead)."""
    previous = None
    async for piece in texts:
        if previous is not None:
            yield previous, False
        previous = piece
    if previous is not None:
        yield previous, True


async def _within(awaitable, timeout: float | None):
    """`await awaitable` with a timeout (asyncio.TimeoutError past it). Not asyncio.wait_for before
    Python 3.12: when the awaitable finishes in the same loop turn as the reply is cancelled (an agent
    that answers at once, a barge-in or a hang-up), wait_for returns its result and drops the
    cancellation, and the reply goes on speaking to a session that has ended."""
    if timeout is None:
        return await awaitable
    if hasattr(asyncio, "timeout"):  # Python 3.11+
        async with asyncio.timeout(timeout):
            return await awaitable
    return await asyncio.wait_for(awaitable, timeout)


def _since(t: float | None) -> float:
    return (time.monotonic() - t) * 1000.0 if t is not None else 0.0
