"""The real-time pacer on a virtual clock: when each frame leaves is exact, not measured."""

from __future__ import annotations

import asyncio

import pytest

from voiced.doors.pacing import Pacer

FRAME = 320  # 20 ms of slin at 8 kHz


class VirtualTime:
    def __init__(self):
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


@pytest.fixture()
async def paced():
    vt = VirtualTime()
    sent: list[tuple[float, bytes]] = []

    async def send(frame: bytes) -> None:
        sent.append((round(vt.now, 6), frame))

    pacer = Pacer(send, FRAME, clock=vt.clock, sleep=vt.sleep)
    task = asyncio.create_task(pacer.run())
    yield vt, pacer, sent
    task.cancel()


async def settle():
    for _ in range(200):
        await asyncio.sleep(0)


async def test_one_frame_per_20_ms_whatever_the_chunking_and_the_last_frame_padded(paced):
    vt, pacer, sent = paced
    audio = bytes(range(256)) * 62 + b"\x01\x02"  # 15874 bytes: 49 whole frames and a partial one
    pacer.push(audio[:1000])
    pacer.push(audio[1000:9000])
    pacer.push(audio[9000:], last=True)
    await pacer.drained()
    assert [t for t, _ in sent] == [round(k * 0.02, 6) for k in range(50)]
    assert all(len(f) == FRAME for _, f in sent)
    assert b"".join(f for _, f in sent) == audio + b"\x00" * (50 * FRAME - len(audio))


async def test_audio_that_arrives_late_is_played_late_not_squeezed_in(paced):
    vt, pacer, sent = paced
    pacer.push(b"\x01" * FRAME * 3)
    await settle()
    assert [t for t, _ in sent] == [0.0, 0.02, 0.04]
    vt.now = 0.5  # the engine fell behind: nothing to send for 440 ms
    pacer.push(b"\x02" * FRAME * 3, last=True)
    await pacer.drained()
    assert [t for t, _ in sent][3:] == [0.5, 0.52, 0.54]


async def test_a_busy_loop_catches_up_only_a_little(paced):
    vt, pacer, sent = paced

    async def busy_sleep(seconds):  # the loop came back 300 ms late from one sleep
        vt.now += seconds + (0.3 if len(sent) == 2 else 0.0)
        await asyncio.sleep(0)

    pacer._sleep = busy_sleep
    pacer.push(b"\x01" * FRAME * 10, last=True)
    await pacer.drained()
    times = [t for t, _ in sent]
    gaps = [round(b - a, 6) for a, b in zip(times, times[1:])]
    # Frame 2 left 300 ms late; of that, only max_catch_up (60 ms) is made up: frames 3-6 leave with
    # it (the 3 frames made up and the one due now), then it is one every 20 ms again.
    assert gaps[:2] == [0.02, 0.32]
    assert gaps[2:] == [0.0] * 4 + [0.02] * 3


async def test_clear_stops_at_once_even_the_frame_waiting_for_its_slot(paced):
    vt, pacer, sent = paced
    waiting, release = asyncio.Event(), asyncio.Event()

    async def gated_sleep(seconds):
        if len(sent) == 5:  # hold the pacer in its wait for frame 5's slot
            waiting.set()
            await release.wait()
        vt.now += seconds

    pacer._sleep = gated_sleep
    pacer.push(b"\x01" * FRAME * 50, last=True)
    await waiting.wait()
    # The pacer is sleeping until frame 5's slot; a barge-in clears the queue meanwhile.
    dropped = pacer.clear()
    release.set()
    assert dropped == 45
    await pacer.drained()
    await settle()
    assert len(sent) == 5 and pacer.frames_sent == 5
    # A new reply after the clear starts its own stretch.
    pacer.push(b"\x02" * FRAME * 2, last=True)
    await pacer.drained()
    assert [f[:1] for _, f in sent[5:]] == [b"\x02", b"\x02"]
