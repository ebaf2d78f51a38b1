"""What every session shares, whichever door it came through: the config, the engine workers,
the agents, the metrics, and the one admission limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from voiced.config import Config
from voiced.core.agents import AgentRegistry
from voiced.core.errors import ErrorKind, SessionError
from voiced.core.scheduler import EngineWorker
from voiced.core.spec import SessionSpec, spec_for
from voiced.metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class Admission:
    """One admitted session; a door may set `outcome` (metrics) before the block ends normally."""

    front: str
    outcome: str = "ok"


@dataclass(frozen=True)
class Engines:
    """What the daemon serves with, handed to `Services.attach` once loaded (voiced.assembly)."""

    asr: EngineWorker | None = None
    tts: EngineWorker | None = None
    voices: object | None = None  # the TTS engine's voice store (list/add/delete)
    turn_model: object | None = None  # the end-of-turn model (voiced.engines.smart_turn.SmartTurn); None: silence
    process: object | None = None  # the engines' own process (voiced.engine_process), if they run in one
    gpu_memory: Callable[[], list] | None = None  # the metrics' GPU memory readings, where not this process's
    # Runs a function the engines' builder registered (voiced.engine_process.Built.calls) where they run.
    call: Callable[..., object] | None = None


@dataclass
class Services:
    """Built once, before the doors open; its engines arrive once, by `attach`, when they are loaded."""

    config: Config
    metrics: Metrics = field(default_factory=Metrics)
    asr: EngineWorker | None = None
    tts: EngineWorker | None = None
    voices: object | None = None  # the TTS engine's voice store (list/add/delete)
    turn_model: object | None = None  # the end-of-turn model (voiced.engines.smart_turn.SmartTurn); None: silence
    engine_process: object | None = None  # the engines' own process (voiced.engine_process), if they run in one
    failure: str | None = None  # why the server can serve no more (its engine process ended), said to callers
    # Why a speech request is refused when there is no TTS engine: the user's --no-tts, or no voice on this machine.
    tts_off: str = "speech synthesis is switched off on this server (started with --no-tts or tts.enabled = false)"
    agents: AgentRegistry = field(default_factory=AgentRegistry)
    ready: bool = False
    draining: bool = False
    active: Counter = field(default_factory=Counter)  # front -> sessions open now
    peak_sessions: int = 0  # most sessions open at once since start
    doors: dict[str, str] = field(default_factory=dict)  # open doors: name -> bound address
    _ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def attach(self, engines: Engines) -> None:
        """The loaded engines, in one step (the daemon's, before health says SERVING)."""
        self.asr, self.tts, self.voices = engines.asr, engines.tts, engines.voices
        self.turn_model, self.engine_process = engines.turn_model, engines.process
        if engines.gpu_memory is not None:
            self.metrics.gpu_memory = engines.gpu_memory

    @property
    def active_sessions(self) -> int:
        return sum(self.active.values())

    def new_session_id(self, front: str) -> str:
        # The front is in every log line and metric already; ids keep one shape for every door.
        return f"s{next(self._ids)}-{uuid.uuid4().hex[:8]}"

    def check_ready(self, need_tts: bool = False) -> None:
        """Raises UNAVAILABLE while loading or draining, NOT_ENABLED for speech with TTS off."""
        if self.failure is not None:
            raise SessionError(ErrorKind.UNAVAILABLE, self.failure)
        if self.draining:
            raise SessionError(ErrorKind.UNAVAILABLE, "the server is shutting down; connect again to another instance")
        if not self.ready:
            raise SessionError(
                ErrorKind.UNAVAILABLE,
                "the server is still loading its models; retry when the health check reports SERVING",
            )
        if need_tts and self.tts is None:
            raise SessionError(ErrorKind.NOT_ENABLED, self.tts_off)

    @contextlib.asynccontextmanager
    async def admit(self, front: str) -> AsyncIterator[Admission]:
        """Holds one of `server.max_sessions` places (one limit for every door) for the block.

        Refuses with UNAVAILABLE (loading, draining) or OVER_CAPACITY; counts the session and how it
        ended (`voiced_sessions_total{front, outcome}`) either way.
        """
        m = self.metrics
        try:
            self.check_ready()
            limit = self.config.server.max_sessions
            if self.active_sessions >= limit:
                raise SessionError(
                    ErrorKind.OVER_CAPACITY,
                    f"the server is at its limit of {limit} concurrent sessions; "
                    "retry later or raise server.max_sessions",
                )
        except SessionError as e:
            m.sessions_total.labels(front, e.kind.value).inc()
            raise
        admission = Admission(front)
        self.active[front] += 1
        self.peak_sessions = max(self.peak_sessions, self.active_sessions)
        m.sessions_active.labels(front).inc()
        outcome = "internal"
        try:
            yield admission
            outcome = admission.outcome
        except SessionError as e:
            outcome = e.kind.value
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            self.active[front] -= 1
            m.sessions_active.labels(front).dec()
            m.sessions_total.labels(front, outcome).inc()

    def count_error(self, front: str, code: str) -> None:
        """An error reported to a caller (`voiced_errors_total{front, code}`)."""
        self.metrics.errors.labels(front, code).inc()

    def spec(self, *, front: str, session_id: str | None = None, **overrides) -> SessionSpec:
        """`spec_for` with this server's config and agents (see voiced.core.spec)."""
        return spec_for(self.config, session_id=session_id or self.new_session_id(front), front=front,
                        agents=self.agents.names(), **overrides)
