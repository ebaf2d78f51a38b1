"""One phone call driven through a session, as the telephony doors (AudioSocket, media WebSocket) run it.

A phone call is two loops: the caller's side (protocol messages turned into the session's input
events) and the session's side (output events turned into protocol messages). Either can end the
call: the caller hangs up (socket closed, hangup message, `stop` event) or breaks the protocol, or
the session ends it (the agent hung up, an error). Whichever ends first, the other is cancelled and
the session is closed, so a hangup frees the call's engine work at once: on a phone, a caller who
hung up hears nothing more, unlike a gRPC caller who only finished sending.

The session's side writes through `Session.writing`: a caller that stops reading blocks the door's
write, the session's outbound budget fills, and the session ends with OVER_CAPACITY instead of the
door waiting in its write forever. (The door's last words to such a caller are bounded by
voiced.doors.shared.last_words.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from voiced.core.events import InputEvent, NoticeOut, OutputEvent, Speak, TranscriptOut
from voiced.core.session import Session

log = logging.getLogger(__name__)

INPUT_QUEUE = 250  # 5 s of 20 ms frames: a session that falls further behind slows the socket, not memory


class CallInputs:
    """The caller's side of a session's input stream; end() is the caller hanging up."""

    def __init__(self, maxsize: int = INPUT_QUEUE):
        self._queue: asyncio.Queue[InputEvent | None] = asyncio.Queue(maxsize)

    async def put(self, event: InputEvent) -> None:
        await self._queue.put(event)

    def put_nowait(self, event: InputEvent) -> None:
        self._queue.put_nowait(event)

    async def end(self) -> None:
        await self._queue.put(None)

    async def __aiter__(self) -> AsyncIterator[InputEvent]:
        while (event := await self._queue.get()) is not None:
            yield event


class LiveCalls:
    """A telephony door's calls in progress: each call's task, and its session's id once it has one."""

    def __init__(self) -> None:
        self._ids: dict[asyncio.Task, str] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, task: asyncio.Task) -> None:
        self._ids[task] = ""

    def discard(self, task: asyncio.Task) -> None:
        self._ids.pop(task, None)

    async def cancel_all(self) -> None:
        """The daemon is closing: end every call (each says goodbye in its protocol as it is cancelled)."""
        tasks = list(self._ids)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def open_session(self, task: asyncio.Task, call_id: str, services, front: str, settings,
                     fmt) -> tuple[Session, CallInputs]:
        """The call's Converse session, named for the call's own id (unique among the live calls), with the
        door's agent and voice (`settings`: [audiosocket] or [media_ws]), in and out in the call's format;
        and its inputs, the door's greeting (if any) first."""
        session_id = self._ids[task] = unique_id(call_id, set(self._ids.values()))
        spec = services.spec(front=front, session_id=session_id, input=fmt, output=fmt,
                             agent=settings.agent or None, voice=settings.voice or None)
        inputs = CallInputs()
        if settings.greeting:
            inputs.put_nowait(Speak(settings.greeting))
        return Session(services, spec, conversational=True), inputs


def log_event(logger: logging.Logger, who: str, ev: OutputEvent) -> None:
    """What a telephony door does with the events it has no message for: what the caller was heard
    saying (debug), and notices (a warning: a reply or an utterance was lost)."""
    if isinstance(ev, TranscriptOut) and ev.is_final:
        logger.debug("%s: heard %r", who, ev.transcript.text)
    elif isinstance(ev, NoticeOut):
        logger.warning("%s: %s: %s", who, ev.code, ev.message)


async def run_call(session, inputs: CallInputs, read_caller: Awaitable[None],
                   on_event: Callable[[OutputEvent], Awaitable[bool]]) -> str:
    """Run one call until either side ends it; returns "caller" or "session" (who ended it).

    `read_caller` reads the protocol until the caller hangs up (it returns) or breaks the protocol
    (it raises). `on_event` handles each session event and returns True to end the call (after a
    hangup it has sent). Errors from either side propagate after both loops and the session are
    closed.
    """

    async def pump() -> None:
        async with contextlib.aclosing(session.run(inputs)) as events:
            async for event in events:
                if await session.writing(on_event(event)):
                    return

    caller = asyncio.ensure_future(read_caller)
    speaker = asyncio.ensure_future(pump())
    try:
        done, _ = await asyncio.wait({caller, speaker}, return_when=asyncio.FIRST_COMPLETED)
        first = caller if caller in done else speaker
        (speaker if first is caller else caller).cancel()
        await asyncio.gather(caller, speaker, return_exceptions=True)
        first.result()  # the error that ended the call, if any
        return "caller" if first is caller else "session"
    finally:
        caller.cancel()
        speaker.cancel()
        await asyncio.gather(caller, speaker, return_exceptions=True)
        await session.close()


def unique_id(preferred: str, taken: set[str]) -> str:
    """The call's own id (Asterisk's UUID, Twilio's CallSid) as the session id, so the core's log lines
    carry it; a suffix only when the same id is already live (a dialplan may reuse one UUID)."""
    candidate, n = preferred, 1
    while candidate in taken:
        n += 1
        candidate = f"{preferred}-{n}"
    return candidate
