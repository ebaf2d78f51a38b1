"""The gRPC front door: the voiced.v1 service, health, reflection and bearer-token auth.

A thin adapter: requests become the core's input events and settings (voiced.doors.grpc_wire),
the core's events become SessionEvents, and a SessionError's kind becomes a status code. Health
says NOT_SERVING until the Daemon has loaded the models and again once it drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc

import voiced
from voiced.audio.ingest import MAX_RATE, MIN_RATE, ms
from voiced.core import speech
from voiced.core.errors import ErrorKind, SessionError, invalid
from voiced.core.services import Services
from voiced.core.session import Session
from voiced.doors import grpc_wire as wire
from voiced.doors.guard import check_id, connections
from voiced.doors.shared import CLOSE_GRACE_S

log = logging.getLogger(__name__)

FRONT = "grpc"
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Voiced"].full_name

STATUS = {
    ErrorKind.BAD_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.OVER_CAPACITY: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.NOT_ENABLED: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


class VoicedService(pb_grpc.VoicedServicer):
    def __init__(self, services: Services):
        self.s = services

    async def _abort(self, context, error: Exception):
        """End the call with the status for `error`: a SessionError's kind, or INTERNAL for a bug (its
        traceback goes to the log, never to the caller)."""
        if isinstance(error, grpc.aio.AbortError):
            raise error  # already aborted
        if not isinstance(error, SessionError):
            log.error("internal error in a %s call", FRONT, exc_info=error)
            error = SessionError(ErrorKind.INTERNAL, f"internal error ({type(error).__name__}); the server's log "
                                                     "has the details")
        code = STATUS[error.kind]
        self.s.count_error(FRONT, code.name)
        # gRPC keeps the abort exception after the call; it chains `error`, whose traceback (and the
        # exception it was raised while handling) holds the frames, and so the session, its audio and
        # codecs, it was raised through. Drop them.
        error.__traceback__ = error.__context__ = error.__cause__ = None
        await context.abort(code, error.message)

    # ------------------------------------------------------------------ streaming sessions

    async def Converse(self, request_iterator, context):
        await self._session(request_iterator, context, conversational=True)

    async def StreamingRecognize(self, request_iterator, context):
        await self._session(request_iterator, context, conversational=False)

    async def _session(self, requests, context, conversational: bool):
        """Writes with `context.write` (not by yielding): a caller that stops reading blocks the write,
        and `Session.writing` gives it up when the session ends (RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED)."""
        s = self.s
        session = None
        try:
            # Read the first message before any refusal: aborting a stream whose first write is
            # still in flight makes some gRPC clients report INTERNAL instead of our status.
            first = await _first(requests, s.config.server.idle_timeout_s)
            async with s.admit(FRONT) as admission:
                if first is None:
                    admission.outcome = "empty"
                    return
                if first.WhichOneof("request") != "config":
                    raise invalid("the first message must be `config` (a SessionConfig); "
                                  "audio and control come after it")
                config = first.config
                if (problem := check_id(config.session_id, "config.session_id")) is not None:
                    raise invalid(problem)
                session_id = config.session_id or s.new_session_id(FRONT)
                spec = wire.session_spec(config, s, session_id, conversational)
                session = Session(s, spec, conversational)
                log.info("session %s started (%s, %s %d Hz)", session_id, "Converse" if conversational else
                         "StreamingRecognize", spec.input.encoding, spec.input.sample_rate)
                # The response headers go now, on their own: grpc's aio server counts them as sent only
                # once the first write completes, so a first write that `Session.fail` gives up midway
                # made it send them again with the status, which gRPC's core refuses, and the caller
                # waited forever for an answer.
                await context.send_initial_metadata(())
                async for event in session.run(_SessionInputs(context)):
                    message = wire.event_to_proto(event, config)
                    if message is not None:
                        await session.writing(context.write(message))
        except Exception as e:
            await self._abort(context, e)
        finally:
            if session is not None:
                await session.close()
                session = None  # this frame outlives the call in gRPC's abort traceback

    # ------------------------------------------------------------------ one-shot recognition

    async def Recognize(self, request, context):
        try:
            self.s.check_ready()
            fmt = wire.audio_format(request.format, "format") if request.HasField("format") else None
            audio, duration = speech.decode_clip(request.audio, fmt)
            opts = wire.asr_options(request.recognition, self.s.config)
            if request.recognition.disabled:
                raise invalid("recognition.disabled makes no sense for Recognize")
            results = await speech.recognize_clip(self.s, audio, opts,
                                                  keep_hallucinations=request.recognition.keep_hallucinations)
        except Exception as e:
            await self._abort(context, e)
        return pb.RecognizeResponse(
            duration_s=duration,
            results=[wire.transcript_to_proto(r, is_final=True, start_ms=ms(u.start), end_ms=ms(u.end)) for u, r in results],
        )

    # ------------------------------------------------------------------ speaking side

    async def Synthesize(self, request, context):
        try:
            self.s.check_ready(need_tts=True)
            fmt = (wire.audio_format(request.output_format, "output_format")
                   if request.HasField("output_format") else speech.PCM16K)
            opts = wire.tts_options(request.speech, self.s.config)
            # aclosing: a caller that hangs up mid-speech frees its engine request now, not at the
            # generator's garbage collection.
            async with contextlib.aclosing(speech.synthesize(self.s, request.text, opts, fmt)) as chunks:
                async for c in chunks:
                    yield pb.SynthesizeResponse(audio=pb.AudioChunk(sequence=c.sequence, offset_ms=c.offset_ms,
                                                                    last=c.last, audio=c.audio))
        except Exception as e:
            await self._abort(context, e)

    async def ListVoices(self, request, context):
        try:
            self.s.check_ready(need_tts=True)
            return pb.ListVoicesResponse(voices=[wire.voice_to_proto(v) for v in speech.list_voices(self.s)])
        except Exception as e:
            await self._abort(context, e)

    async def AddVoice(self, request, context):
        try:
            self.s.check_ready(need_tts=True)
            fmt = wire.audio_format(request.format, "format") if request.HasField("format") else None
            pcm, duration = speech.decode_clip(request.audio, fmt)
            voice = await speech.add_voice(self.s, request.name, pcm, duration, request.transcript)
            return wire.voice_to_proto(voice)
        except Exception as e:
            await self._abort(context, e)

    # ------------------------------------------------------------------ info

    async def GetServerInfo(self, request, context):
        s = self.s
        info = pb.ServerInfo(
            version=voiced.__version__,
            max_sessions=s.config.server.max_sessions,
            active_sessions=s.active_sessions,
            max_message_bytes=s.config.server.max_message_bytes,
            agents=s.agents.names(),
            min_sample_rate_hz=MIN_RATE,
            max_sample_rate_hz=MAX_RATE,
            doors=[pb.Door(name=name, address=address) for name, address in s.doors.items()],
        )
        for name, worker in (("asr", s.asr), ("tts", s.tts)):
            if worker is not None:
                e = worker.engine
                getattr(info, name).CopyFrom(pb.ModelInfo(name=e.model_name, backend=e.backend, device=e.device))
        return info


async def _first(requests, idle_timeout_s: float):
    """The stream's first message (None: the caller closed without one), within the idle limit."""

    async def first():
        async for request in requests:
            return request
        return None

    if idle_timeout_s <= 0:
        return await first()
    try:
        return await asyncio.wait_for(first(), idle_timeout_s)
    except asyncio.TimeoutError:
        raise SessionError(ErrorKind.TIMEOUT, f"no message from the caller for {idle_timeout_s:g} s "
                                              "(server.idle_timeout_s); send the config first") from None


