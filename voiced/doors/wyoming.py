"""The Wyoming door: speech-to-text and text-to-speech for Home Assistant (and any Wyoming client).

Home Assistant's Wyoming integration opens one TCP connection per request and speaks JSON-lines
events with PCM payloads (the `wyoming` package frames them; we use it on both ends of the tests):

    describe                                  -> info (ASR: the Whisper model and its languages;
                                                 TTS: every voice, presets and cloned)
    transcribe? audio-start audio-chunk* audio-stop
                                              -> transcript-start transcript-chunk* transcript
                                                 transcript-stop
    synthesize                                -> audio-start audio-chunk* audio-stop
    synthesize-start synthesize-chunk* [synthesize] synthesize-stop
                                              -> audio-start audio-chunk* audio-stop synthesize-stopped

Recognition runs a push-to-talk session of the shared core (audio-start opens the utterance,
audio-stop closes it: Home Assistant has already found the end of speech), so it shares the
engines, batching and session limit with every other door. Audio of any rate, width and channel
count is converted as it arrives (voiced.audio.pcm), so after audio-stop only the recognition
itself remains. Speech is synthesized sentence by sentence and each engine chunk is sent as it is
made; in the streaming form a sentence is spoken as soon as its text has arrived.

Each recognition or synthesis holds one place of `server.max_sessions`. A refusal, a bad event or a
failure is answered with the protocol's `error` event (`code` = the core's ErrorKind) and ends that
connection only. So does a caller that stops reading: what waits for it is bounded by
`server.max_outbound_bytes` (a recognition's through its session, a synthesis's through
voiced.core.outbound.deliver), and past it the request ends with `over_capacity`, giving its place back.

What a caller may make the door read is bounded before it is read (`read_event`; Wyoming has no
authentication, and a header declaring a 1 GB payload once made the daemon read all of it): a header line
of at most 64 KiB, `data_length` and `payload_length` at most `server.max_message_bytes` (over it: `error`,
code `bad_input`, and the connection closes without reading the rest), the event's bytes within
`server.handshake_timeout_s` of its first, the first event within that too, and the next within
`server.idle_timeout_s` while no request of the connection is in progress (`error`, code `timeout`).
Audio is read no faster than the recognition takes it (a queue of a few chunks), and one audio stream
holds at most `MAX_STREAM_S` of audio. Connections count against `server.max_connections[_per_door]`
(over them: `error`, code `over_capacity`, then close).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from wyoming.asr import Transcribe, Transcript, TranscriptChunk, TranscriptStart, TranscriptStop
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.info import AsrModel, AsrProgram, Attribution, Describe, Info, SelectProgram, TtsProgram, TtsVoice
from wyoming.ping import Ping, Pong
from wyoming.server import AsyncEventHandler
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

import voiced
from voiced.audio.ingest import RATE, AudioFormatError, Format
from voiced.audio.pcm import PcmConverter
from voiced.core.errors import ErrorKind, SessionError, invalid
from voiced.core.events import AudioIn, NoticeOut, TalkEnd, TalkStart, TranscriptOut
from voiced.core.outbound import EVENT_BYTES, deliver
from voiced.core.session import Session
from voiced.core.spec import check_language, segmentation_for, tts_options_for
from voiced.core.speech import MAX_CLIP_S, list_voices, synthesize
from voiced.doors.guard import connections, cut
from voiced.doors.shared import DoorError, last_words, loads, split_address
from voiced.text import SentenceBuffer

log = logging.getLogger(__name__)

FRONT = "wyoming"
PROGRAM = "voiced"
PCM16K = Format("LINEAR16", RATE)
OUT_WIDTH, OUT_CHANNELS = 2, 1  # what the engines' audio leaves as: 16 kHz 16-bit mono
LOG_CHARS = 300  # of a message that may quote what the caller sent, in one log line
MAX_LINE_BYTES = 64 * 1024  # an event's header line (asyncio's stream limit); an audio header is ~100 bytes
MAX_STREAM_S = MAX_CLIP_S  # audio of one audio-start..audio-stop: what one-shot recognition takes
QUEUED_CHUNKS = 8  # audio read ahead of the recognition; past it the door stops reading the socket

VOICED = ("voiced", "")  # the project publishes no URL yet; the field is required
WHISPER = ("OpenAI", "https://github.com/openai/whisper")
SPARK_TTS = ("SparkAudio", "https://github.com/SparkAudio/Spark-TTS")


# ---------------------------------------------------------------------------- describe -> info


def build_info(services) -> Info:
    """The `info` event's content from the loaded engines and the registered voices."""
    version = voiced.__version__
    ours = Attribution(*VOICED)
    info = Info()
    if services.asr is not None:
        asr = services.asr.engine
        info.asr.append(AsrProgram(
            name=PROGRAM, attribution=ours, installed=True, version=version,
            description=f"voiced speech-to-text: Whisper {asr.model_name} ({asr.backend} on {asr.device})",
            models=[AsrModel(name=asr.model_name, attribution=Attribution(*WHISPER), installed=True,
                             description=f"Whisper {asr.model_name}", version=None,
                             languages=list(asr.languages))],
            supports_transcript_streaming=True,
            # Audio-stop ends the utterance: Home Assistant's own VAD finds the end of speech.
            requires_external_vad=True,
        ))
    if services.tts is not None:
        tts = services.tts.engine
        languages = list(tts.languages)
        # The engine names its makers (Piper's voices: their own language each); Spark-TTS's engines do not.
        maker = Attribution(*getattr(tts, "attribution", SPARK_TTS))
        voices = [TtsVoice(name=v.name, attribution=maker, installed=True, version=None,
                           description=f"{v.name} ({v.description})", languages=getattr(v, "languages", None) or languages)
                  for v in list_voices(services)]
        info.tts.append(TtsProgram(
            name=PROGRAM, attribution=ours, installed=True, version=version,
            description=f"voiced text-to-speech: {tts.model_name} ({tts.backend} on {tts.device})",
            voices=voices, supports_synthesize_streaming=True,
        ))
    return info


