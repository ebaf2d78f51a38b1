"""The gRPC front door: the voiced.v1 service, health, reflection, auth, admission and drain.

The server starts listening at once with health NOT_SERVING, loads the models on a thread, and
switches to SERVING when they are ready; on SIGTERM it goes NOT_SERVING, refuses new sessions and
waits for the open ones (up to `drain_seconds`) before it stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import io
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc

import voiced
from voiced.core.agents import AgentRegistry
from voiced.audio.ingest import (
    FRAME_SAMPLES,
    MAX_RATE,
    MIN_RATE,
    RATE,
    AudioFormatError,
    Resampler,
    decode_pcm,
    float_to_int16,
)
from voiced.config import Config
from voiced.engines.base import ASRRequest, CapacityError, EngineError
from voiced.metrics import Metrics
from voiced.core.scheduler import EngineWorker
from voiced.core.segmenter import Segmenter, SegmenterConfig, Utterance
from voiced.session import Session, ms
from voiced.wire import SessionError, asr_options, audio_format, invalid, session_spec, transcript_to_proto

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Voiced"].full_name
MAX_CLIP_S = 600  # Recognize is for clips; longer audio belongs on StreamingRecognize


@dataclass
class Services:
    """What sessions share: the config, the engine workers, the agents, the metrics."""

    config: Config
    metrics: Metrics
    asr: EngineWorker | None = None
    tts: EngineWorker | None = None
    voices: object | None = None  # the TTS engine's voice store (list/add/delete)
    agents: AgentRegistry = field(default_factory=AgentRegistry)
    ready: bool = False
    draining: bool = False
    active_sessions: int = 0
    peak_sessions: int = 0  # most sessions open at once since start
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))


class VoicedService(pb_grpc.VoicedServicer):
    def __init__(self, services: Services):
        self.s = services

    # ------------------------------------------------------------------ guards

    async def _abort(self, context, error: SessionError):
        self.s.metrics.errors.labels(error.code.name).inc()
        # gRPC keeps the abort exception after the call; it chains `error`, whose traceback holds the
        # frames (and so the session, its audio and codecs) it was raised through. Drop them.
        error.__traceback__ = None
        await context.abort(error.code, error.message)

    def _check_ready(self, need_tts: bool = False) -> None:
        if self.s.draining:
            raise SessionError(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; connect again to another instance")
        if not self.s.ready:
            raise SessionError(
                grpc.StatusCode.UNAVAILABLE,
                "the server is still loading its models; retry when the health check reports SERVING",
            )
        if need_tts and self.s.tts is None:
            raise SessionError(
                grpc.StatusCode.FAILED_PRECONDITION,
                "speech synthesis is switched off on this server (started with --no-tts)",
            )

    # ------------------------------------------------------------------ streaming sessions

    async def Converse(self, request_iterator, context):
        async for event in self._session(request_iterator, context, conversational=True):
            yield event

    async def StreamingRecognize(self, request_iterator, context):
        async for event in self._session(request_iterator, context, conversational=False):
            yield event

    async def _session(self, requests, context, conversational: bool):
        s = self.s
        session = None
        outcome = "error"
        admitted = False
        try:
            # Read the first message before any refusal: aborting a stream whose first write is
            # still in flight makes some gRPC clients report INTERNAL instead of our status.
            first = await _first(requests)
            self._check_ready()
            if s.active_sessions >= s.config.server.max_sessions:
                raise SessionError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the server is at its limit of {s.config.server.max_sessions} concurrent sessions; "
                    "retry later or raise server.max_sessions",
                )
            s.active_sessions += 1
            s.peak_sessions = max(s.peak_sessions, s.active_sessions)
            admitted = True
            s.metrics.sessions_active.inc()
            if first is None:
                outcome = "empty"
                return
            if first.WhichOneof("request") != "config":
                raise invalid("the first message must be `config` (a SessionConfig); audio and control come after it")
            session_id = first.config.session_id or f"s{next(s._ids)}-{uuid.uuid4().hex[:8]}"
            spec = session_spec(first.config, s.config, session_id, s.agents.names())
            if conversational and spec.recognize is False:
                raise invalid("recognition.disabled is only for StreamingRecognize; Converse needs transcripts")
            session = Session(s, spec, conversational)
            log.info("session %s started (%s, %s %d Hz)", session_id, "Converse" if conversational else
                     "StreamingRecognize", spec.input.encoding, spec.input.sample_rate)
            async for event in session.run(requests):
                yield event
            outcome = "ok"
        except SessionError as e:
            outcome = e.code.name.lower()
            await self._abort(context, e)
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if session is not None:
                await session.close()
                session = None  # this frame outlives the call in gRPC's abort traceback
            if admitted:
                s.active_sessions -= 1
                s.metrics.sessions_active.dec()
            s.metrics.sessions_total.labels(outcome).inc()

    # ------------------------------------------------------------------ one-shot recognition

    async def Recognize(self, request, context):
        try:
            self._check_ready()
            audio, duration = _clip_audio(request.audio, request.format if request.HasField("format") else None)
            opts = asr_options(request.recognition, self.s.config)
            if request.recognition.disabled:
                raise invalid("recognition.disabled makes no sense for Recognize")
            utterances = _split_clip(audio)
            results = await asyncio.gather(
                *(self.s.asr.run(ASRRequest(u.audio.astype("float32") / 32768.0, opts)) for u in utterances)
            )
        except SessionError as e:
            await self._abort(context, e)
        except CapacityError as e:  # the queue is full: the caller may retry; the daemon goes on
            await self._abort(context, SessionError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)))
        except EngineError as e:
            await self._abort(context, SessionError(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
        keep = request.recognition.keep_hallucinations
        return pb.RecognizeResponse(
            duration_s=duration,
            results=[
                transcript_to_proto(r, is_final=True, start_ms=ms(u.start), end_ms=ms(u.end))
                for u, r in zip(utterances, results)
                if keep or not r.is_hallucination
            ],
        )

    # ------------------------------------------------------------------ speaking side

    async def Synthesize(self, request, context):
        from voiced.conversation import synthesize_events

        try:
            self._check_ready(need_tts=True)
            async for chunk in synthesize_events(self.s, request):
                yield pb.SynthesizeResponse(audio=chunk)
        except SessionError as e:
            await self._abort(context, e)

    async def ListVoices(self, request, context):
        try:
            self._check_ready(need_tts=True)
        except SessionError as e:
            await self._abort(context, e)
        from voiced.conversation import list_voices

        return list_voices(self.s)

    async def AddVoice(self, request, context):
        from voiced.conversation import add_voice

        try:
            self._check_ready(need_tts=True)
            return await add_voice(self.s, request)
        except SessionError as e:
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
        )
        for name, worker in (("asr", s.asr), ("tts", s.tts)):
            if worker is not None:
                e = worker.engine
                getattr(info, name).CopyFrom(pb.ModelInfo(name=e.model_name, backend=e.backend, device=e.device))
        return info


async def _first(requests):
    async for request in requests:
        return request
    return None


def _clip_audio(data: bytes, fmt: pb.AudioFormat | None):
    """Recognize's audio (WAV bytes, or raw in `fmt`) -> (16 kHz int16, duration in seconds)."""
    if not data:
        raise invalid("audio is empty; send the clip's bytes (base64 in JSON)")
    if data[:4] == b"RIFF":
        from voiced.audio.wavfile import WavError, read_wav

        try:
            samples, rate = read_wav(io.BytesIO(data))
        except WavError as e:
            raise invalid(f"audio starts like a WAV file but cannot be read: {e}") from None
        duration = len(samples) / rate
        pcm = float_to_int16(Resampler(rate, RATE)(samples, last=True))
    else:
        if fmt is None:
            raise invalid("format is required for raw audio (or send a WAV file)")
        f = audio_format(fmt, "format")
        try:
            raw = decode_pcm(data, f.encoding)
        except AudioFormatError as e:
            raise invalid(str(e)) from None
        duration = len(raw) / f.sample_rate
        pcm = Resampler(f.sample_rate, RATE)(raw, last=True)
    if duration > MAX_CLIP_S:
        raise invalid(f"the clip is {duration:.0f} s long; Recognize takes up to {MAX_CLIP_S} s, "
                      "use StreamingRecognize for longer audio")
    return pcm, duration