class _SessionInputs:
    """The requests after the config, as the core's input events, read with `context.read()`.

    This is the frame path (50 messages a second per caller, on the event loop). Reading through grpc's
    request iterator stacked three async generators on that read (grpc's own, DecodeGuard's check, the
    mapping), and every message passes each frame twice (down to the read's future and back up); here
    one coroutine does all three. (The iterator is only a generator over the same `read()`, so the
    config, read from it first, and the rest read here come in order.)"""

    def __init__(self, context):
        self._read = context.read

    def __aiter__(self):
        return self

    async def __anext__(self):
        request = await self._read()
        if request is grpc.aio.EOF:
            raise StopAsyncIteration
        if type(request) is _Undecodable:
            raise invalid(request.message)
        return wire.input_event(request)


# ---------------------------------------------------------------------------- undecodable requests


class _Undecodable:
    """Stands in for a request body that is not valid protobuf, so the call can answer it."""

    def __init__(self, message: str):
        self.message = message


class DecodeGuard(grpc.aio.ServerInterceptor):
    """A request body that is not valid protobuf gets INVALID_ARGUMENT naming the RPC and the message
    type. grpc's generated handlers deserialize before our code runs, and a deserializer that raises
    makes grpc answer UNKNOWN; this wraps each Voiced handler's deserializer to hand the call a marker
    instead, which the call answers (a streaming call's request iterator raises on it; the sessions'
    `_SessionInputs`, which reads with `context.read()`, checks it itself)."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        prefix = f"/{SERVICE_NAME}/"
        if handler is None or not details.method.startswith(prefix):
            return handler
        return _guarded(handler, details.method[len(prefix):])


_RPC_TYPES = {m.name: m.input_type.full_name for m in pb.DESCRIPTOR.services_by_name["Voiced"].methods}


def _guarded(handler, rpc: str):
    type_name = _RPC_TYPES.get(rpc, "request")
    message = (f"the {rpc} request is not a valid {type_name} message (its protobuf bytes cannot be decoded); "
               f"send a {type_name} serialized with the voiced.v1 protos (grpcurl: pass JSON with -d)")
    deserialize = handler.request_deserializer

    def guarded(data: bytes):
        try:
            return deserialize(data)
        except DecodeError:
            return _Undecodable(message)

    async def checked(requests):
        async for request in requests:
            if isinstance(request, _Undecodable):
                raise invalid(request.message)
            yield request

    async def refuse(context):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)

    if handler.request_streaming:
        behavior = handler.stream_stream if handler.response_streaming else handler.stream_unary
        if inspect.isasyncgenfunction(behavior):
            async def streaming_in(requests, context):
                async for response in behavior(checked(requests), context):
                    yield response
        else:
            async def streaming_in(requests, context):
                return await behavior(checked(requests), context)
        make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
        return make(streaming_in, request_deserializer=guarded, response_serializer=handler.response_serializer)
    if handler.response_streaming:
        behavior = handler.unary_stream

        async def unary_in_stream_out(request, context):
            if isinstance(request, _Undecodable):
                await refuse(context)
            async for response in behavior(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_in_stream_out, request_deserializer=guarded,
                                                    response_serializer=handler.response_serializer)
    behavior = handler.unary_unary

    async def unary(request, context):
        if isinstance(request, _Undecodable):
            await refuse(context)
        return await behavior(request, context)

    return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=guarded,
                                               response_serializer=handler.response_serializer)


# ---------------------------------------------------------------------------- auth


class BearerAuth(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call but health checks."""

    def __init__(self, token: str, services: Services):
        self._expected = f"Bearer {token}".encode()
        self._services = services

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return handler
        self._services.count_error(FRONT, "UNAUTHENTICATED")
        return _deny(handler)