# ---------------------------------------------------------------------------- reading, bounded


async def first_byte(reader: asyncio.StreamReader) -> bytes:
    """The first byte of the next event (b"" at the end of the stream): the wait for it is the idle one."""
    return await reader.read(1)


async def read_event(reader: asyncio.StreamReader, first: bytes, max_bytes: int) -> Event | None:
    """The event whose first byte is `first` (None at the end of the stream), as wyoming's
    async_read_event reads it, except that its lengths are checked before anything they declare is read:
    SessionError (BAD_INPUT) for a header that is not an event or declares more than `max_bytes`."""
    try:
        line = first + await reader.readline()
    except ValueError:  # asyncio's LimitOverrunError: no newline within MAX_LINE_BYTES
        raise invalid(f"an event's header line is over {MAX_LINE_BYTES} bytes") from None
    if not line.endswith(b"\n"):
        return None  # the stream ended inside the header
    try:
        header = loads(line)
    except ValueError as e:
        raise invalid(f"unreadable event: the header is not JSON ({cut(e)})") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise invalid("unreadable event: the header must be a JSON object with a \"type\" string")
    data = header.get("data", {})
    if not isinstance(data, dict):
        raise invalid(f"unreadable event: {cut(header['type'])} has \"data\" that is not an object")
    lengths = []
    for key in ("data_length", "payload_length"):
        n = header.get(key) or 0
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise invalid(f"unreadable event: {key} must be a byte count, not {cut(repr(n))}")
        if n > max_bytes:
            raise invalid(f"{cut(header['type'])} declares a {key} of {n} bytes; this server takes events up to "
                          f"{max_bytes} bytes (server.max_message_bytes)")
        lengths.append(n)
    try:
        if lengths[0]:
            extra = loads(await reader.readexactly(lengths[0]))
            if not isinstance(extra, dict):
                raise invalid(f"unreadable event: {cut(header['type'])}'s data is not a JSON object")
            data.update(extra)
        payload = await reader.readexactly(lengths[1]) if lengths[1] else None
    except asyncio.IncompleteReadError:
        return None  # the stream ended inside the event
    except ValueError as e:
        raise invalid(f"unreadable event: its data is not JSON ({cut(e)})") from None
    return Event(type=header["type"], data=data, payload=payload)


