"""The speaking half of a Converse session: agent replies spoken back, and barge-in.

Each final transcript goes to the session's agent; each piece of its answer is spoken with the
session's voice, and the audio leaves in the caller's output format chunk by chunk while the TTS
engine is still writing it. Replies are spoken one after another. Caller speech that lasts at
least the barge-in minimum cancels the reply in flight at once: its TTS request is cancelled
(freeing its batch slot), no further chunk of it is sent, and REPLY_INTERRUPTED says how much
audio went out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, replace

import grpc
from voiced_client.proto import voiced_pb2 as pb

from voiced.core.agents import AgentError
from voiced.audio.ingest import RATE, Format, FrameEncoder, int16_to_float
from voiced.engines.base import CapacityError, EngineError, TTSRequest
from voiced.wire import SessionError, audio_format, invalid, tts_options

log = logging.getLogger(__name__)


@dataclass
class Reply:
    reply_id: int
    turn_id: int
    ended_at: float | None  # end of the caller's speech this answers (None: a Speak control)
    text: str | None = None  # fixed text (Speak); None: ask the agent
    question: str = ""


class Conversation:
    def __init__(self, session):
        self.session = session
        self.services = session.services
        self.spec = session.spec
        self.agent = self.services.agents.create(self.spec.agent, self.spec.system_prompt)
        self._queue: asyncio.Queue[Reply] = asyncio.Queue()
        self._worker: asyncio.Task | None = None
        self._current: asyncio.Task | None = None  # the reply being spoken
        self._current_reply: Reply | None = None
        self._sent_samples = 0  # of the current reply, in the caller's output format and rate
        self._reply_ids = 0
        self._interrupted: dict[int, int] = {}  # reply id -> caller audio time (ms) of the cut

    def tasks(self) -> list[asyncio.Task]:
        return [t for t in (self._worker, self._current) if t is not None and not t.done()]

    # ------------------------------------------------------------------ inputs

    async def on_transcript(self, turn, transcript) -> None:
        if self.agent is None:
            return  # client-driven: the caller decides what to say
        self._enqueue(Reply(self._next_id(), turn.turn_id, turn.ended_at, question=transcript.text))

    async def control(self, control: pb.Control) -> None:
        kind = control.WhichOneof("event")
        if kind == "speak":
            text = control.speak.text.strip()
            if not text:
                raise invalid("control.speak.text is empty; send the text to say")
            self._enqueue(Reply(self._next_id(), self.session.turn_id, None, text=text))
        elif kind == "stop_speaking":
            await self.interrupt()

    def caller_speaking(self, speech_ms: int) -> None:
        """Called for every frame of caller speech; barge-in once it lasts long enough."""
        if (self.spec.barge_in and speech_ms >= self.spec.barge_in_min_speech_ms
                and self._current is not None and not self._current.done()):
            self.services.metrics.barge_ins.inc()
            # Cancel synchronously, on this very frame: no chunk is sent after this point.
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
        self._queue.put_nowait(reply)
        if self._worker is None:
            self._worker = self.session.spawn(self._speak_replies(), "replies")

    def _cancel_current(self) -> None:
        # Cancelling the task stops it at its current await, so not one more chunk of this reply
        # reaches the outbox; REPLY_INTERRUPTED follows once the task has unwound.
        if self._current is not None and not self._current.done() and self._current_reply is not None:
            self._interrupted[self._current_reply.reply_id] = self.session.segmenter.offset * 1000 // RATE
            self._current.cancel()

    async def _speak_replies(self) -> None:
        while True:
            reply = await self._queue.get()
            try:
                self._current_reply = reply
                self._sent_samples = 0
                self._current = asyncio.create_task(self._speak(reply), name=f"reply-{reply.reply_id}")
                try:
                    await self._current
                except asyncio.CancelledError:
                    if reply.reply_id not in self._interrupted:
                        raise  # the session is closing, not a barge-in
                except Exception as e:  # a bug in one reply must not silence the session
                    log.exception("session %s: reply %d failed", self.spec.session_id, reply.reply_id)
                    await self.session.send(self._event(reply, notice=pb.Notice(
                        code="REPLY_FAILED", message=f"internal error while speaking: {e}")))
                if reply.reply_id in self._interrupted:
                    cut_at = self._interrupted.pop(reply.reply_id)
                    await self.session.send(self._event(reply, reply=pb.ReplyEvent(
                        type=pb.ReplyEvent.REPLY_INTERRUPTED, reply_id=reply.reply_id,
                        audio_sent_ms=self._sent_ms(), caller_offset_ms=cut_at)))
            finally:
                self._current = None
                self._current_reply = None
                self._queue.task_done()

    def _sent_ms(self) -> int:
        return self._sent_samples * 1000 // self.spec.output.sample_rate

    def _event(self, of: Reply, **kwargs) -> pb.SessionEvent:
        return pb.SessionEvent(session_id=self.spec.session_id, turn_id=of.turn_id, **kwargs)

    async def _speak(self, reply: Reply) -> None:
        send = self.session.send
        started = False
        sequence = 0
        first_sent: float | None = None  # when the first chunk left
        encoder = FrameEncoder(self.spec.output)
        metrics = self.services.metrics
        try:
            async for piece, last_piece in _pieces(self._texts(reply)):
                if reply.text is None:
                    await send(self._event(reply, agent_text=pb.AgentText(
                        text=piece, last=last_piece,
                        latency_ms=_since(reply.ended_at) if sequence == 0 and not started else 0.0)))
                    if not started and reply.ended_at is not None:
                        metrics.agent_latency.observe(_since(reply.ended_at) / 1000)
                if not started:
                    await send(self._event(reply, reply=pb.ReplyEvent(
                        type=pb.ReplyEvent.REPLY_STARTED, reply_id=reply.reply_id, text=piece)))
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
                        await send(self._event(reply, audio=pb.AudioChunk(
                            reply_id=reply.reply_id, sequence=sequence,
                            offset_ms=self._sent_ms(), last=last, audio=data,
                            latency_ms=latency)))
                        if first_sent is None:
                            first_sent = time.monotonic()
                        sequence += 1
                        self._sent_samples += len(data) // self.spec.output.bytes_per_sample
            if started:
                # Audio leaves faster than real time; the caller is still hearing the reply until
                # it has played, so the reply (and barge-in on it) lasts until then.
                if first_sent is not None:
                    await asyncio.sleep(max(0.0, first_sent + self._sent_ms() / 1000 - time.monotonic()))
                await send(self._event(reply, reply=pb.ReplyEvent(
                    type=pb.ReplyEvent.REPLY_FINISHED, reply_id=reply.reply_id,
                    audio_sent_ms=self._sent_ms(),
                    caller_offset_ms=self.session.segmenter.offset * 1000 // RATE)))
        except AgentError as e:
            await send(self._event(reply, notice=pb.Notice(code=e.code, message=str(e))))
        except EngineError as e:
            code = "TTS_BUSY" if isinstance(e, CapacityError) else "TTS_FAILED"
            await send(self._event(reply, notice=pb.Notice(code=code, message=str(e))))

    async def _texts(self, reply: Reply):
        if reply.text is not None:
            yield reply.text
            return
        async for piece in self.agent.reply(reply.question):
            if piece.strip():
                yield piece.strip()


async def _pieces(texts):
    """Pairs each piece with whether it is the last (one piece of look-ahead)."""
    previous = None
    async for piece in texts:
        if previous is not None:
            yield previous, False
        previous = piece
    if previous is not None:
        yield previous, True


def _since(t: float | None) -> float:
    return (time.monotonic() - t) * 1000.0 if t is not None else 0.0


# ---------------------------------------------------------------------------- one-shot RPCs


async def synthesize_events(services, request: pb.SynthesizeRequest):
    text = request.text.strip()
    if not text:
        raise invalid("text is empty; send the text to speak")
    fmt = audio_format(request.output_format, "output_format") if request.HasField("output_format") else Format(
        "LINEAR16", RATE)
    opts = tts_options(request.speech, services.config)
    encoder = FrameEncoder(fmt)
    sent = 0
    try:
        async with contextlib.aclosing(services.tts.stream(TTSRequest(text, opts))) as chunks:
            async for chunk in chunks:
                yield pb.AudioChunk(sequence=chunk.sequence, offset_ms=sent * 1000 // RATE, last=chunk.last,
                                    audio=encoder.encode(chunk.samples, last=chunk.last))
                sent += len(chunk.samples)
    except CapacityError as e:
        raise SessionError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from None
    except EngineError as e:
        raise SessionError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None


def list_voices(services) -> pb.ListVoicesResponse:
    return pb.ListVoicesResponse(voices=[
        pb.Voice(name=v.name, kind=v.kind, description=v.description) for v in services.voices.list()
    ])


async def add_voice(services, request: pb.AddVoiceRequest) -> pb.Voice:
    from voiced.server import _clip_audio

    name = request.name.strip()
    if not name:
        raise invalid("name is empty; give the voice a name")
    if not request.transcript.strip():
        raise invalid("transcript is empty; send what is said in the recording")
    pcm, duration = _clip_audio(request.audio, request.format if request.HasField("format") else None)
    if duration < 1.0:
        raise invalid(f"the recording is {duration:.2f} s long; send at least 1 s (3 to 10 s is best)")
    try:
        voice = await asyncio.to_thread(services.voices.add, name, int16_to_float(pcm), request.transcript.strip())
    except (ValueError, EngineError) as e:
        raise invalid(str(e)) from None
    return pb.Voice(name=voice.name, kind=voice.kind, description=voice.description)