def _deny(handler):
    message = "missing or wrong bearer token: send metadata `authorization: Bearer <token>`"

    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def streaming(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover

    kwargs = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kwargs)
    return grpc.unary_unary_rpc_method_handler(unary, **kwargs)


# ---------------------------------------------------------------------------- the door


class GrpcDoor:
    """The grpc.aio server on `server.listen`: always open. It listens while the models load (health
    NOT_SERVING, sessions refused UNAVAILABLE), so orchestrators can watch start-up."""

    name = FRONT

    def __init__(self, services: Services, listen: str):
        self.services = services
        self.listen = listen
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None

    async def start(self) -> str:
        c = self.services.config.server
        connections(self.services)  # the daemon's first door: the open-file limit is raised here, and said
        # Auth first: a caller without the token learns nothing, not even that its bytes were bad.
        interceptors = [BearerAuth(c.auth_token, self.services)] if c.auth_token else []
        interceptors.append(DecodeGuard())
        options = [
            ("grpc.max_receive_message_length", c.max_message_bytes),
            ("grpc.max_send_message_length", c.max_message_bytes),
            ("grpc.keepalive_time_ms", c.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", c.keepalive_timeout_ms),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.so_reuseport", 0),
            # A connection that has not finished its TLS and HTTP/2 handshake by then is closed (gRPC's
            # default is 120 s), as an HTTP door's unfinished headers are.
            ("grpc.server_handshake_timeout_ms", int(c.handshake_timeout_s * 1000) or 120000),
        ]
        self.server = grpc.aio.server(interceptors=interceptors, options=options)
        pb_grpc.add_VoicedServicer_to_server(VoicedService(self.services), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            self.server,
        )
        if c.tls_cert or c.tls_key:
            if not (c.tls_cert and c.tls_key):
                raise ValueError("TLS needs both server.tls_cert and server.tls_key")
            with open(c.tls_key, "rb") as k, open(c.tls_cert, "rb") as crt:
                creds = grpc.ssl_server_credentials([(k.read(), crt.read())])
        try:
            self.port = (self.server.add_secure_port(self.listen, creds) if c.tls_cert
                         else self.server.add_insecure_port(self.listen))
        except RuntimeError:  # grpcio's "Failed to bind to address" (older releases returned port 0)
            self.port = 0
        if not self.port:
            raise OSError(f"cannot listen on {self.listen}: the address is in use, or not one of this machine's")
        await self.set_serving(False)
        await self.server.start()
        host = self.listen.rpartition(":")[0]
        return f"{host}:{self.port}"

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop_accepting(self) -> None:
        # New calls keep arriving on open HTTP/2 connections; the core refuses them (UNAVAILABLE,
        # "shutting down") while the daemon drains, which tells a client to go elsewhere.
        await self.set_serving(False)

    async def close(self) -> None:
        if self.server is not None:
            # The grace lets a call that has just ended finish sending its last messages and status: the
            # drain closes the doors within 50 ms of the last session's end, and on a loaded 2-core machine
            # 1 s was not always enough (its final transcript was lost). stop() returns as soon as none is open.
            await self.server.stop(CLOSE_GRACE_S)