# ---------------------------------------------------------------------------- the door


class WyomingDoor:
    """Listens on tcp://HOST:PORT; one handler per connection."""

    name = FRONT

    def __init__(self, services, address: str):
        self.services = services
        try:
            self.host, self.port = split_address(address, scheme="tcp")
        except ValueError as e:
            raise DoorError(f"doors.wyoming: {e}") from None
        self.address = ""
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[asyncio.Task, _Handler] = {}

    async def start(self) -> str:
        self._gate = connections(self.services)
        self._server = await asyncio.start_server(self._connected, self.host, self.port, limit=MAX_LINE_BYTES)
        host, port = self._server.sockets[0].getsockname()[:2]
        self.address = f"tcp://{host}:{port}"
        log.info("wyoming: listening on %s", self.address)
        return self.address

    async def stop_accepting(self) -> None:
        """Drain: no new connections. Open ones go on; a new request on one is refused by admission."""
        if self._server is not None and self._server.is_serving():
            self._server.close()
            log.info("wyoming: no longer accepting connections (%d open)", len(self._connections))

    async def close(self) -> None:
        """Ends every connection (cancelling its work) and closes the listener."""
        await self.stop_accepting()
        connections = list(self._connections.items())
        for _, handler in connections:
            await handler.stop()
        if connections:
            await asyncio.gather(*(task for task, _ in connections), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        release = self._gate.hold(FRONT)
        if release is None:
            self.services.count_error(FRONT, ErrorKind.OVER_CAPACITY.value)
            with contextlib.suppress(Exception):
                event = Error(text=self._gate.refusal(FRONT), code=ErrorKind.OVER_CAPACITY.value).event()
                await last_words(async_write_event(event, writer), writer.transport, grace=1.0)
            writer.close()
            return
        handler = _Handler(self.services, reader, writer, peer)
        task = asyncio.current_task()
        self._connections[task] = handler
        log.debug("wyoming %s: connected", peer)
        try:
            await handler.run()
        finally:
            del self._connections[task]
            release()
            log.debug("wyoming %s: disconnected", peer)


class _Handler(AsyncEventHandler):
    """One connection. Events are handled in order; a recognition or a synthesis runs as a task of its
    own so reading goes on, and a caller who hangs up has its engine work cancelled at once."""

    def __init__(self, services, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str):
        super().__init__(reader, writer)
        self.services = services
        self.peer = peer
        self._language: str | None = None  # of the next audio stream, from its `transcribe`
        self._recognition: _Recognition | None = None
        self._speech: _Speech | None = None
        self._stream: _Speech | None = None  # a synthesize-start..synthesize-stop in progress
        self._tasks: set[asyncio.Task] = set()
        self._closing = False

    async def run(self) -> None:
        # AsyncEventHandler.run, except that every read is bounded (read_event) and an unreadable event
        # is answered before the connection ends.
        self._is_running = True
        c = self.services.config.server
        first = True
        try:
            while self._is_running:
                try:
                    event = await self._next_event(c, first)
                except OSError as e:  # the socket's own fault (a reset, a keepalive timeout): nothing to answer
                    log.info("wyoming %s: connection lost: %s: %s", self.peer, type(e).__name__, e)
                    break
                except SessionError as e:  # too large, too slow, or not an event at all
                    log.info("wyoming %s: %s; closing the connection", self.peer, cut(e.message, LOG_CHARS))
                    await self.send_error(e)
                    break
                first = False
                if event is None or not await self.handle_event(event):
                    break
        finally:
            await self.disconnect()
            self.writer.close()

    # ------------------------------------------------------------------ events in

    async def _next_event(self, c, first: bool) -> Event | None:
        """The next event, its first byte within the handshake (first event) or idle limit (while no
        request of this connection is in progress), the rest within the handshake limit."""
        limit, key = (c.handshake_timeout_s, "server.handshake_timeout_s") if first else \
            (c.idle_timeout_s, "server.idle_timeout_s")
        while True:
            deadline = asyncio.timeout(limit or None)
            try:
                async with deadline:
                    start = await first_byte(self.reader)
                break
            except TimeoutError:
                if not deadline.expired():
                    raise  # the socket's own (a keepalive timeout): the connection is lost
                if not first and any(not t.done() for t in self._tasks):
                    continue  # a request is being answered: the caller waits for it, as it may
                raise SessionError(ErrorKind.TIMEOUT, f"no event from the caller for {limit:g} s ({key}); "
                                                      "send the next event, or close the connection") from None
        if not start:
            return None
        deadline = asyncio.timeout(c.handshake_timeout_s or None)
        try:
            async with deadline:
                return await read_event(self.reader, start, c.max_message_bytes)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise SessionError(ErrorKind.TIMEOUT, f"an event did not arrive whole within "
                                                  f"{c.handshake_timeout_s:g} s (server.handshake_timeout_s)") from None

    async def handle_event(self, event) -> bool:
        try:
            return await self._handle(event)
        except SessionError as e:
            log.info("wyoming %s: %s refused: %s", self.peer, cut(event.type), cut(e.message, LOG_CHARS))
            await self.send_error(e)
            return False
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            # A required field missing or of the wrong type (the library's from_event, our checks).
            what = f"missing field {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
            log.info("wyoming %s: malformed %s event (%s); closing the connection", self.peer, cut(event.type),
                     cut(what, LOG_CHARS))
            await self.send_error(invalid(f"malformed {event.type} event: {what}"))
            return False

    async def _handle(self, event) -> bool:
        kind = event.type
        if Describe.is_type(kind):
            self.services.check_ready()
            await self.write_event(build_info(self.services).event())
        elif Ping.is_type(kind):
            await self.write_event(Pong(text=Ping.from_event(event).text).event())
        elif SelectProgram.is_type(kind):
            name = SelectProgram.from_event(event).name
            if name != PROGRAM:
                raise SessionError(ErrorKind.NOT_FOUND, f"program {name!r} is not served here; this server "
                                                        f"has {PROGRAM!r}")
        elif Transcribe.is_type(kind):
            self._check_no_audio("transcribe")
            self._language = self._transcribe_language(Transcribe.from_event(event))
        elif AudioStart.is_type(kind):
            start = AudioStart.from_event(event)
            self._check_no_audio("audio-start")
            try:
                converter = PcmConverter(start.rate, start.width, start.channels)
            except AudioFormatError as e:
                raise invalid(f"audio-start: {e}") from None
            language, self._language = self._language, None
            self._recognition = _Recognition(self, language, start, converter, after=self._recognition)
        elif AudioChunk.is_type(kind):
            chunk = AudioChunk.from_event(event)
            return await self._audio("audio-chunk").feed(chunk)
        elif AudioStop.is_type(kind):
            return self._audio("audio-stop").stop()
        elif SynthesizeStart.is_type(kind):
            start = SynthesizeStart.from_event(event)
            if self._stream is not None:
                raise invalid("synthesize-start arrived during a synthesis stream; send synthesize-stop first")
            self._stream = self._speech = _Speech(self, start.voice, streaming=True, after=self._speech)
        elif SynthesizeChunk.is_type(kind):
            chunk = SynthesizeChunk.from_event(event)
            return self._text_stream("synthesize-chunk").add(chunk.text)
        elif SynthesizeStop.is_type(kind):
            stream, self._stream = self._text_stream("synthesize-stop"), None
            return stream.finish()
        elif Synthesize.is_type(kind):
            if self._stream is not None:
                return True  # a streaming client repeats the whole text for older servers: being spoken
            synthesize = Synthesize.from_event(event)
            if not synthesize.text.strip():
                raise invalid("synthesize: text is empty; send the text to speak")
            self._speech = _Speech(self, synthesize.voice, streaming=False, after=self._speech)
            return self._speech.add(synthesize.text) and self._speech.finish()
        else:
            # The protocol's rule: a server drops the events it does not handle (wake, intent, ...).
            log.debug("wyoming %s: ignoring a %s event", self.peer, cut(kind))
        return True

    def _transcribe_language(self, transcribe: Transcribe) -> str | None:
        """Checked when `transcribe` arrives, so a wrong one is refused before any audio flows."""
        self.services.check_ready()
        asr = self.services.asr.engine
        if transcribe.name and transcribe.name not in (PROGRAM, asr.model_name):
            raise SessionError(ErrorKind.NOT_FOUND, f"model {transcribe.name!r} is not loaded here; this server "
                                                    f"has {asr.model_name!r}")
        return check_language(transcribe.language, "language", known=list(asr.languages))

    def _check_no_audio(self, what: str) -> None:
        if self._recognition is not None and not self._recognition.stopped:
            raise invalid(f"{what} arrived during an audio stream; send audio-stop first")

    def _audio(self, what: str) -> _Recognition:
        if self._recognition is None or self._recognition.stopped:
            raise invalid(f"{what} arrived outside an audio stream; send audio-start first")
        return self._recognition

    def _text_stream(self, what: str) -> _Speech:
        if self._stream is None:
            raise invalid(f"{what} arrived outside a synthesis stream; send synthesize-start first")
        return self._stream

    # ------------------------------------------------------------------ out, and the end

    async def send_error(self, error: SessionError) -> None:
        self.services.count_error(FRONT, error.kind.value)
        with contextlib.suppress(ConnectionError, RuntimeError):
            # A caller that stopped reading (what may have ended it) gets a grace, then is cut.
            await last_words(self.write_event(Error(text=error.message, code=error.kind.value).event()),
                             self.writer.transport)

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=f"wyoming {self.peer}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def fail(self, error: Exception) -> None:
        """A recognition or synthesis failed: say why, then end the connection."""
        if self._closing:
            return
        if isinstance(error, ConnectionError):
            log.debug("wyoming %s: connection lost", self.peer)
        elif isinstance(error, SessionError):
            log.info("wyoming %s: %s", self.peer, cut(error.message, LOG_CHARS))
            await self.send_error(error)
        else:
            log.error("wyoming %s: internal error", self.peer, exc_info=error)
            await self.send_error(SessionError(ErrorKind.INTERNAL, f"internal error: {type(error).__name__}"))
        await self.stop()

    async def disconnect(self) -> None:
        # The caller hung up, or we end the connection: cancel its recognition and synthesis, which
        # cancels their engine requests and gives their places back.
        self._closing = True
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


async def _after(previous) -> None:
    """Wait for the previous request of the connection (answers leave in order), whatever its fate."""
    if previous is not None and not previous.task.done():
        await asyncio.wait([previous.task])


# ---------------------------------------------------------------------------- recognition


class _Recognition:
    """One audio-start..audio-stop: a push-to-talk session of the core, fed as the audio arrives."""

    def __init__(self, handler: _Handler, language: str | None, start: AudioStart, converter: PcmConverter,
                 after: _Recognition | None):
        self.handler = handler
        self.services = handler.services
        self.stopped = False
        self._language = language
        self._start = start
        self._converter = converter
        # The session's reader drains it as it fills; at QUEUED_CHUNKS the door stops reading the socket.
        self._inputs: asyncio.Queue = asyncio.Queue()
        self._taken = asyncio.Event()
        self._samples = 0  # at 16 kHz, after conversion
        self.task = handler.spawn(self._run(after), "transcribe")

    async def feed(self, chunk: AudioChunk) -> bool:
        if self.task.done():
            return False  # refused or failed: the error went out, the connection is ending
        c = self._converter
        if not c.same_format(chunk.rate, chunk.width, chunk.channels):
            # Every chunk states its format; follow a change instead of misreading the audio.
            self._put(c.flush())
            try:
                c = self._converter = PcmConverter(chunk.rate, chunk.width, chunk.channels)
            except AudioFormatError as e:
                raise invalid(f"audio-chunk: {e}") from None
        pcm = c.feed(chunk.audio)
        self._samples += len(pcm)
        if self._samples > MAX_STREAM_S * RATE:
            raise invalid(f"the audio stream is over {MAX_STREAM_S} s; send audio-stop within {MAX_STREAM_S} s "
                          "of audio-start, and longer audio as several streams")
        while self._inputs.qsize() >= QUEUED_CHUNKS and not self.task.done():
            # The recognition takes a chunk, or ends (a refusal, a failure), which ends this stream.
            self._taken.clear()
            taken = asyncio.ensure_future(self._taken.wait())
            await asyncio.wait([taken, self.task], return_when=asyncio.FIRST_COMPLETED)
            taken.cancel()
        if self.task.done():
            return False
        self._put(pcm)
        return True

    def stop(self) -> bool:
        self.stopped = True
        if self.task.done():
            return False
        self._put(self._converter.flush())
        self._inputs.put_nowait(TalkEnd())
        self._inputs.put_nowait(None)
        return True

    def _put(self, pcm) -> None:
        if len(pcm):
            self._inputs.put_nowait(AudioIn(pcm.tobytes()))

    async def _events(self) -> AsyncIterator:
        yield TalkStart()
        while (item := await self._inputs.get()) is not None:
            self._taken.set()
            yield item

    async def _run(self, after: _Recognition | None) -> None:
        await _after(after)
        s = self.services
        write = self.handler.write_event
        try:
            async with s.admit(FRONT):
                spec = s.spec(front=FRONT, input=PCM16K, language=self._language,
                              segmentation=segmentation_for(s.config, mode="push_to_talk"))
                log.info("wyoming %s: transcribe (%s; %d Hz, %d-bit, %d ch) as session %s", self.handler.peer,
                         spec.asr.language or "language detected", self._start.rate, self._start.width * 8,
                         self._start.channels, spec.session_id)
                await write(TranscriptStart(language=spec.asr.language).event())
                texts: list[str] = []
                language = spec.asr.language
                session = Session(s, spec, conversational=False)
                try:
                    async with contextlib.aclosing(session.run(self._events())) as events:
                        async for ev in events:
                            if isinstance(ev, TranscriptOut) and ev.is_final:
                                text = ev.transcript.text.strip()
                                language = ev.transcript.language or language
                                if text:
                                    # Chunks append to each other: together they spell the transcript.
                                    # Through the session: a caller that stops reading ends it
                                    # (OVER_CAPACITY) instead of holding this write and its place.
                                    await session.writing(write(
                                        TranscriptChunk(text=(" " if texts else "") + text).event()))
                                    texts.append(text)
                            elif isinstance(ev, NoticeOut):
                                # An utterance was lost (ASR queue full, or it failed): a transcript without
                                # it would misquote the speaker, so the request fails instead.
                                kind = ErrorKind.OVER_CAPACITY if ev.code.endswith("BUSY") else ErrorKind.INTERNAL
                                raise SessionError(kind, ev.message)
                finally:
                    await session.close()
            # Outside the admission: the work is done even if the caller hangs up after reading this.
            text = " ".join(texts)
            await write(Transcript(text=text, language=language).event())  # what every client reads
            await write(TranscriptStop().event())
            log.debug("wyoming %s: transcript %r", self.handler.peer, text)
        except Exception as e:
            await self.handler.fail(e)


# ---------------------------------------------------------------------------- synthesis


class _Speech:
    """One synthesize, or one synthesize-start..synthesize-stop stream: sentences in, audio out.

    Text is cut into sentences as it arrives (voiced.text.SentenceBuffer, as agent replies are), each
    is one engine request, and every chunk the engine makes leaves at once. One audio-start..audio-stop
    frames the whole reply, so a client writing a WAV file sees a single stream."""

    def __init__(self, handler: _Handler, voice, streaming: bool, after: _Speech | None):
        self.handler = handler
        self.services = handler.services
        self.streaming = streaming
        self._voice = voice
        self._sentences = SentenceBuffer()
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self.task = handler.spawn(self._run(after), "synthesize")

    def add(self, text: str) -> bool:
        if self.task.done():
            return False
        for sentence in self._sentences.feed(text):
            self._queue.put_nowait(sentence)
        return True

    def finish(self) -> bool:
        if self.task.done():
            return False
        for sentence in self._sentences.flush():
            self._queue.put_nowait(sentence)
        self._queue.put_nowait(None)
        return True

    def _options(self):
        s = self.services
        name = language = None
        if self._voice is not None:
            name, language = self._voice.name, self._voice.language
        if language and not name:
            # every voice speaks them all: a voice asked for by language is only checked
            check_language(language, "voice.language", known=list(s.tts.engine.languages))
        return tts_options_for(s.config, voice=name or None)

    async def _run(self, after: _Speech | None) -> None:
        await _after(after)
        s = self.services
        try:
            s.check_ready(need_tts=True)
            opts = self._options()
            async with s.admit(FRONT):
                log.info("wyoming %s: synthesize%s (voice %s)", self.handler.peer,
                         " stream" if self.streaming else "", opts.voice or "default")
                # The core's bounds on work without a session: a caller that stops reading ends the
                # synthesis (OVER_CAPACITY) and max_session_s bounds the whole, freeing the engine and
                # this place instead of a write holding both forever.
                await deliver(s.config.server, lambda put: self._speak(opts, put), self.handler.write_event)
        except Exception as e:
            await self.handler.fail(e)

    async def _speak(self, opts, put) -> None:
        """Every sentence's audio to `put` as the engine makes it, then the closing events."""
        s = self.services
        fmt = {"rate": RATE, "width": OUT_WIDTH, "channels": OUT_CHANNELS}
        started = False
        sent = 0  # samples
        while (sentence := await self._queue.get()) is not None:
            # aclosing: cancelled (the caller hung up, or stopped reading), the engine request is
            # cancelled now, not whenever the generator happens to be collected.
            async with contextlib.aclosing(synthesize(s, sentence, opts, PCM16K)) as chunks:
                async for chunk in chunks:
                    if not started:
                        put(AudioStart(**fmt, timestamp=0).event(), EVENT_BYTES)
                        started = True
                    if chunk.audio:
                        put(AudioChunk(**fmt, audio=chunk.audio, timestamp=sent * 1000 // RATE).event(),
                            EVENT_BYTES + len(chunk.audio))
                        sent += len(chunk.audio) // OUT_WIDTH
        if not started:
            put(AudioStart(**fmt, timestamp=0).event(), EVENT_BYTES)  # a stream that carried no text
        put(AudioStop(timestamp=sent * 1000 // RATE).event(), EVENT_BYTES)
        if self.streaming:
            put(SynthesizeStopped().event(), EVENT_BYTES)
        log.debug("wyoming %s: spoke %.2f s", self.handler.peer, sent / RATE)
