"""Reply audio sent in fixed frames at the rate it plays.

A PBX plays what it receives the moment it receives it (Asterisk's AudioSocket writes each frame
straight to the channel), so a reply must leave as 20 ms frames, one every 20 ms: a burst overruns
the far end's jitter buffer. The TTS engine writes audio faster than real time, in chunks of
hundreds of milliseconds; the pacer buffers it and lets one frame out per slot. Barge-in clears the
buffer, and no frame leaves after the clear (not even the one whose slot was being waited for).
What it holds is bounded (`max_queued_bytes`): past it the producer waits (`writable`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

FRAME_S = 0.02


class Pacer:
    """Sends `frame_bytes` frames at real time through `send`, from audio pushed in any chunk sizes.

    Frame k of a stretch of audio leaves at start + k * frame_s, where a stretch starts when audio
    arrives after the buffer ran dry (a new reply, or the engine falling behind): the pacer never
    sends faster than real time to make up for audio that was late. It catches up only with its own
    lateness (an event loop busy for a moment), at most `max_catch_up_s` of it.
    """

    def __init__(self, send: Callable[[bytes], Awaitable[None]], frame_bytes: int, frame_s: float = FRAME_S,
                 clock: Callable[[], float] = time.monotonic, sleep=asyncio.sleep, max_catch_up_s: float = 0.06,
                 silence: bytes = b"\x00", max_queued_bytes: int | None = None):
        self._send = send
        self.frame_bytes = frame_bytes
        self.frame_s = frame_s
        self._clock = clock
        self._sleep = sleep
        self._max_catch_up = max_catch_up_s
        self._silence = silence  # one sample's worth of silence, to pad a reply's last frame
        self._buf = bytearray()
        self._flush = False  # the reply ended: its last partial frame goes out padded
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._next: float | None = None  # when the next frame is due
        self._generation = 0  # bumped by clear(): a frame waited for before it is not sent
        self._not_sending = asyncio.Event()  # clear while a frame's send is in progress
        self._not_sending.set()
        self._max_queued = max_queued_bytes
        self._room = asyncio.Event()  # clear while max_queued_bytes are queued
        self._room.set()
        self.frames_sent = 0
        self.frames_cleared = 0

    # ------------------------------------------------------------------ producer side

    def push(self, audio: bytes, last: bool = False) -> None:
        """Queue audio; `last` ends a reply (its final partial frame is padded with silence)."""
        if audio:
            self._buf += audio
            if self._max_queued is not None and len(self._buf) >= self._max_queued:
                self._room.clear()
        if last:
            self._flush = True
        if audio or last:
            self._idle.clear()
            self._wake.set()

    def clear(self) -> int:
        """Drop everything queued (barge-in); returns how many frames were dropped."""
        dropped = -(-len(self._buf) // self.frame_bytes)
        self.frames_cleared += dropped
        self._buf.clear()
        self._room.set()
        self._flush = False
        self._generation += 1
        self._idle.set()
        self._wake.set()
        return dropped

    @property
    def queued_ms(self) -> int:
        return int(len(self._buf) / self.frame_bytes * self.frame_s * 1000)

    async def writable(self) -> None:
        """Returns once no frame's send is in progress and fewer than `max_queued_bytes` are queued. A
        caller that stops reading holds a send (the socket's flow control), and audio made faster than
        it plays piles up here: a producer that waits here stops taking audio, so its backlog grows
        where it is bounded (the session's outbox) instead of in this buffer."""
        while not (self._not_sending.is_set() and self._room.is_set()):
            await self._not_sending.wait()
            await self._room.wait()

    async def drained(self) -> None:
        """Returns once everything queued has been sent (or cleared)."""
        await self._idle.wait()

    # ------------------------------------------------------------------ the sending task

    async def run(self) -> None:
        while True:
            waited = False
            while not self._ready():
                if not self._buf:
                    self._flush = False
                    self._idle.set()
                self._wake.clear()
                await self._wake.wait()
                waited = True
            now = self._clock()
            if self._next is None or waited:
                # A new stretch: audio that arrives late is played late, never squeezed in.
                self._next = now if self._next is None else max(self._next, now)
            elif now - self._next > self._max_catch_up:
                self._next = now - self._max_catch_up
            generation = self._generation
            if self._next > now:
                await self._sleep(self._next - now)
            if generation != self._generation or not self._ready():
                continue  # cleared while waiting for the slot: that frame is not sent
            frame = bytes(self._buf[: self.frame_bytes])
            del self._buf[: self.frame_bytes]
            if self._max_queued is None or len(self._buf) < self._max_queued:
                self._room.set()
            if len(frame) < self.frame_bytes:
                pad = self.frame_bytes - len(frame)
                frame += self._silence * (pad // len(self._silence))
                self._flush = False
            self._next += self.frame_s
            self._not_sending.clear()
            try:
                await self._send(frame)
            finally:
                self._not_sending.set()
            self.frames_sent += 1
            if not self._buf and not self._flush:
                self._idle.set()

    def _ready(self) -> bool:
        return len(self._buf) >= self.frame_bytes or (self._flush and len(self._buf) > 0)
