"""The Asterisk AudioSocket door: each TCP connection is one phone call, one Converse session.

Asterisk's `AudioSocket(uuid,host:port)` dialplan application (or the AudioSocket channel driver)
connects, sends the call's UUID, then the caller's audio as signed-linear frames, DTMF digits as they
are pressed, and a hangup (or closes the socket) when the caller hangs up. Wire format and limits:
voiced.doors.audiosocket_frames.

The session's input and output format is the caller's: slin at the rate of the first audio message
(8 kHz from the dialplan application; 12-192 kHz types from the channel driver), so a reply goes
back in the same message type. Reply audio leaves as 20 ms frames paced in real time
(voiced.doors.pacing): Asterisk writes each frame to the channel as it arrives, and a burst would
overrun the phone's jitter buffer. Barge-in clears what is queued, so no frame leaves after it.

Faults end one call, never the door: a malformed message (unknown type, wrong UUID size, a length
over the limit, audio before the UUID, ...) is logged with the call's UUID and what was wrong, and
the call gets an error message (0xff) and is closed. So does a refusal (the server is full, loading
or draining, or a connection over `server.max_connections[_per_door]`): 0xff with the error's kind as its
payload (`over_capacity`, `unavailable`), then close;
Asterisk then hangs up the channel and the dialplan goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import numpy as np

from voiced.audio.ingest import MAX_RATE, Format, Resampler
from voiced.core.calls import CallInputs, LiveCalls, log_event, run_call
from voiced.core.errors import ErrorKind, SessionError
from voiced.core.events import AudioIn, AudioOut, Dtmf, HangupOut, ReplyInterrupted
from voiced.doors import audiosocket_frames as wire
from voiced.doors.guard import connections
from voiced.doors.pacing import FRAME_S, Pacer
from voiced.doors.shared import door_address, last_words

log = logging.getLogger(__name__)

FRONT = "audiosocket"
UUID_TIMEOUT_S = 5.0  # Asterisk sends the UUID the moment it connects
FIRST_AUDIO_TIMEOUT_S = 5.0  # and audio 20 ms later; a call without either is not a call


class AudioSocketDoor:
    name = FRONT

    def __init__(self, services, listen: str):
        self.services = services
        self.listen = listen
        self._server: asyncio.base_events.Server | None = None
        self._calls = LiveCalls()
        self.address = ""

    @property
    def settings(self):
        """[audiosocket] agent, voice, greeting: read at each call's start."""
        return self.services.config.audiosocket

    async def start(self) -> str:
        host, port = door_address(self.services, FRONT, self.settings.agent, self.listen)
        self._server = await asyncio.start_server(self._connection, host, port)
        bound = self._server.sockets[0].getsockname()
        self.address = f"{host}:{bound[1]}"
        log.info("AudioSocket door listening on %s", self.address)
        return self.address

    async def stop_accepting(self) -> None:
        """Drain: no new calls; the live ones go on until they end."""
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        await self.stop_accepting()
        await self._calls.cancel_all()

    @property
    def live_calls(self) -> int:
        return len(self._calls)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        release = connections(self.services).hold(FRONT)
        if release is None:  # the door or the daemon holds its limit of connections: as a full server says
            self.services.count_error(FRONT, ErrorKind.OVER_CAPACITY.value)
            with contextlib.suppress(Exception):
                writer.write(wire.encode(wire.ERROR, ErrorKind.OVER_CAPACITY.value.encode()))
                await last_words(writer.drain(), writer.transport, grace=1.0)
            writer.close()
            return
        task = asyncio.current_task()
        self._calls.add(task)
        try:
            await _Call(self, reader, writer, task).run()
        except asyncio.CancelledError:
            pass  # close(): the call has said goodbye; this task is asyncio's own, with no one to tell
        finally:
            self._calls.discard(task)
            release()
            writer.close()
            # A caller that stopped reading never lets what is still buffered leave: cut it.
            with contextlib.suppress(Exception):
                await last_words(writer.wait_closed(), writer.transport)


@contextlib.contextmanager
def _socket_faults_as_lost():
    """The socket's own faults that are not ConnectionErrors (a keepalive timeout, an unreachable host or
    network) end the call as a lost connection, as a reset does, not as an internal error; only the socket's
    reads and writes run under this, so a TimeoutError of the session's own still reads as what it is."""
    try:
        yield
    except ConnectionError:
        raise
    except OSError as e:
        raise ConnectionError(f"{type(e).__name__}: {e}") from e