def _split_clip(pcm) -> list[Utterance]:
    """A clip of up to 30 s is one utterance; a longer one is cut at pauses by the segmenter."""
    if len(pcm) <= 30 * RATE:
        return [Utterance(audio=pcm, start=0, end=len(pcm))]
    seg = Segmenter(SegmenterConfig(hangover_ms=300, max_utterance_ms=29000))
    out: list[Utterance] = []
    padded = np.pad(pcm, (0, -len(pcm) % FRAME_SAMPLES))
    for frame in padded.reshape(-1, FRAME_SAMPLES):
        out += [e for e in seg.push(frame) if isinstance(e, Utterance)]
    out += [e for e in seg.flush() if isinstance(e, Utterance)]
    return out


# ---------------------------------------------------------------------------- auth


class BearerAuth(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call but health checks."""

    def __init__(self, token: str, metrics: Metrics):
        self._expected = f"Bearer {token}".encode()
        self._metrics = metrics

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return handler
        self._metrics.errors.labels("UNAUTHENTICATED").inc()
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


# ---------------------------------------------------------------------------- the server


class VoicedServer:
    """Owns the grpc.aio server, the health state and the engine workers."""

    def __init__(self, config: Config, load: Callable[[Services], None] | None = None,
                 services: Services | None = None):
        self.config = config
        self.services = services or Services(config=config, metrics=Metrics(), agents=AgentRegistry(config.agent))
        self._load = load  # fills services.asr/tts/voices; runs on a thread so health can answer meanwhile
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port: int | None = None
        self._metrics_http = None
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        c = self.config.server
        interceptors = [BearerAuth(c.auth_token, self.services.metrics)] if c.auth_token else []
        options = [
            ("grpc.max_receive_message_length", c.max_message_bytes),
            ("grpc.max_send_message_length", c.max_message_bytes),
            ("grpc.keepalive_time_ms", c.keepalive_time_ms),
            ("grpc.keepalive_timeout_ms", c.keepalive_timeout_ms),
            ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.so_reuseport", 0),
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
            self.port = self.server.add_secure_port(c.listen, creds)
        else:
            self.port = self.server.add_insecure_port(c.listen)
        if not self.port:
            raise OSError(f"cannot listen on {c.listen} (address in use or not local?)")
        await self._set_health(False)
        await self.server.start()
        if c.metrics_listen:
            self._metrics_http = self.services.metrics.serve(c.metrics_listen)
        log.info("listening on %s (health NOT_SERVING until the models are loaded)", c.listen)
        if self._load is not None:
            await asyncio.to_thread(self._load, self.services)
        self._start_workers()
        self.services.ready = True
        await self._set_health(True)
        log.info("ready: health SERVING")
        return self.port

    def _start_workers(self) -> None:
        m = self.services.metrics
        for name in ("asr", "tts"):
            worker = getattr(self.services, name)
            if worker is not None:
                worker._on_step = lambda engine, n=name: m.observe_engine(n, engine)
                worker.start()  # a no-op for a thread already running (engines sharing one)

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def drain_and_stop(self, grace: float | None = None) -> None:
        """NOT_SERVING, refuse new sessions, wait for open ones, then stop."""
        s = self.services
        if s.draining:
            return
        s.draining = True
        await self._set_health(False)
        deadline = time.monotonic() + (self.config.server.drain_seconds if grace is None else grace)
        while s.active_sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if s.active_sessions:
            log.warning("drain: %d sessions still open after the grace period; closing them", s.active_sessions)
        if self.server is not None:
            await self.server.stop(1.0)
        for worker in (s.asr, s.tts):
            if worker is not None:
                await asyncio.to_thread(worker.stop)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


@contextlib.asynccontextmanager
async def running(config: Config, load=None, services: Services | None = None):
    """A started server for tests and embedding; drained and stopped on exit."""
    server = VoicedServer(config, load=load, services=services)
    await server.start()
    try:
        yield server
    finally:
        await server.drain_and_stop(grace=0)


def start_in_thread(server: VoicedServer, timeout: float = 600) -> tuple[int, asyncio.AbstractEventLoop, threading.Thread]:
    """Run `server` on its own event loop in a daemon thread (tests, benchmarks, embedding in an app).

    Returns once it is serving: (port, loop, thread). Stop it with
    `asyncio.run_coroutine_threadsafe(server.drain_and_stop(), loop)`, then `loop.call_soon_threadsafe(loop.stop)`.
    """
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    started: dict = {}

    def main():
        asyncio.set_event_loop(loop)

        async def start():
            try:
                started["port"] = await server.start()
            except BaseException as e:  # report to the caller instead of dying silently
                started["error"] = e
            ready.set()

        loop.run_until_complete(start())
        if "error" not in started:
            loop.run_forever()

    thread = threading.Thread(target=main, daemon=True, name="voiced-server")
    thread.start()
    if not ready.wait(timeout):
        raise TimeoutError(f"the server did not start within {timeout:.0f} s")
    if "error" in started:
        raise started["error"]
    return started["port"], loop, thread
