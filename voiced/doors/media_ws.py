"""The telephony media WebSocket door: Twilio Media Streams' message format, one call per WebSocket.

A bidirectional stream (TwiML `<Connect><Stream url="wss://...">`) opens a WebSocket and sends JSON
text messages (twilio.com/docs/voice/media-streams/websocket-messages):

    connected  {"event": "connected", "protocol": "Call", "version": "1.0.0"}
    start      {"event": "start", "streamSid": "MZ..", "start": {"streamSid", "callSid", "accountSid",
                "tracks": ["inbound"], "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000,
                "channels": 1}, "customParameters": {...}}}
    media      {"event": "media", "streamSid", "media": {"track": "inbound", "chunk", "timestamp",
                "payload": base64 audio}}
    dtmf       {"event": "dtmf", "streamSid", "dtmf": {"track": "inbound_track", "digit": "1"}}
    mark       {"event": "mark", "streamSid", "mark": {"name": ...}}: the audio sent before our mark
               with that name has played (or was cleared)
    stop       {"event": "stop", "streamSid", "stop": {"accountSid", "callSid"}}: the call ended

and takes back `media` (base64 audio in the stream's format, played in order, buffered by the far
end: so it is sent as the TTS engine writes it, not paced), `mark` (we send one after each reply, and
the far end answers when the caller has heard it) and `clear` (drop what is buffered: barge-in).

Auth: with `server.auth_token` set, the upgrade request must carry `Authorization: Bearer <token>`,
or, as Twilio cannot send headers, the stream's `token` custom parameter
(`<Parameter name="token" value="..."/>`) must hold it. A refusal closes the WebSocket with a code and
a reason: 1013 when the server is full or still loading, 1001 while it drains, 1008 for a wrong token
or a broken protocol (a field of the wrong JSON type included, an id over 128 characters), 1003 for binary
messages, 1007 for bad JSON or base64. The WebSocket server is aiohttp (the daemon's one HTTP/WebSocket
library), on its own listener (`[doors] media_ws`), bounded as every HTTP door (voiced.doors.guard): the
upgrade within `server.handshake_timeout_s`, and the `start` message within it again.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hmac
import json
import logging
import time

from aiohttp import WSMsgType, web

from voiced.audio.ingest import Format
from voiced.core.calls import CallInputs, LiveCalls, log_event, run_call
from voiced.core.errors import ErrorKind, SessionError
from voiced.core.events import DTMF_DIGITS, AudioIn, AudioOut, Dtmf, HangupOut, ReplyInterrupted
from voiced.doors.guard import check_id, cut, serve_http
from voiced.doors.shared import door_address, last_words, loads, tls_context

log = logging.getLogger(__name__)

FRONT = "media_ws"
ENCODINGS = {"audio/x-mulaw": "MULAW", "audio/x-alaw": "ALAW"}  # Twilio sends mu-law; some copies A-law
MAX_MESSAGE_BYTES = 1 << 20  # a 20 ms media message is ~250 bytes
HANGUP_WAIT_S = 2.0  # past the audio still to play, how long a hangup waits for the far end's mark

# WebSocket close codes (RFC 6455 section 7.4.1, and IANA's 1013)
NORMAL, GOING_AWAY, UNSUPPORTED_DATA, INVALID_DATA, POLICY, INTERNAL, TRY_AGAIN_LATER = (
    1000, 1001, 1003, 1007, 1008, 1011, 1013)


class Fault(Exception):
    """The far end broke the protocol (or failed auth): the call ends with this close code and reason."""

    def __init__(self, code: int, reason: str, counted_as: str = "bad_input"):
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.counted_as = counted_as  # voiced_errors_total{front="media_ws", code=...}


def bearer_ok(header: str, token: str) -> bool:
    return hmac.compare_digest(header.encode(), f"Bearer {token}".encode())


def close_code(error: SessionError, draining: bool) -> int:
    if error.kind == ErrorKind.OVER_CAPACITY:
        return TRY_AGAIN_LATER
    if error.kind == ErrorKind.UNAVAILABLE:
        return GOING_AWAY if draining else TRY_AGAIN_LATER
    if error.kind == ErrorKind.INTERNAL:
        return INTERNAL
    return POLICY


def close_reason(text: str) -> bytes:
    """A close frame's reason is at most 123 bytes of UTF-8."""
    data = text.encode()
    if len(data) <= 123:
        return data
    return data[:120].decode(errors="ignore").encode() + b"..."


