"""A real voiced server on localhost for tests, with a tiny random Whisper checkpoint.

The server runs on its own thread and event loop, as it would in production; tests talk to it
over a real gRPC channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from voiced_client.proto import voiced_pb2 as pb
from voiced_client.proto import voiced_pb2_grpc as pb_grpc

from voiced.audio.ingest import FRAME_SAMPLES, Format, FrameDecoder, encode_pcm, float_to_int16
from voiced.config import Config
from voiced.core.agents import AgentRegistry
from voiced.core.scheduler import EngineThread, EngineWorker
from voiced.core.services import Services
from voiced.daemon import Daemon as VoicedDaemon
from voiced.daemon import start_in_thread
from voiced.metrics import Metrics

MAX_NEW_TOKENS = 10  # random models never stop on their own


def daemon_config() -> Config:
    c = Config()
    c.server.listen = "127.0.0.1:0"
    c.server.max_message_bytes = 1024 * 1024
    c.asr.language = "en"
    c.asr.max_new_tokens = MAX_NEW_TOKENS
    # Random weights look like hallucinations to the filters; the tests want every result.
    c.asr.no_speech_threshold = 1.0
    c.asr.logprob_threshold = -1e9
    c.asr.compression_ratio_threshold = 1e9
    c.tts.enabled = False
    return c


@dataclass
class Daemon:
    address: str
    server: VoicedDaemon
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    checkpoint: Path

    @property
    def services(self) -> Services:
        return self.server.services

    def call(self, coro_fn, *args, timeout: float = 60):
        """Run `coro_fn(*args)` on the server's loop (to look inside it) and return its result."""
        return asyncio.run_coroutine_threadsafe(coro_fn(*args), self.loop).result(timeout)

    def session_tasks(self) -> list[str]:
        async def names():
            return [t.get_name() for t in asyncio.all_tasks() if ":" in t.get_name()]

        return self.call(names)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.drain_and_stop(grace=0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_daemon(checkpoint: Path, config: Config | None = None, tts_engine=None, max_batch: int = 16,
                 agents: dict | None = None) -> Daemon:
    """`agents`: name -> factory(config, system_prompt), registered before the doors open (plug-ins)."""
    from voiced.engines.whisper.engine import WhisperEngine

    config = config or daemon_config()
    engine = WhisperEngine.load(str(checkpoint), device="cpu", max_batch=max_batch, window=config.asr.window)
    # The engine thread keeps a step log, so tests judge scheduling from the order it did the work in.
    thread = EngineThread("engines", step_log=100_000)
    services = Services(config=config, metrics=Metrics(), asr=EngineWorker(engine, "asr", thread=thread),
                        agents=AgentRegistry(config.agent))
    for name, factory in (agents or {}).items():
        services.agents.register(name, factory)
    if tts_engine is not None:
        services.tts = EngineWorker(tts_engine, "tts", thread=services.asr.thread)  # as `voiced serve` does
        services.voices = tts_engine.voices
    server = VoicedDaemon(config, services=services)
    port, loop, thread = start_in_thread(server, timeout=60)
    return Daemon(f"127.0.0.1:{port}", server, loop, thread, checkpoint)


# ------------------------------------------------------------------------------ the caller side


def wire_audio(audio16k: np.ndarray, fmt: Format) -> bytes:
    """16 kHz float audio -> bytes in `fmt`, as a caller would send them."""
    import soxr

    x = audio16k if fmt.sample_rate == 16000 else soxr.resample(audio16k, 16000, fmt.sample_rate)
    return encode_pcm(float_to_int16(x), fmt.encoding)


def heard_audio(data: bytes, fmt: Format) -> np.ndarray:
    """What the daemon hears from `data`: decoded and resampled to 16 kHz int16 (its own pipeline)."""
    dec = FrameDecoder(fmt)
    frames = dec.feed(data) + dec.flush()
    return np.concatenate(frames)


def frames_of(data: bytes, fmt: Format, ms: int = 20) -> list[bytes]:
    step = fmt.bytes_per_sample * fmt.sample_rate * ms // 1000
    return [data[i : i + step] for i in range(0, len(data), step)]


def session_config(fmt: Format, **kw) -> pb.SessionConfig:
    enc = {"LINEAR16": pb.LINEAR16, "MULAW": pb.MULAW, "ALAW": pb.ALAW}[fmt.encoding]
    return pb.SessionConfig(input_format=pb.AudioFormat(encoding=enc, sample_rate_hz=fmt.sample_rate), **kw)


def stream_blocking(address: str, requests: list[pb.SessionRequest], method: str = "StreamingRecognize",
                    metadata=None, timeout: float | None = None) -> tuple[list[pb.SessionEvent], grpc.StatusCode, str]:
    """Send all requests, half-close, collect every event and the final status (`timeout`: a deadline
    for the call, for a test whose failure would otherwise be a call that never ends).

    The blocking API on purpose: grpc.aio clients can report INTERNAL instead of the server's
    status when the server ends a call while they are still writing (grpc/grpc#36066).
    """
    with grpc.insecure_channel(address) as channel:
        call = getattr(pb_grpc.VoicedStub(channel), method)(iter(requests), metadata=metadata, timeout=timeout)
        events = []
        try:
            for ev in call:
                events.append(ev)
            return events, grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return events, e.code(), e.details()


async def run_stream(address: str, requests: list[pb.SessionRequest], method: str = "StreamingRecognize",
                     metadata=None) -> tuple[list[pb.SessionEvent], grpc.StatusCode, str]:
    return await asyncio.to_thread(stream_blocking, address, requests, method, metadata)


def audio_requests(config: pb.SessionConfig, data: bytes, fmt: Format) -> list[pb.SessionRequest]:
    return [pb.SessionRequest(config=config)] + [pb.SessionRequest(audio=f) for f in frames_of(data, fmt)]


def of_kind(events, kind: str):
    return [e for e in events if e.WhichOneof("event") == kind]


__all__ = ["FRAME_SAMPLES"]


# A fault's own words: what a caller must never read (they name our code, not the request).
FAULT_TEXT = "injected fault 7f3a9c in the engine's step"


@contextlib.contextmanager
def engine_fault(engine):
    """A fault inside a running daemon's engine (a bug, a device fault): while the block lasts its step
    raises, and the scheduler fails each request in flight with EngineFault (voiced.core.scheduler).
    The engine steps normally again afterwards."""

    def step():
        raise RuntimeError(FAULT_TEXT)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(engine, "step", step)
        yield


@contextlib.contextmanager
def socket_timeout(module, read: str, on_call: int):
    """A dead peer's socket under a door: while the block lasts, the `on_call`-th call of `module.read` (the
    door's read of its connection) raises the kernel's keepalive timeout (ETIMEDOUT), as reading such a socket
    does; the other calls read as usual. Yields the count of calls ({"n": ...})."""
    real, calls = getattr(module, read), {"n": 0}

    async def reading(reader):
        calls["n"] += 1
        if calls["n"] == on_call:
            raise TimeoutError(errno.ETIMEDOUT, "Connection timed out")
        return await real(reader)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(module, read, reading)
        yield calls


@contextlib.contextmanager
def collector_off():
    """With the cyclic collector off for the block, yields `new_call_objects()`: the sessions, conversations,
    segmenters and frame decoders made in the block and still tracked. Without a collection, an object in a
    reference cycle stays tracked after its call has ended, so a call that leaves none has none left once it
    has wound down (the daemon's threads run meanwhile)."""
    from voiced.core.conversation import Conversation
    from voiced.core.segmenter import Segmenter
    from voiced.core.session import Session

    kinds = (Session, Conversation, Segmenter, FrameDecoder)

    def tracked():
        return [o for o in gc.get_objects() if type(o) in kinds]

    gc.collect()
    earlier = weakref.WeakSet(tracked())
    gc.disable()
    try:
        yield lambda: [o for o in tracked() if o not in earlier]
    finally:
        gc.enable()
