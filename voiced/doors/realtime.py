"""`/v1/realtime`: OpenAI's Realtime interface over a WebSocket, on the HTTP listener.

One connection is one caller. The client configures it with `session.update` (audio format, turn
detection, voice, instructions), streams `input_audio_buffer.append`, and hears the agent back as
`response.output_audio.delta` while its words arrive as `response.output_audio_transcript.delta`.
Behind it runs one core Session, conversational, or transcription-only for `?intent=transcription`.

How the interface maps onto the daemon:
- `turn_detection` server_vad: the session's segmenter finds the turns (threshold -> webrtcvad's
  aggressiveness, prefix_padding_ms -> pre-roll, silence_duration_ms -> hangover); semantic_vad: smart
  turn detection (voiced.core.turns) at its eagerness (auto: medium); null: the client's
  `input_audio_buffer.commit` ends a turn (push-to-talk) and `clear` drops what was appended since.
- Partial transcripts (`conversation.item.input_audio_transcription.delta`) come when
  `audio.input.transcription.model` names a streaming model (anything but whisper-1).
- Every spoken user turn is answered by the agent (create_response true). Text typed with
  `conversation.item.create` (a user message of input_text) is answered when `response.create`
  comes, as the core's UserText: the agent gets it as a user turn and the reply takes the same path
  as a spoken one (without TTS, its words alone). `response.cancel` stops a reply; speech over a
  reply cancels it (barge-in), unless interrupt_response is false.
- A `session.update` that changes the audio pipeline after audio has flowed restarts it (the agent's
  memory of the conversation starts afresh); voice and instructions changes take the same path.
- Audio sent before the first `session.update`, binary frames, unknown or malformed events (a field of
  the wrong JSON type too) get an `error` event and the connection goes on; refusal (busy, loading,
  draining) is an `error` event and a close with 1013 (try again later); the agent ending the call
  closes with 1000.
- A connection holds a session place from its upgrade, so it is held to the session's idle limit from
  then: the first message within `server.handshake_timeout_s`, each next one within
  `server.idle_timeout_s` (pings do not count), or an `error` event (`idle_timeout`) and close 1008.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from dataclasses import dataclass, field

from aiohttp import WSCloseCode, WSMsgType, web

from voiced.audio.ingest import Format
from voiced.core import events as core
from voiced.core.errors import ErrorKind, SessionError
from voiced.core.spec import asr_options_for, check_language, segmentation_for, tts_options_for
from voiced.core.speech import resolve_voice
from voiced.doors import realtime_events as rt
from voiced.doors.guard import cut
from voiced.doors.realtime_events import EventError, RealtimeConfig, TurnDetection
from voiced.doors.shared import INTERNAL_MESSAGE, OPENAI_VOICES, HttpError, last_words, loads

log = logging.getLogger(__name__)

FRONT = "realtime"
MAX_BUFFER_S = 300  # push-to-talk audio held until commit
_CLOSE = {ErrorKind.BAD_INPUT: WSCloseCode.POLICY_VIOLATION, ErrorKind.OVER_CAPACITY: WSCloseCode.TRY_AGAIN_LATER,
          ErrorKind.UNAVAILABLE: WSCloseCode.TRY_AGAIN_LATER, ErrorKind.INTERNAL: WSCloseCode.INTERNAL_ERROR,
          # the session's limits (idle, maximum length) and an unknown voice: the caller's to fix
          ErrorKind.TIMEOUT: WSCloseCode.POLICY_VIOLATION, ErrorKind.NOT_FOUND: WSCloseCode.POLICY_VIOLATION}


def routes(listener) -> list[web.RouteDef]:
    async def handler(request: web.Request) -> web.StreamResponse:
        intent = request.query.get("intent", "")
        if intent not in ("", "conversation", "transcription"):
            raise HttpError(400, f"intent {intent!r} is unknown; leave it out, or use intent=transcription",
                            param="intent")
        if request.headers.get("Upgrade", "").lower() != "websocket":
            raise HttpError(400, "this is a WebSocket endpoint: connect with ws:// (or wss://), e.g. with the "
                            "openai SDK's client.realtime.connect()", code="websocket_required")
        ws = await listener.websocket(request, protocols=("realtime",))
        conn = RealtimeConnection(listener.services, ws, transcription=intent == "transcription",
                                  model=request.query.get("model", "voiced"), transport=request.transport)
        await conn.serve()
        return ws

    return [web.get("/v1/realtime", handler)]


@dataclass
class _Response:
    """The reply being spoken, as a Realtime response with one assistant audio item."""

    response_id: str
    item_id: str
    turn_id: int
    reply_id: int | None = None
    transcript: str = ""
    audio_done: bool = False
    cancelled_by_client: bool = False
    answers: str = ""  # the user item it answers: response.metadata.item_id (a reply may come after the next
    # turn began, so the latest user item is not always the one answered)


@dataclass
class _Turn:
    item_id: str
    partial: str = ""


@dataclass
class _Pipeline:
    session: object
    inputs: asyncio.Queue
    task: asyncio.Task
    manual_items: list[str] = field(default_factory=list)  # committed push-to-talk items, in order


class RealtimeConnection:
    def __init__(self, services, ws: web.WebSocketResponse, *, transcription: bool, model: str, transport=None):
        self.s = services
        self.ws = ws
        self.transport = transport  # cut when a caller that stopped reading cannot take our last words
        self.model = model or "voiced"
        self.ids = rt.Ids()
        c = services.config.segmentation
        smart = c.turn_detection == "smart" and services.turn_model is not None
        self.vad_defaults = TurnDetection(type="semantic_vad" if smart else "server_vad", eagerness=c.eagerness,
                                          threshold=(c.vad_aggressiveness + 0.5) / 4,
                                          prefix_padding_ms=c.pre_roll_ms, silence_duration_ms=c.hangover_ms)
        self.cfg = RealtimeConfig(type="transcription" if transcription else "realtime",
                                  turn_detection=self.vad_defaults, voice=services.config.tts.voice or None)
        self.configured = False  # a session.update has been accepted
        self.pipeline: _Pipeline | None = None
        self._send_lock = asyncio.Lock()
        self._closing: tuple[int, str] | None = None
        self._closer: asyncio.Future | None = None
        self.turns: dict[int, _Turn] = {}  # core turn id -> its user item
        self.heard: dict[int, str] = {}  # core turn id -> its user item, heard and not answered yet
        self.last_item: str | None = None
        self.response: _Response | None = None
        self.buffer = bytearray()  # push-to-talk audio awaiting commit
        self._odd = b""  # a PCM16 sample split across two appends
        self.pending_text: list[str] = []  # typed user messages awaiting response.create

    # ------------------------------------------------------------------ plumbing

    async def send(self, event: dict) -> None:
        event = {"event_id": self.ids.new("event"), **event}
        async with self._send_lock:
            if not self.ws.closed:
                await self.ws.send_str(json.dumps(event))

    async def error(self, code: str, message: str, *, param: str | None = None, event_id: str | None = None,
                    type: str = "invalid_request_error") -> None:
        self.s.count_error(FRONT, code)
        await self.send(rt.error_event(self.ids.new("event"), code, message, param=param,
                                       client_event_id=event_id, type=type))

    def _session_object(self) -> dict:
        asr = self.s.asr.engine.model_name if self.s.asr is not None else ""
        return rt.session_object(self.cfg, model=self.model, asr_model=asr)

    # ------------------------------------------------------------------ the connection

    async def serve(self) -> None:
        try:
            async with self.s.admit(FRONT):
                try:
                    await self.send({"type": "session.created", "session": self._session_object()})
                    await self._read()
                finally:
                    await self._stop_pipeline()
        except SessionError as e:  # refused at the door: busy, loading or draining
            await self.error(e.kind.value, e.message, type="server_error")
            self._closing = (_CLOSE.get(e.kind, WSCloseCode.TRY_AGAIN_LATER), e.message)
        finally:
            code, reason = self._closing or (WSCloseCode.OK, "")
            await last_words(self.ws.close(code=code, message=reason[:120].encode()), self.transport)

    async def _read(self) -> None:
        c = self.s.config.server
        limit, key, hint = c.handshake_timeout_s, "server.handshake_timeout_s", "send session.update first"
        while True:
            try:
                msg = await self.ws.receive(timeout=limit or None)
            except TimeoutError:
                message = f"no message from the caller for {limit:g} s ({key}); {hint}"
                log.info("realtime connection closed: %s", message)
                await self.error("idle_timeout", message)
                self._closing = (WSCloseCode.POLICY_VIOLATION, message)
                break
            limit, key = c.idle_timeout_s, "server.idle_timeout_s"
            hint = "send audio while the connection is open, or close it between conversations"
            if msg.type == WSMsgType.TEXT:
                await self._on_text(msg.data)
            elif msg.type == WSMsgType.BINARY:
                await self.error("binary_frames_not_supported", "send JSON text frames; audio travels "
                                 "base64-encoded in input_audio_buffer.append")
            else:
                break
            if self._closing:
                break

    async def _on_text(self, text: str) -> None:
        try:
            try:
                raw = loads(text)
            except ValueError as e:
                raise EventError("invalid_json", f"the message is not valid JSON ({e})") from None
            event = rt.parse_client_event(raw)
            try:
                await self._dispatch(event)
            except (TypeError, AttributeError, KeyError) as e:
                # A field of a JSON type no check above foresaw: the caller's error all the same.
                log.info("realtime: %s event with a field of the wrong type (%s: %s)", event.get("type"),
                         type(e).__name__, cut(e))
                raise EventError("invalid_type", f"a field of {event.get('type')} has the wrong JSON type "
                                 f"({type(e).__name__}: {e}); see the Realtime API reference", None,
                                 event.get("event_id")) from None
        except EventError as e:
            await self.error(e.code, e.message, param=e.param, event_id=e.event_id)

    async def _dispatch(self, event: dict) -> None:
        kind, event_id = event["type"], event.get("event_id")
        if kind == "session.update":
            await self._session_update(event["session"], event_id)
            return
        if not self.configured:
            raise EventError("session_not_configured", f"send session.update (input format, turn detection) "
                             f"before {kind}", "type", event_id)
        if kind == "input_audio_buffer.append":
            await self._append(event["audio"], event_id)
        elif kind == "input_audio_buffer.commit":
            await self._commit(event_id)
        elif kind == "input_audio_buffer.clear":
            self.buffer.clear()
            self._odd = b""
            await self.send({"type": "input_audio_buffer.cleared"})
        elif kind == "output_audio_buffer.clear" or kind == "response.cancel":
            await self._cancel(event_id)
        elif kind == "conversation.item.create":
            await self._item_create(event["item"], event_id)
        elif kind == "response.create":
            await self._response_create(event_id)

    # ------------------------------------------------------------------ client events

    async def _session_update(self, session: dict, event_id: str | None) -> None:
        cfg = rt.apply_session_update(self.cfg, session, event_id, self.vad_defaults)
        if cfg.voice != self.cfg.voice or cfg.speed != self.cfg.speed:
            cfg.voice = await self._voice(cfg, event_id)
        if cfg.language and cfg.language != self.cfg.language:
            where = "session.audio.input.transcription.language"
            try:
                cfg.language = check_language(cfg.language, where)
            except SessionError as e:
                raise EventError("invalid_value", e.message, where, event_id) from None
        self._spec(cfg, event_id)  # validate now: a bad setting is refused before anything changes
        if self.pipeline is not None and cfg != self.cfg:
            await self._stop_pipeline()  # the next audio starts one with the new settings
        self.cfg = cfg
        self.configured = True
        await self.send({"type": "session.updated", "session": self._session_object()})

    async def _voice(self, cfg: RealtimeConfig, event_id) -> str | None:
        if cfg.type == "transcription" or self.s.tts is None:
            return cfg.voice
        try:
            return await resolve_voice(self.s, cfg.voice, cfg.speed, aliases=OPENAI_VOICES)
        except SessionError as e:
            not_found = e.kind is ErrorKind.NOT_FOUND
            raise EventError("voice_not_found" if not_found else "invalid_value", e.message,
                             "session.audio.output." + ("voice" if not_found else "speed"), event_id) from None

    async def _append(self, audio: bytes, event_id) -> None:
        if self.cfg.input_format == "audio/pcm":
            audio = self._odd + audio
            cut = len(audio) - len(audio) % 2
            audio, self._odd = audio[:cut], audio[cut:]
        if not audio:
            return
        if self.cfg.turn_detection is None:
            rate = rt.AUDIO_FORMATS[self.cfg.input_format][1] * (2 if self.cfg.input_format == "audio/pcm" else 1)
            if len(self.buffer) + len(audio) > MAX_BUFFER_S * rate:
                raise EventError("input_audio_buffer_full", f"the input audio buffer holds at most {MAX_BUFFER_S} s; "
                                 "send input_audio_buffer.commit", None, event_id)
            self.buffer += audio
            return
        pipeline = await self._pipeline(event_id)
        await pipeline.inputs.put(core.AudioIn(audio))

    async def _commit(self, event_id) -> None:
        if self.cfg.turn_detection is not None:
            raise EventError("commit_with_server_vad", "turn_detection is server_vad: turns end by themselves; "
                             "commit is for turn_detection null (push-to-talk)", None, event_id)
        if len(self.buffer) < 2:
            raise EventError("input_audio_buffer_commit_empty", "the input audio buffer is empty: append audio "
                             "before commit", None, event_id)
        pipeline = await self._pipeline(event_id)
        item_id = self.ids.new("item")
        data, self.buffer = bytes(self.buffer), bytearray()
        pipeline.manual_items.append(item_id)
        await self.send({"type": "input_audio_buffer.committed", "item_id": item_id,
                         "previous_item_id": self.last_item})
        await self.send({"type": "conversation.item.added", "item": rt.user_item(item_id, None, status="in_progress"),
                         "previous_item_id": self.last_item})
        self.last_item = item_id
        for item in (core.TalkStart(), core.AudioIn(data), core.TalkEnd()):
            await pipeline.inputs.put(item)

    async def _cancel(self, event_id) -> None:
        if self.response is None or self.pipeline is None:
            if event_id is None:
                return
            raise EventError("response_cancel_not_active", "there is no reply to cancel", None, event_id)
        self.response.cancelled_by_client = True
        await self.pipeline.inputs.put(core.StopSpeaking())

    async def _item_create(self, item: dict, event_id) -> None:
        if self.cfg.type == "transcription":
            raise EventError("invalid_event", "a transcription session takes audio only", "type", event_id)
        waiting = sum(len(t) for t in self.pending_text) + len(self.pending_text)  # joined with spaces
        text = rt.user_text(item, event_id, waiting)
        item_id = item.get("id") if isinstance(item.get("id"), str) and item["id"] else self.ids.new("item")
        # As OpenAI does: the item joins the conversation now, and only response.create asks for the
        # answer (with server_vad too: typed text never answers itself).
        self.pending_text.append(text)
        added = rt.user_item(item_id, text=text)
        await self.send({"type": "conversation.item.added", "item": added, "previous_item_id": self.last_item})
        await self.send({"type": "conversation.item.done", "item": added, "previous_item_id": self.last_item})
        self.last_item = item_id

    async def _response_create(self, event_id) -> None:
        if self.cfg.type == "transcription":
            raise EventError("invalid_event", "a transcription session gives no responses", "type", event_id)
        if not self.pending_text:
            return  # spoken turns are answered as they end; nothing else waits for an answer
        if self.response is not None:
            raise EventError("conversation_already_has_active_response", "a response is in progress: wait for "
                             "its response.done (or send response.cancel), then send response.create again",
                             None, event_id)
        pipeline = await self._pipeline(event_id)
        text, self.pending_text = " ".join(self.pending_text), []
        # The core answers it as it answers a transcript: the same reply path, barge-in and cancel.
        await pipeline.inputs.put(core.UserText(text))

    # ------------------------------------------------------------------ the core session

    def _spec(self, cfg: RealtimeConfig, event_id=None):
        enc_in, rate_in = rt.AUDIO_FORMATS[cfg.input_format]
        enc_out, rate_out = rt.AUDIO_FORMATS[cfg.output_format]
        td = cfg.turn_detection
        try:
            if td is None:
                seg = segmentation_for(self.s.config, mode="push_to_talk")
            else:
                seg = segmentation_for(self.s.config, vad_aggressiveness=rt.vad_aggressiveness(td.threshold),
                                       pre_roll_ms=td.prefix_padding_ms, hangover_ms=td.silence_duration_ms,
                                       turn_detection="smart" if td.type == "semantic_vad" else "silence",
                                       eagerness=td.eagerness)
            asr = asr_options_for(self.s.config, language=cfg.language, initial_prompt=cfg.prompt)
            tts = tts_options_for(self.s.config, speed=cfg.speed)  # a Piper voice's pace (Spark's is in cfg.voice)
            return self.s.spec(front=FRONT, input=Format(enc_in, rate_in), output=Format(enc_out, rate_out),
                               voice=cfg.voice, system_prompt=cfg.instructions, segmentation=seg, asr=asr, tts=tts,
                               interim_results=cfg.interim, barge_in=td.interrupt_response if td else True)
        except SessionError as e:
            raise EventError(e.kind.value, e.message, None, event_id) from None

    async def _pipeline(self, event_id) -> _Pipeline:
        if self.pipeline is not None and not self.pipeline.task.done():
            return self.pipeline
        await self._stop_pipeline()  # one that ended by itself: the next input starts a fresh one
        from voiced.core.session import Session

        spec = self._spec(self.cfg, event_id)
        session = Session(self.s, spec, conversational=self.cfg.type == "realtime")
        inputs: asyncio.Queue = asyncio.Queue(maxsize=256)

        async def feed():
            while (item := await inputs.get()) is not None:
                yield item

        task = asyncio.create_task(self._run(session, feed()), name=f"{spec.session_id}:realtime")
        self.pipeline = _Pipeline(session, inputs, task)
        log.info("realtime session %s started (%s, %s in, %s out)", spec.session_id, self.cfg.type,
                 self.cfg.input_format, self.cfg.output_format)
        return self.pipeline

    async def _run(self, session, inputs) -> None:
        try:
            async for ev in session.run(inputs):
                # A caller that stops reading holds this write; the session's outbound budget then
                # ends it (OVER_CAPACITY) instead of the pipeline waiting forever.
                await session.writing(self._on_output(ev))
        except SessionError as e:
            await last_words(self.error(e.kind.value, e.message if e.kind is not ErrorKind.INTERNAL else
                                        INTERNAL_MESSAGE, type="server_error"),
                             self.transport)
            self._close_after(_CLOSE.get(e.kind, WSCloseCode.INTERNAL_ERROR), e.message)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            log.exception("realtime session %s failed", session.spec.session_id)
            self._close_after(WSCloseCode.INTERNAL_ERROR, "internal error")

    def _close_after(self, code: int, reason: str) -> None:
        # From the pipeline's task: closing the socket ends the reader loop, which stops the pipeline.
        self._closing = (code, reason)
        self._closer = asyncio.ensure_future(last_words(self.ws.close(code=code, message=reason[:120].encode()),
                                                        self.transport))

    async def _stop_pipeline(self) -> None:
        pipeline, self.pipeline = self.pipeline, None
        if pipeline is None:
            return
        pipeline.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pipeline.task
        await pipeline.session.close()
        if self.response is not None:
            await self._end_response("cancelled", reason="client_cancelled")
        self.turns.clear()

    # ------------------------------------------------------------------ core events -> Realtime events

    async def _on_output(self, ev) -> None:
        if isinstance(ev, core.SpeechStarted):
            if self.cfg.turn_detection is None:
                item_id = self.pipeline.manual_items.pop(0) if self.pipeline and self.pipeline.manual_items \
                    else self.ids.new("item")
                self.turns[ev.turn_id] = _Turn(item_id)
                return  # push-to-talk: the commit already said it all
            item_id = self.ids.new("item")
            self.turns[ev.turn_id] = _Turn(item_id)
            await self.send({"type": "input_audio_buffer.speech_started", "audio_start_ms": ev.offset_ms,
                             "item_id": item_id})
        elif isinstance(ev, core.SpeechEnded):
            turn = self.turns.get(ev.turn_id)
            if turn is None or self.cfg.turn_detection is None:
                return
            await self.send({"type": "input_audio_buffer.speech_stopped", "audio_end_ms": ev.offset_ms,
                             "item_id": turn.item_id})
            await self.send({"type": "input_audio_buffer.committed", "item_id": turn.item_id,
                             "previous_item_id": self.last_item})
            await self.send({"type": "conversation.item.added", "previous_item_id": self.last_item,
                             "item": rt.user_item(turn.item_id, None, status="in_progress")})
            self.last_item = turn.item_id
        elif isinstance(ev, core.TranscriptOut):
            await self._transcript(ev)
        elif isinstance(ev, core.TurnWithoutWords):
            # its words were dropped as a likely hallucination: its transcription failed, saying what and why
            # (Realtime's event for a failed transcription), the item is done empty, and no response follows
            await self._complete(ev, "", dropped=f"dropped {ev.text.strip()!r} as a likely hallucination: {ev.reason}")
        elif isinstance(ev, core.AgentTextOut):
            response = await self._open_response(ev.turn_id)
            await self._transcript_delta(response, ev.text if not response.transcript else " " + ev.text)
        elif isinstance(ev, core.ReplyStarted):
            fresh = self.response is None
            response = await self._open_response(ev.turn_id)
            response.reply_id = ev.reply_id
            if fresh:  # a reply with fixed text (no agent words came before it)
                await self._transcript_delta(response, ev.text)
        elif isinstance(ev, core.AudioOut):
            response = self.response
            if response is None or response.audio_done:
                return
            await self.send({"type": "response.output_audio.delta", **self._part(response),
                             "delta": base64.b64encode(ev.audio).decode()})
            if ev.last:
                response.audio_done = True
                await self.send({"type": "response.output_audio.done", **self._part(response)})
        elif isinstance(ev, core.ReplyFinished):
            await self._end_response("completed")
        elif isinstance(ev, core.ReplyInterrupted):
            cancelled = self.response is not None and self.response.cancelled_by_client
            await self._end_response("cancelled", reason="client_cancelled" if cancelled else "turn_detected")
        elif isinstance(ev, core.NoticeOut):
            await self.error(ev.code.lower(), ev.message, type="server_error")
            if self.response is not None and ev.code.startswith(("AGENT", "TTS", "REPLY")):
                await self._end_response("failed", error=(ev.code.lower(), ev.message))
        elif isinstance(ev, core.HangupOut):
            self._close_after(WSCloseCode.OK, ev.reason or "the agent ended the call")

    async def _transcript(self, ev) -> None:
        turn = self.turns.get(ev.turn_id)
        if turn is None:
            return
        text = ev.transcript.text.strip()
        if not ev.is_final:
            # Realtime's deltas only append: send the part of a revised partial that extends the last one.
            if text.startswith(turn.partial) and len(text) > len(turn.partial):
                delta, turn.partial = text[len(turn.partial):], text
                await self.send({"type": "conversation.item.input_audio_transcription.delta",
                                 "item_id": turn.item_id, "content_index": 0, "delta": delta})
            return
        await self._complete(ev, text)

    async def _complete(self, ev, text: str, dropped: str | None = None) -> None:
        """The user item of `ev`'s turn (a final transcript, or a turn without words: `dropped` says why) is
        done, with `text`."""
        turn = self.turns.pop(ev.turn_id, None)
        if turn is None:
            return
        if dropped is None:
            self.heard = {t: item for t, item in self.heard.items() if t > ev.turn_id - 16}  # a few unanswered
            self.heard[ev.turn_id] = turn.item_id
        if dropped is not None:
            await self.send({"type": "conversation.item.input_audio_transcription.failed", "item_id": turn.item_id,
                             "content_index": 0, "error": {"type": "transcription_error", "code": "likely_hallucination",
                                                           "message": dropped, "param": None}})
        else:
            await self.send({"type": "conversation.item.input_audio_transcription.completed",
                             "item_id": turn.item_id, "content_index": 0, "transcript": text,
                             "usage": {"type": "duration",
                                       "seconds": round(max(0.0, (ev.end_ms - ev.start_ms) / 1000), 3)}})
        await self.send({"type": "conversation.item.done", "item": rt.user_item(turn.item_id, text)})

    def _part(self, r: _Response) -> dict:
        return {"response_id": r.response_id, "item_id": r.item_id, "output_index": 0, "content_index": 0}

    async def _open_response(self, turn_id: int) -> _Response:
        if self.response is not None:
            return self.response
        r = self.response = _Response(self.ids.new("resp"), self.ids.new("item"), turn_id,
                                      answers=self.heard.pop(turn_id, ""))
        await self.send({"type": "response.created", "response": self._response(r, "in_progress")})
        item = rt.assistant_item(r.item_id, None, "in_progress")
        await self.send({"type": "response.output_item.added", "response_id": r.response_id, "output_index": 0,
                         "item": item})
        await self.send({"type": "conversation.item.added", "item": item, "previous_item_id": self.last_item})
        self.last_item = r.item_id
        await self.send({"type": "response.content_part.added", **self._part(r),
                         "part": {"type": "audio", "transcript": ""}})
        return r

    def _response(self, r: _Response, status: str, **kw) -> dict:
        output = [rt.assistant_item(r.item_id, r.transcript, "completed" if status == "completed" else
                                    "incomplete")] if status != "in_progress" else []
        resp = rt.response_object(r.response_id, status, output=output, voice=self.cfg.voice,
                                  output_format=self.cfg.output_format, **kw)
        if r.answers:
            resp["metadata"] = {"item_id": r.answers}
        return resp

    async def _transcript_delta(self, r: _Response, delta: str) -> None:
        if delta:
            r.transcript += delta
            await self.send({"type": "response.output_audio_transcript.delta", **self._part(r), "delta": delta})

    async def _end_response(self, status: str, **kw) -> None:
        r, self.response = self.response, None
        if r is None:
            return
        if not r.audio_done:
            await self.send({"type": "response.output_audio.done", **self._part(r)})
        await self.send({"type": "response.output_audio_transcript.done", **self._part(r), "transcript": r.transcript})
        await self.send({"type": "response.content_part.done", **self._part(r),
                         "part": {"type": "audio", "transcript": r.transcript}})
        item = rt.assistant_item(r.item_id, r.transcript, "completed" if status == "completed" else "incomplete")
        await self.send({"type": "response.output_item.done", "response_id": r.response_id, "output_index": 0,
                         "item": item})
        await self.send({"type": "conversation.item.done", "item": item})
        await self.send({"type": "response.done", "response": self._response(r, status, **kw)})