def parse_message(text: str) -> dict:
    try:
        msg = loads(text)
    except ValueError as e:
        raise Fault(INVALID_DATA, f"a message is not JSON ({cut(e)})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("event"), str):
        raise Fault(POLICY, "a message has no \"event\"; every message is a JSON object with an event name")
    return msg


def _field(msg: dict, *path: str):
    value = msg
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _typed(value, kind: type, what: str):
    """`value` when it is of `kind` (or absent: None); a Fault (1008) naming the field otherwise."""
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        names = {dict: "an object", str: "a string", int: "a number"}
        raise Fault(POLICY, f"{what} must be {names.get(kind, kind.__name__)}, not {type(value).__name__}")
    return value


def stream_format(start: dict) -> Format:
    fmt = _typed(_field(start, "start", "mediaFormat"), dict, "start.mediaFormat") or {}
    encoding = _typed(fmt.get("encoding"), str, "mediaFormat.encoding") or "audio/x-mulaw"
    rate = _typed(fmt.get("sampleRate"), int, "mediaFormat.sampleRate") or 8000
    channels = _typed(fmt.get("channels"), int, "mediaFormat.channels") or 1
    if encoding not in ENCODINGS:
        raise Fault(POLICY, f"mediaFormat.encoding {cut(encoding)!r} is not supported; use audio/x-mulaw or "
                            "audio/x-alaw")
    if rate != 8000 or channels != 1:
        raise Fault(POLICY, f"mediaFormat {rate} Hz x {channels} channels is not supported; use 8000 Hz mono")
    return Format(ENCODINGS[encoding], 8000)


class MediaStreamDoor:
    name = FRONT

    def __init__(self, services, listen: str):
        self.services = services
        self.listen = listen
        self._runner: web.AppRunner | None = None
        self._site: web.TCPSite | None = None
        self._calls = LiveCalls()
        self.address = ""

    @property
    def settings(self):
        """[media_ws] agent, voice, greeting: read at each call's start."""
        return self.services.config.media_ws

    async def start(self) -> str:
        host, port = door_address(self.services, FRONT, self.settings.agent, self.listen)
        app = web.Application(handler_args={"auto_decompress": False})  # no bodies here: nothing to unpack
        app.router.add_get("/{path:.*}", self._handle)
        c = self.services.config.server
        tls = tls_context(c.tls_cert, c.tls_key)  # Twilio connects to wss:// only
        self._runner, self._site = await serve_http(app, host, port, tls, self.services, FRONT)
        bound = self._runner.addresses[0]
        self.address = f"{host}:{bound[1]}"
        log.info("media stream WebSocket door listening on %s://%s/", "wss" if tls else "ws", self.address)
        return self.address

    async def stop_accepting(self) -> None:
        """Drain: the listener closes; open streams go on until their calls end."""
        if self._site is not None:
            await self._site.stop()
            self._site = None

    async def close(self) -> None:
        await self.stop_accepting()
        await self._calls.cancel_all()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def live_calls(self) -> int:
        return len(self._calls)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        token = self.services.config.server.auth_token
        header = request.headers.get("Authorization")
        authenticated = not token
        if token and header is not None:
            if not bearer_ok(header, token):
                self.services.count_error(FRONT, "unauthenticated")
                return web.Response(status=401, text="missing or wrong bearer token: send `Authorization: Bearer "
                                    "<token>`, or the stream's `token` custom parameter\n")
            authenticated = True
        ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES)
        if not ws.can_prepare(request).ok:
            return web.Response(status=426, headers={"Upgrade": "websocket"},
                                text="this is voiced's telephony media WebSocket (Twilio Media Streams messages); "
                                     "connect with a WebSocket client\n")
        await ws.prepare(request)
        task = asyncio.current_task()
        self._calls.add(task)
        try:
            await _Stream(self, ws, request.remote or "?", authenticated, task, request.transport).run()
        finally:
            self._calls.discard(task)
            if not ws.closed:
                await last_words(ws.close(), request.transport)
        return ws


