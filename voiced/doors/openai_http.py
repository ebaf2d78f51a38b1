"""OpenAI's audio API on the HTTP listener: transcriptions, translations, speech, models, voices.

A tool that speaks OpenAI's API (the `openai` SDKs, chat front ends, home-automation and workflow
tools) points its base URL at `http://HOST:PORT/v1` and works unchanged:

    POST /v1/audio/transcriptions   multipart: file, model, language, prompt, temperature,
    POST /v1/audio/translations     response_format (json|text|srt|vtt|verbose_json),
                                    timestamp_granularities[], stream
    POST /v1/audio/speech           JSON: model, input, voice, response_format, speed, stream_format
    GET  /v1/models, /v1/models/{id}, /v1/audio/voices

Model names: the loaded models' own names, or OpenAI's (`whisper-1`, `gpt-4o-transcribe`, ...,
`tts-1`, `gpt-4o-mini-tts`, ...), which mean the loaded model. Voices: the daemon's presets and
cloned voices by name; OpenAI's voice names map onto presets (voiced.doors.shared.OPENAI_VOICES)
unless a cloned voice has that name. Everything else a caller can get wrong is an error in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from dataclasses import fields, replace

from aiohttp import web
from aiohttp_sse import sse_response

from voiced.audio.files import ACCEPTED_NAMES, SPEECH_FORMATS, AudioFileError, SpeechEncoder, decode_file
from voiced.audio.ingest import Format
from voiced.core import speech
from voiced.core.errors import ErrorKind, SessionError
from voiced.core.spec import MAX_TEXT_CHARS, asr_options_for, check_language, tts_options_for
from voiced.doors.guard import TooLarge, cut, read_capped
from voiced.doors.shared import OPENAI_VOICES, HttpError, from_session_error, json_body
from voiced.doors.transcripts import RESPONSE_FORMATS, Recognized, render
from voiced.engines.base import ASROptions, Transcript

log = logging.getLogger(__name__)

FRONT = "openai"
SPEECH_RATE = 24000  # what OpenAI's clients expect: `pcm` is 24 kHz 16-bit mono, and so is every format here
ASR_ALIASES = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe", "gpt-4o-mini-transcribe-2025-12-15",
               "gpt-transcribe", "gpt-4o-transcribe-diarize")
TTS_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15")
MAX_JSON_BYTES = 1024 * 1024  # a speech request: 4096 characters and a few options
MAX_FIELD_BYTES = 64 * 1024  # a text field of an upload (a prompt is at most 2000 characters)
# /v1/audio/speech's fields and the JSON types each takes (OpenAI's API reference).
SPEECH_FIELDS: dict[str, tuple] = {"model": (str,), "input": (str,), "voice": (str, dict),
                                   "response_format": (str,), "stream_format": (str,), "speed": (int, float),
                                   "instructions": (str,)}
JSON_NAMES = {str: "a string", dict: "an object", int: "a number", float: "a number", list: "an array",
              bool: "true or false"}
WORD_TIMINGS = "words" in {f.name for f in fields(Transcript)}  # the engine reports word times
# The recognition option that asks for them (named by the word-timing work when it lands).
WORD_OPTION = next((n for n in ("word_timestamps", "words") if n in {f.name for f in fields(ASROptions)}), None)


def routes(services) -> list[web.RouteDef]:
    api = OpenAIAudio(services)
    return [
        web.post("/v1/audio/transcriptions", api.transcriptions),
        web.post("/v1/audio/translations", api.translations),
        web.post("/v1/audio/speech", api.speech),
        web.get("/v1/models", api.models),
        web.get("/v1/models/{model}", api.model),
        web.get("/v1/audio/voices", api.voices),
    ]


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> HttpError:
    return HttpError(400, message, param=param, code=code)


async def resolve_voice(services, voice, speed: float = 1.0) -> str | None:
    """A request's voice (a name, {"id": name} or None) as the engine names it (voiced.core.speech), or
    HttpError: 404 for an unknown one, 400 for a speed the voice cannot take."""
    if isinstance(voice, dict):
        voice = voice.get("id")
    if voice is not None and (not isinstance(voice, str) or not voice.strip()):
        raise _bad("voice must be a voice name (GET /v1/audio/voices)", "voice")
    try:
        return await speech.resolve_voice(services, voice, speed, aliases=OPENAI_VOICES)
    except SessionError as e:
        not_found = e.kind is ErrorKind.NOT_FOUND
        raise HttpError(404 if not_found else 400, e.message, param="voice" if not_found else "speed",
                        code="voice_not_found" if not_found else "invalid_value") from None


class OpenAIAudio:
    def __init__(self, services):
        self.s = services
        self.created = int(time.time())

    # ------------------------------------------------------------------ models

    def _names(self, kind: str) -> list[str]:
        worker = getattr(self.s, kind)
        return [worker.engine.model_name] if worker is not None else []

    def _check_model(self, kind: str, model: str | None) -> None:
        if not model:
            raise _bad("model is required (e.g. " + ("whisper-1" if kind == "asr" else "tts-1")
                       + " or the name from GET /v1/models)", "model", "missing_required_parameter")
        loaded = self._names(kind)
        if model in loaded or (loaded and model in (ASR_ALIASES if kind == "asr" else TTS_ALIASES)):
            return
        what = "transcription" if kind == "asr" else "speech"
        raise HttpError(404, f"the model {model!r} does not exist on this server; for {what} use "
                        + ", ".join(loaded + list(ASR_ALIASES if kind == "asr" else TTS_ALIASES)[:3])
                        if loaded else f"this server has no {what} model loaded", param="model",
                        code="model_not_found")

    def _model(self, name: str, kind: str) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "voiced", "kind": kind}

    async def models(self, request: web.Request) -> web.Response:
        data = [self._model(n, "transcription") for n in self._names("asr")]
        data += [self._model(n, "speech") for n in self._names("tts")]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        for kind, label, aliases in (("asr", "transcription", ASR_ALIASES), ("tts", "speech", TTS_ALIASES)):
            if name in self._names(kind) or (self._names(kind) and name in aliases):  # what POST accepts
                return web.json_response(self._model(name, label))
        raise HttpError(404, f"the model {name!r} does not exist on this server; see GET /v1/models",
                        param="model", code="model_not_found")

    async def voices(self, request: web.Request) -> web.Response:
        self.s.check_ready(need_tts=True)
        voices = await asyncio.to_thread(speech.list_voices, self.s)
        return web.json_response({"object": "list", "data": [
            {"id": v.name, "object": "audio.voice", "name": v.name, "kind": v.kind, "description": v.description}
            for v in voices]})

    # ------------------------------------------------------------------ transcription

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self._recognize(request, "transcribe")

    async def translations(self, request: web.Request) -> web.StreamResponse:
        return await self._recognize(request, "translate")

    async def _form(self, request: web.Request) -> tuple[dict[str, list[str]], bytes | None]:
        """The multipart form's text fields (each may repeat) and the `file` bytes, within the limit."""
        if request.content_type != "multipart/form-data":
            raise HttpError(415, f"send multipart/form-data (a `file` field with the audio), not "
                            f"{request.content_type or 'no content type'}", code="unsupported_media_type")
        c = self.s.config.http
        limit = c.max_upload_bytes
        if request.content_length is not None and request.content_length > limit + 64 * 1024:
            raise HttpError(413, f"the upload is {request.content_length} bytes; this server takes files up to "
                            f"{limit} bytes (http.max_upload_bytes)", param="file", code="file_too_large",
                            close=True)
        fields_: dict[str, list[str]] = {}
        data: bytes | None = None
        # Counted in what is read (a chunked body has no Content-Length): every part together, the file
        # and its framing, at most limit + 64 KiB, as the header check above.
        left = limit + 64 * 1024
        count = 0
        try:
            async with asyncio.timeout(c.body_timeout_s or None):
                reader = await request.multipart()
                while (part := await reader.next()) is not None:
                    count += 1
                    if count > c.max_form_fields:
                        raise _bad(f"the form has more than {c.max_form_fields} fields (http.max_form_fields); "
                                   "send the file and the options this API takes", code="too_many_fields")
                    name = part.name or ""
                    if name == "file":
                        value = await self._part(part, min(limit, left), "the file is larger than this server "
                                                 f"takes ({limit} bytes, http.max_upload_bytes); send a shorter "
                                                 "or more compressed clip", "file")
                        data = value
                    else:
                        value = await self._part(part, min(MAX_FIELD_BYTES, left), f"the field {cut(name)!r} "
                                                 f"is over {MAX_FIELD_BYTES} bytes", name)
                        try:
                            text = value.decode(part.get_charset(default="utf-8"))
                        except (LookupError, UnicodeDecodeError):
                            raise _bad(f"the field {cut(name)!r} is not text", name) from None
                        fields_.setdefault(name.removesuffix("[]"), []).append(text)
                    left -= len(value)
        except TimeoutError:
            raise HttpError(408, f"the upload did not arrive within {c.body_timeout_s:g} s (http.body_timeout_s)",
                            code="request_timeout", close=True) from None
        except (ValueError, AssertionError) as e:  # aiohttp's multipart parser on a malformed body
            raise _bad(f"the multipart body cannot be read ({cut(e)})") from None
        return fields_, data

    @staticmethod
    async def _part(part, limit: int, too_large: str, param: str) -> bytes:
        encoding = part.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise HttpError(415, f"the part {cut(param)!r} has Content-Encoding {cut(encoding)!r}; send it "
                            "uncompressed", param=param, code="unsupported_content_encoding", close=True)
        buf = bytearray()
        while chunk := await part.read_chunk(64 * 1024):
            buf += chunk
            if len(buf) > limit:
                raise HttpError(413, too_large, param=param, code="file_too_large" if param == "file"
                                else "request_too_large", close=True)
        # A Content-Transfer-Encoding (base64, quoted-printable) only shrinks what is read.
        return bytes(part.decode(buf)) if part.headers.get("Content-Transfer-Encoding") else bytes(buf)

    async def _recognize(self, request: web.Request, task: str) -> web.StreamResponse:
        form, data = await self._form(request)
        self.s.check_ready()

        def one(name: str, default: str | None = None) -> str | None:
            values = form.get(name)
            return values[-1].strip() if values else default

        if data is None:
            raise _bad(f"the `file` field is missing: upload the audio ({ACCEPTED_NAMES}) as `file`", "file",
                       "missing_required_parameter")
        self._check_model("asr", one("model"))
        response_format = one("response_format", "json")
        if response_format not in RESPONSE_FORMATS:
            raise _bad(f"response_format {response_format!r} is not served; use one of {', '.join(RESPONSE_FORMATS)}",
                       "response_format")
        granularities = tuple(g.strip() for g in form.get("timestamp_granularities", []))
        for g in granularities:
            if g not in ("segment", "word"):
                raise _bad(f"timestamp_granularities {g!r} is unknown; use segment and/or word",
                           "timestamp_granularities")
        if granularities and response_format != "verbose_json":
            raise _bad("timestamp_granularities needs response_format=verbose_json", "timestamp_granularities")
        if "word" in granularities and not WORD_TIMINGS:
            raise _bad("word timestamps are not available from this server's speech recognizer yet; "
                       "ask for timestamp_granularities[]=segment", "timestamp_granularities", "unsupported_value")
        stream = (one("stream", "false") or "false").lower()
        if stream not in ("true", "false"):
            raise _bad("stream must be true or false", "stream")
        temperature = one("temperature")
        if temperature is not None:
            try:
                t = float(temperature)
            except ValueError:
                t = -1.0
            if not 0.0 <= t <= 1.0:
                raise _bad("temperature must be a number from 0 to 1", "temperature")
        try:
            language = check_language(one("language"), "language")
        except SessionError as e:
            raise from_session_error(e, "language") from None
        try:
            opts = asr_options_for(self.s.config, language=language, task=task, initial_prompt=one("prompt") or None)
        except SessionError as e:
            raise from_session_error(e) from None
        # Every format decodes alike (with timestamps, as openai-whisper's transcribe() does), so each says the
        # same words: decoded without them, a clip's text could differ, or be judged a hallucination and dropped,
        # in json and text but not in verbose_json.
        opts = replace(opts, timestamps=True,
                       **({WORD_OPTION: True} if "word" in granularities and WORD_OPTION else {}))
        try:
            pcm, duration = await asyncio.to_thread(decode_file, data, 16000, speech.MAX_CLIP_S)
        except AudioFileError as e:
            raise _bad(str(e), "file", "invalid_audio") from None
        if stream == "true":
            return await self._stream_transcript(request, pcm, opts)
        results = [Recognized(u.start / 16000, u.end / 16000, t) for u, t in
                   await speech.recognize_clip(self.s, pcm, opts)]
        body, content_type = render(results, response_format, task=task, duration=duration, language=language,
                                    granularities=granularities or ("segment",))
        return web.Response(body=body.encode(), headers={"Content-Type": content_type})

    async def _stream_transcript(self, request: web.Request, pcm, opts) -> web.StreamResponse:
        """`transcript.text.delta` per utterance as its transcript is ready (in order), then `.done`."""
        async with contextlib.aclosing(speech.recognize_clip_stream(self.s, pcm, opts)) as results:
            try:
                first = await anext(results, None)  # errors before the first byte are proper statuses
            except SessionError as e:
                raise from_session_error(e) from None
            texts: list[str] = []
            async with sse_response(request, allow_all_methods=True, sep="\n") as sse:
                try:
                    if first is not None:
                        await self._delta(sse, first[1], texts)
                        async for _, transcript in results:
                            await self._delta(sse, transcript, texts)
                except SessionError as e:
                    await sse.send(json.dumps(from_session_error(e).body()))
                    return sse
                await sse.send(json.dumps({"type": "transcript.text.done", "text": " ".join(texts)}))
            return sse

    @staticmethod
    async def _delta(sse, transcript: Transcript, texts: list[str]) -> None:
        text = transcript.text.strip()
        if text:
            await sse.send(json.dumps({"type": "transcript.text.delta", "delta": text if not texts else " " + text}))
            texts.append(text)

    # ------------------------------------------------------------------ speech

    async def speech(self, request: web.Request) -> web.StreamResponse:
        if request.content_type != "application/json":
            raise HttpError(415, f"send a JSON body (Content-Type: application/json), not "
                            f"{request.content_type or 'no content type'}", code="unsupported_media_type")
        if request.content_length is not None and request.content_length > MAX_JSON_BYTES:
            raise HttpError(413, "the request body is over 1 MiB", code="request_too_large", close=True)
        try:
            raw = await read_capped(request.content, MAX_JSON_BYTES, self.s.config.http.body_timeout_s)
        except TooLarge:
            raise HttpError(413, "the request body is over 1 MiB", code="request_too_large", close=True) from None
        except TimeoutError:
            raise HttpError(408, f"the body did not arrive within {self.s.config.http.body_timeout_s:g} s "
                            "(http.body_timeout_s)", code="request_timeout", close=True) from None
        try:
            body = json_body(raw.decode(request.charset or "utf-8"))
        except (LookupError, UnicodeDecodeError):
            raise _bad("the body is not UTF-8 text") from None
        for name, kinds in SPEECH_FIELDS.items():
            if body.get(name) is not None and (not isinstance(body[name], kinds) or isinstance(body[name], bool)
                                               and bool not in kinds):
                raise _bad(f"{name} must be {' or '.join(JSON_NAMES[k] for k in kinds)}, not "
                           f"{JSON_NAMES.get(type(body[name]), type(body[name]).__name__)}", name, "invalid_type")
        self.s.check_ready(need_tts=True)
        self._check_model("tts", body.get("model"))
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise _bad("input is required: the text to speak", "input", "missing_required_parameter")
        limit = self.s.config.http.max_input_chars
        if len(text) > limit:
            raise _bad(f"input is {len(text)} characters; this server speaks up to {limit} per request "
                       "(http.max_input_chars)", "input", "string_above_max_length")
        fmt_name = body.get("response_format") or "mp3"
        if fmt_name not in SPEECH_FORMATS:
            raise _bad(f"response_format {fmt_name!r} is not served; use one of {', '.join(SPEECH_FORMATS)}",
                       "response_format")
        stream_format = body.get("stream_format") or "audio"
        if stream_format not in ("audio", "sse"):
            raise _bad("stream_format must be audio or sse", "stream_format")
        speed = body.get("speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0.25 <= speed <= 4.0:
            raise _bad("speed must be a number from 0.25 to 4.0", "speed")
        voice = await resolve_voice(self.s, body.get("voice"), float(speed))
        try:
            opts = tts_options_for(self.s.config, voice=voice, speed=float(speed))
        except SessionError as e:
            raise from_session_error(e) from None
        chunks = _synthesize_pieces(self.s, _pieces(text, MAX_TEXT_CHARS), opts)
        async with contextlib.aclosing(chunks):
            try:
                first = await anext(chunks)  # the status line waits for the first chunk: errors are statuses
            except StopAsyncIteration:
                first = None
            except SessionError as e:
                raise from_session_error(e) from None
            encoder = SpeechEncoder(SPEECH_FORMATS[fmt_name], SPEECH_RATE)
            try:
                if stream_format == "sse":
                    return await self._speech_sse(request, first, chunks, encoder)
                return await self._speech_audio(request, first, chunks, encoder)
            finally:
                encoder.close()

    async def _speech_audio(self, request, first, chunks, encoder: SpeechEncoder) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": encoder.format.content_type})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            if first is not None:
                await resp.write(encoder.encode(_pcm(first.audio)))
                async for chunk in chunks:
                    if data := encoder.encode(_pcm(chunk.audio)):
                        await resp.write(data)
            await resp.write(encoder.finish())
        except SessionError as e:
            # The status line has gone: end the body unfinished, so the client sees a broken transfer.
            log.warning("speech: %s after the first chunk; ending the response early", e.message)
            request.transport and request.transport.close()
            return resp
        await resp.write_eof()
        return resp

    async def _speech_sse(self, request, first, chunks, encoder: SpeechEncoder) -> web.StreamResponse:
        async with sse_response(request, allow_all_methods=True, sep="\n") as sse:
            async def send(data: bytes):
                if data:
                    await sse.send(json.dumps({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}))

            try:
                if first is not None:
                    await send(encoder.encode(_pcm(first.audio)))
                    async for chunk in chunks:
                        await send(encoder.encode(_pcm(chunk.audio)))
                await send(encoder.finish())
                await sse.send(json.dumps({"type": "speech.audio.done"}))
            except SessionError as e:
                await sse.send(json.dumps(from_session_error(e).body()))
        return sse


def _pieces(text: str, limit: int) -> list[str]:
    """`text` in pieces of at most `limit` characters (the core's one request), each cut after the last
    sentence end or space that fits, so `http.max_input_chars` may be above the core's limit."""
    pieces = []
    while len(text) > limit:
        head = text[:limit]
        at = max(head.rfind(". "), head.rfind("! "), head.rfind("? "), head.rfind("\n"))
        at = at + 1 if at > limit // 2 else head.rfind(" ")
        at = at if at > 0 else limit
        pieces.append(text[:at].strip())
        text = text[at:]
    return [p for p in pieces + [text.strip()] if p]


async def _synthesize_pieces(services, pieces: list[str], opts):
    """speech.synthesize over each piece in turn, as one stream of chunks."""
    for piece in pieces:
        async with contextlib.aclosing(speech.synthesize(services, piece, opts, Format("LINEAR16", SPEECH_RATE))) \
                as chunks:
            async for chunk in chunks:
                yield chunk


def _pcm(data: bytes):
    import numpy as np

    return np.frombuffer(data, dtype="<i2")

