"""Freed heap memory goes back to the OS: by itself (voiced.heap), and when the engines go quiet after a
wide batch (the engine thread), so a long-running daemon's RSS does not ratchet up after bursts."""

from __future__ import annotations

import asyncio
import ctypes
import threading

import pytest

from tests.speech import layout
from tests.until import until_async
from voiced import heap
from voiced.core.scheduler import EngineThread, EngineWorker
from voiced.engines.base import ASROptions, ASRRequest
from voiced.metrics import Metrics

pytestmark = pytest.mark.skipif(not heap.available(), reason="malloc_trim is glibc's")

MB = 2**20
BLOCK = 64 * 1024  # far below glibc's mmap threshold: these come from the heap, not their own mappings
BLOCKS = 2048

_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]
_libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]


def plant_free_memory() -> list[int]:
    """Allocate and touch 128 MB in 64 KB blocks, then free every other one: 64 MB free but resident, held
    in place by the blocks between (a freed block at the heap's top would go back by itself). Returns
    the blocks still held."""
    blocks = []
    for _ in range(BLOCKS):
        p = _libc.malloc(BLOCK)
        assert p, "malloc failed"
        _libc.memset(p, 1, BLOCK)
        blocks.append(p)
    for p in blocks[::2]:
        _libc.free(p)
    return blocks[1::2]


def free_all(blocks: list[int]) -> None:
    for p in blocks:
        _libc.free(p)


def test_release_gives_the_freed_heap_back():
    # Whatever earlier tests left free in this process's heap goes back first: otherwise the blocks below
    # could reuse pages that are still resident, and planting them would not show in RSS.
    heap.release()
    before = heap.rss_bytes()
    held = plant_free_memory()
    try:
        planted = heap.rss_bytes()
        assert planted - before > 100 * MB  # the whole 128 MB was touched, and freeing half gave none back
        done = heap.release()
        # rss_before is read inside release(): a page or two may come or go between (other threads)
        assert done is not None and abs(done.rss_before - planted) < MB
        assert done.returned > 48 * MB and heap.rss_bytes() < planted - 48 * MB
    finally:
        free_all(held)


@pytest.fixture(scope="module")
def asr_engine(tmp_path_factory):
    from tests.whisper_fixtures import make_openai_checkpoint
    from voiced.engines.whisper.engine import WhisperEngine

    path = make_openai_checkpoint(tmp_path_factory.mktemp("heap") / "w", seed=5)
    return WhisperEngine.load(str(path), device="cpu", max_batch=4)


def test_the_engine_thread_trims_when_it_goes_quiet_after_a_wide_batch(asr_engine):
    thread = EngineThread("engines", step_log=10_000)
    thread.trim_after_s = 3600.0  # no trim while the test sets up what it would return
    metrics = Metrics()
    thread.on_release = metrics.observe_heap_release  # as the daemon wires it
    asr = EngineWorker(asr_engine, "asr", thread=thread)
    asr.start()
    audio = layout(["Good morning."], lead_s=0.2, tail_s=0.3).audio

    def request():
        return ASRRequest(audio, ASROptions(language="en", max_new_tokens=4, min_new_tokens=4))

    def events():
        return [(name, event) for name, event, _ in thread.step_log]

    def plant_then_wait(trim_after_s: float) -> tuple[list[int], int]:
        """Plants free memory on the engine thread, which then waits for its next command afresh;
        returns the blocks held and where the step log stood when it planted."""
        thread.trim_after_s = trim_after_s
        return thread.call(lambda: (plant_free_memory(), len(thread.step_log)))

    async def one_then_two():
        # One request alone: no batch wider than one, so quiet after it trims nothing.
        await asr.run(request())
        held_one, mark = plant_then_wait(0.01)
        await until_async(lambda: ("engines", "idle") in events()[mark:], "the thread to go idle")
        assert ("engines", "trim") not in events()
        thread.call(free_all, held_one)
        # Two at once: the thread is held on a call while both are submitted, so they step together.
        thread.trim_after_s = 3600.0
        entered, gate = threading.Event(), threading.Event()

        def hold():
            entered.set()
            gate.wait()

        blocked = asyncio.get_running_loop().run_in_executor(None, thread.call, hold)
        await until_async(entered.is_set, "the thread to take the call")
        both = [asyncio.create_task(asr.run(request())) for _ in range(2)]
        await until_async(lambda: asr.pending == 2, "both requests to be submitted")
        gate.set()
        await blocked
        await asyncio.gather(*both)
        assert thread.widest == 2
        held_two, mark = plant_then_wait(0.01)
        await until_async(lambda: ("engines", "idle") in events()[mark:], "the thread to trim and go idle")
        return held_two, mark

    try:
        held, mark = asyncio.run(one_then_two())
        # It trimmed once the engines were quiet, then slept; the planted 64 MB went back to the OS.
        assert events()[mark:][-2:] == [("engines", "trim"), ("engines", "idle")]
        assert thread.widest == 0
        assert thread.last_release is not None and thread.last_release.returned > 48 * MB
        # ... and an operator sees it: one trim, and what it returned.
        assert metrics.registry.get_sample_value("voiced_heap_trim_seconds_count") == 1
        assert metrics.registry.get_sample_value("voiced_heap_returned_bytes_total") == thread.last_release.returned
        thread.call(free_all, held)
    finally:
        thread.stop()