class _Stream:
    def __init__(self, door: MediaStreamDoor, ws: web.WebSocketResponse, peer: str, authenticated: bool, task,
                 transport=None):
        self.door = door
        self.transport = transport  # cut when a caller that stopped reading cannot take the close frame
        self.services = door.services
        self.ws = ws
        self.peer = peer
        self.authenticated = authenticated
        self.task = task
        self.stream_sid = ""
        self.call_sid = ""
        self._marks: set[str] = set()  # marks sent and not yet answered
        self._marks_answered = asyncio.Event()
        self._unplayed_s = 0.0  # audio sent since the last answered mark

    def _who(self) -> str:
        if self.call_sid:
            return f"media stream {self.stream_sid} (call {self.call_sid})"
        return f"media stream from {self.peer}"

    async def run(self) -> None:
        try:
            start = await self._until_start()
            if start is None:
                return
            if not self.authenticated:
                params = _field(start, "start", "customParameters")
                given = params.get("token") if isinstance(params, dict) else None
                given = given if isinstance(given, str) else ""
                if not bearer_ok(f"Bearer {given}", self.services.config.server.auth_token):
                    raise Fault(POLICY, "missing or wrong token: send `Authorization: Bearer <token>` on the "
                                        "upgrade, or <Parameter name=\"token\"> in <Stream>", "unauthenticated")
            fmt = stream_format(start)
            async with self.services.admit(FRONT) as admission:
                try:
                    await self._converse(fmt)
                except Fault as e:
                    admission.outcome = ErrorKind.BAD_INPUT.value
                    await self._fault(e)
        except Fault as e:
            await self._fault(e)
        except SessionError as e:
            self.services.count_error(FRONT, e.kind.value)
            code = close_code(e, self.services.draining)
            level = logging.INFO if code in (TRY_AGAIN_LATER, GOING_AWAY) else logging.WARNING
            log.log(level, "%s: ended with %s: %s", self._who(), e.kind.value, e.message)
            await self._close(code, e.message)
        except ConnectionError as e:
            log.info("%s: connection lost: %s", self._who(), e)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(self._close(GOING_AWAY, "the server is shutting down"))
            raise
        except Exception:
            log.exception("%s: internal error, ending the call", self._who())
            await self._close(INTERNAL, "internal error")

    async def _fault(self, e: Fault) -> None:
        log.warning("%s: %s; closing (%d)", self._who(), cut(e.reason, 300), e.code)
        self.services.count_error(FRONT, e.counted_as)
        await self._close(e.code, e.reason)

    async def _close(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):
            await last_words(self.ws.close(code=code, message=close_reason(reason)), self.transport)

    async def _receive(self) -> dict | None:
        """The next message, or None when the far end closed the socket."""
        msg = await self.ws.receive()
        if msg.type == WSMsgType.TEXT:
            return parse_message(msg.data)
        if msg.type == WSMsgType.BINARY:
            raise Fault(UNSUPPORTED_DATA, "binary messages are not part of the media stream protocol; send JSON text")
        return None  # CLOSE, CLOSING, CLOSED, ERROR

    async def _until_start(self) -> dict | None:
        limit = self.services.config.server.handshake_timeout_s
        deadline = time.monotonic() + limit
        while True:
            try:
                msg = await asyncio.wait_for(self._receive(), max(0.0, deadline - time.monotonic()) if limit else None)
            except TimeoutError:
                raise Fault(POLICY, f"no start message within {limit:g} s (server.handshake_timeout_s)") from None
            if msg is None:
                log.info("%s: closed before the stream started", self._who())
                return None
            event = msg["event"]
            if event == "connected":
                continue
            if event != "start":
                raise Fault(POLICY, f"{event!r} before start; a stream begins with connected and start")
            stream_sid = _typed(msg.get("streamSid") or _field(msg, "start", "streamSid"), str, "streamSid") or ""
            call_sid = _typed(_field(msg, "start", "callSid"), str, "start.callSid") or ""
            if not stream_sid:
                raise Fault(POLICY, "start has no streamSid")
            for what, value in (("streamSid", stream_sid), ("start.callSid", call_sid)):
                if (problem := check_id(value, what)) is not None:
                    raise Fault(POLICY, problem)
            self.stream_sid, self.call_sid = stream_sid, call_sid
            self.call_sid = self.call_sid or self.stream_sid
            return msg

    async def _converse(self, fmt: Format) -> None:
        session, inputs = self.door._calls.open_session(self.task, self.call_sid, self.services, FRONT,
                                                         self.door.settings, fmt)
        log.info("%s: session %s, %s 8 kHz, agent %s", self._who(), session.spec.session_id, fmt.encoding,
                 session.spec.agent)
        started = time.monotonic()
        ended_by = await run_call(session, inputs, self._read_caller(inputs), self._on_event)
        log.info("%s: ended by the %s after %.1f s", self._who(), ended_by if ended_by == "caller" else "agent",
                 time.monotonic() - started)

    # ------------------------------------------------------------------ the caller's side

    async def _read_caller(self, inputs: CallInputs) -> None:
        while True:
            msg = await self._receive()
            if msg is None:
                log.info("%s: the far end closed the WebSocket", self._who())
                return
            event = msg["event"]
            if event == "media":
                track = _field(msg, "media", "track") or "inbound"
                if track not in ("inbound", "inbound_track"):
                    continue  # with tracks="both", the outbound track is what the caller hears: ours
                payload = _field(msg, "media", "payload")
                if not isinstance(payload, str):
                    raise Fault(POLICY, "a media message has no media.payload")
                try:
                    audio = base64.b64decode(payload, validate=True)
                except (binascii.Error, ValueError):
                    raise Fault(INVALID_DATA, "media.payload is not base64") from None
                await inputs.put(AudioIn(audio))
            elif event == "dtmf":
                digit = str(_field(msg, "dtmf", "digit") or "").upper()
                if digit not in DTMF_DIGITS:
                    raise Fault(POLICY, f"dtmf.digit {digit!r} is not a DTMF digit (0-9, *, #, A-D)")
                log.info("%s: DTMF %s", self._who(), digit)
                await inputs.put(Dtmf(digit))
            elif event == "mark":
                self._mark_answered(str(_field(msg, "mark", "name") or ""))
            elif event == "stop":
                log.info("%s: the far end stopped the stream (the call ended)", self._who())
                return
            elif event in ("start", "connected"):
                raise Fault(POLICY, f"a second {event} message on one stream")
            else:
                log.debug("%s: ignored %r message", self._who(), event)

    def _mark_answered(self, name: str) -> None:
        if name not in self._marks:
            log.debug("%s: mark %r answered but never sent", self._who(), name)
            return
        self._marks.discard(name)
        log.debug("%s: the caller has heard %s", self._who(), name)
        if not self._marks:
            self._unplayed_s = 0.0
            self._marks_answered.set()

    # ------------------------------------------------------------------ the session's side

    async def _send(self, message: dict) -> None:
        await self.ws.send_str(json.dumps(message, separators=(",", ":")))

    async def _on_event(self, ev) -> bool:
        if isinstance(ev, AudioOut):
            await self._send({"event": "media", "streamSid": self.stream_sid,
                              "media": {"payload": base64.b64encode(ev.audio).decode()}})
            self._unplayed_s += len(ev.audio) / 8000
            if ev.last:
                name = f"reply-{ev.reply_id}"
                self._marks.add(name)
                self._marks_answered.clear()
                await self._send({"event": "mark", "streamSid": self.stream_sid, "mark": {"name": name}})
        elif isinstance(ev, ReplyInterrupted):
            await self._send({"event": "clear", "streamSid": self.stream_sid})
            log.info("%s: barge-in: reply %d cut after %d ms; cleared the far end's buffer", self._who(),
                     ev.reply_id, ev.audio_sent_ms)
        elif isinstance(ev, HangupOut):
            if self._marks:  # let the goodbye play out before the socket closes
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._marks_answered.wait(), self._unplayed_s + HANGUP_WAIT_S)
            log.info("%s: the agent hung up%s", self._who(), f" ({ev.reason})" if ev.reason else "")
            await self._close(NORMAL, "the agent ended the call")
            return True
        else:
            log_event(log, self._who(), ev)
        return False