class _Call:
    def __init__(self, door: AudioSocketDoor, reader, writer, task):
        self.door = door
        self.services = door.services
        self.reader = reader
        self.writer = writer
        self.task = task
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.uuid = ""  # the call's UUID once it came
        self.kind = 0  # the audio message type of this call
        self._resample_in: Resampler | None = None
        self._resample_out: Resampler | None = None

    @property
    def _uuid_timeout_s(self) -> float:
        return min(UUID_TIMEOUT_S, self.services.config.server.handshake_timeout_s or UUID_TIMEOUT_S)

    def _who(self) -> str:
        return f"AudioSocket call {self.uuid or '(no UUID yet)'} from {self.peer}"

    async def run(self) -> None:
        try:
            try:
                first = await asyncio.wait_for(self._read(), self._uuid_timeout_s)
            except TimeoutError:
                raise wire.Malformed(f"no UUID message within {self._uuid_timeout_s:g} s of connecting") from None
            if first is None:
                log.info("%s: closed before sending its UUID", self._who())
                return
            if first.kind != wire.UUID:
                raise wire.Malformed(f"{wire.kind_name(first.kind)} before the call's UUID "
                                     "(the first message must be the UUID, type 0x01)")
            self.uuid = str(wire.parse_uuid(first))
            async with self.services.admit(FRONT) as admission:
                try:
                    await self._converse()
                except wire.Malformed as e:
                    admission.outcome = ErrorKind.BAD_INPUT.value
                    await self._malformed(e)
        except wire.Malformed as e:
            await self._malformed(e)
        except SessionError as e:
            level = logging.INFO if e.kind in (ErrorKind.OVER_CAPACITY, ErrorKind.UNAVAILABLE) else logging.WARNING
            log.log(level, "%s: ended with %s: %s", self._who(), e.kind.value, e.message)
            await self._send_error(e.kind.value)
        except (ConnectionError, asyncio.IncompleteReadError) as e:
            log.info("%s: connection lost: %s", self._who(), e)
        except asyncio.CancelledError:
            # The daemon is closing (the drain's grace ran out): tell Asterisk to hang up.
            with contextlib.suppress(Exception):
                self.writer.write(wire.encode(wire.HANGUP))
            raise
        except Exception:
            log.exception("%s: internal error, ending the call", self._who())
            await self._send_error(ErrorKind.INTERNAL.value)

    async def _malformed(self, e: wire.Malformed) -> None:
        log.warning("%s: malformed message, ending the call: %s", self._who(), e)
        await self._send_error(ErrorKind.BAD_INPUT.value)

    async def _converse(self) -> None:
        # The call's rate is the first audio message's; DTMF pressed before it is kept for the session.
        early: list = []
        while True:
            try:
                msg = await asyncio.wait_for(self._read(), FIRST_AUDIO_TIMEOUT_S)
            except TimeoutError:
                raise wire.Malformed(f"no audio within {FIRST_AUDIO_TIMEOUT_S:g} s of the UUID") from None
            ended = self._caller_ended(msg)
            if ended:
                log.info("%s: %s before any audio", self._who(), ended)
                return
            if msg.is_audio:
                break
            early.append(self._input(msg))
        self.kind = msg.kind
        rate = msg.sample_rate
        session_rate = min(rate, MAX_RATE)  # 96 and 192 kHz are converted at the door
        if session_rate != rate:
            self._resample_in, self._resample_out = Resampler(rate, session_rate), Resampler(session_rate, rate)
        fmt = Format("LINEAR16", session_rate)
        session, inputs = self.door._calls.open_session(self.task, self.uuid, self.services, FRONT,
                                                         self.door.settings, fmt)
        session_id = session.spec.session_id
        log.info("%s: session %s, slin %g kHz, agent %s", self._who(), session_id, rate / 1000, session.spec.agent)
        for event in early:
            inputs.put_nowait(event)
        inputs.put_nowait(self._input(msg))

        frame_bytes = round(rate * FRAME_S) * 2
        pacer = Pacer(self._send_audio, frame_bytes, max_queued_bytes=self._ahead_bytes(rate))
        pacing = asyncio.create_task(pacer.run(), name=f"audiosocket-pacer:{session_id}")
        started = time.monotonic()
        try:
            ended_by = await run_call(session, inputs, self._read_caller(inputs),
                                      lambda ev: self._on_event(ev, pacer))
        finally:
            pacing.cancel()
            with contextlib.suppress(asyncio.CancelledError, ConnectionError):
                await pacing  # a send that failed: the caller's side has seen the socket go too
        log.info("%s: ended by the %s after %.1f s (%d frames of reply audio sent, %d dropped by barge-in)",
                 self._who(), "caller" if ended_by == "caller" else "agent", time.monotonic() - started,
                 pacer.frames_sent, pacer.frames_cleared)

    def _ahead_bytes(self, rate: int) -> int:
        """How much reply audio may wait in the pacer, ahead of real time. The engine speaks far faster
        than a call plays, so a reply's audio waits here; past this the session's outbox takes it, and
        past server.max_outbound_bytes there the call ends. A caller that stops reading stops the pacer
        (its socket is full), so this bounds what it leaves behind. Two of the longest pieces the TTS
        makes (tts.max_seconds) fit, and the outbox's budget beyond them: a caller that reads meets the
        bound only with a reply far longer than that, made all at once."""
        c = self.services.config
        return max(c.server.max_outbound_bytes, int(2 * c.tts.max_seconds * rate) * 2)

    # ------------------------------------------------------------------ the caller's side

    async def _read(self) -> wire.Message | None:
        """The caller's next message (None: the socket closed between messages)."""
        with _socket_faults_as_lost():
            return await wire.read_message(self.reader)

    def _caller_ended(self, msg: wire.Message | None) -> str:
        """Why this message ends the call from Asterisk's side ("" if it does not)."""
        if msg is None:
            return "hung up (socket closed)"
        if msg.kind == wire.HANGUP:
            return "hung up"
        if msg.kind == wire.ERROR:
            return f"Asterisk reported an error ({wire.describe_error(msg.payload)})"
        return ""

    def _input(self, msg: wire.Message):
        if msg.is_audio:
            if msg.kind != self.kind:
                raise wire.Malformed(f"{wire.kind_name(msg.kind)} in a call that started as "
                                     f"{wire.kind_name(self.kind)}")
            data = msg.payload
            if self._resample_in is not None:
                data = self._resample_in(np.frombuffer(data, "<i2").astype(np.int16)).astype("<i2").tobytes()
            return AudioIn(data)
        if msg.kind == wire.DTMF:
            return Dtmf(wire.parse_dtmf(msg))
        if msg.kind == wire.UUID:
            raise wire.Malformed("a second UUID message")
        raise wire.Malformed(f"unexpected {wire.kind_name(msg.kind)}")  # pragma: no cover (check_header)

    async def _read_caller(self, inputs: CallInputs) -> None:
        while True:
            msg = await self._read()
            ended = self._caller_ended(msg)
            if ended:
                log.info("%s: %s", self._who(), ended)
                return
            event = self._input(msg)
            if isinstance(event, Dtmf):
                log.info("%s: DTMF %s", self._who(), event.digit)
            await inputs.put(event)

    # ------------------------------------------------------------------ the session's side

    async def _on_event(self, ev, pacer: Pacer) -> bool:
        if isinstance(ev, AudioOut):
            # Take audio only while frames leave and the pacer has room: a caller that stops reading
            # backs the reply up into the session's outbox, which ends the call at
            # server.max_outbound_bytes.
            await pacer.writable()
            data = ev.audio
            if self._resample_out is not None:
                data = self._resample_out(np.frombuffer(data, "<i2").astype(np.int16),
                                          last=ev.last).astype("<i2").tobytes()
            pacer.push(data, last=ev.last)
        elif isinstance(ev, ReplyInterrupted):
            dropped = pacer.clear()
            log.info("%s: barge-in: reply %d cut after %d ms (%d queued frames dropped)", self._who(),
                     ev.reply_id, ev.audio_sent_ms, dropped)
        elif isinstance(ev, HangupOut):
            await pacer.drained()  # the goodbye is heard first
            log.info("%s: the agent hung up%s", self._who(), f" ({ev.reason})" if ev.reason else "")
            await self._write(wire.encode(wire.HANGUP))
            return True
        else:
            log_event(log, self._who(), ev)
        return False

    async def _send_audio(self, frame: bytes) -> None:
        await self._write(wire.encode(self.kind, frame))

    async def _write(self, data: bytes) -> None:
        with _socket_faults_as_lost():
            self.writer.write(data)
            await self.writer.drain()

    async def _send_error(self, code: str) -> None:
        self.services.count_error(FRONT, code)
        with contextlib.suppress(Exception):
            await last_words(self._write(wire.encode(wire.ERROR, code.encode())), self.writer.transport)

