"""Handing the C heap's free memory back to the operating system, and keeping start-up's objects out
of the garbage collector's scans (`freeze_heap`, after the models are loaded and warmed up).

Batched inference on a CPU allocates buffers of tens of MB (the Whisper encoder at batch 10-32) through
malloc. glibc raises its mmap threshold each time it frees a large mapped block, so the next ones come
from its heap, and a freed block inside a heap stays resident until something at the heap's top is
freed too: after a burst of wide batches a daemon's RSS steps up by 100-200 MB and stays there, though
nothing holds that memory any more (docs/BENCHMARKS.md, "Soak"). `malloc_trim(0)` walks every arena
and gives the whole free pages back (madvise), without moving anything that is in use.

The scheduler calls `release()` when its engines have gone quiet after a wide batch (see
voiced.core.scheduler), never between steps. Elsewhere than glibc (musl, macOS) there is no
malloc_trim and `release()` does nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_lock = threading.Lock()  # engine threads on several devices share one heap: one trim at a time


@dataclass(frozen=True)
class Release:
    """What one trim did: resident memory before and after (bytes; 0 where /proc is missing)."""

    rss_before: int
    rss_after: int
    seconds: float

    @property
    def returned(self) -> int:
        return self.rss_before - self.rss_after


def rss_bytes() -> int:
    """This process's resident memory in bytes (Linux's /proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _find_malloc_trim():
    try:
        trim = ctypes.CDLL(None).malloc_trim  # glibc only: musl and macOS have none
    except (AttributeError, OSError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _find_malloc_trim()
if _malloc_trim is None:
    log.debug("no malloc_trim in this C library: freed heap memory stays with the allocator")


def available() -> bool:
    """Whether `release()` can do anything here (glibc)."""
    return _malloc_trim is not None


def release() -> Release | None:
    """Give the C heap's free pages back to the OS; None where the C library cannot (not glibc).

    Costs about 5-40 ms per 100 MB returned (measured on a loaded 2-core box), and holds each arena's
    lock while it walks it: call it when the process is quiet, not on a hot path.
    """
    if _malloc_trim is None:
        return None
    with _lock:
        before, t0 = rss_bytes(), time.perf_counter()
        _malloc_trim(0)
        done = Release(before, rss_bytes(), time.perf_counter() - t0)
    log.debug("heap trim: %.1f MB returned to the OS in %.1f ms (RSS %.1f -> %.1f MB)", done.returned / 2**20,
              done.seconds * 1000, done.rss_before / 2**20, done.rss_after / 2**20)
    return done


def freeze_heap() -> None:
    """Take everything loading and warm-up allocated out of the garbage collector's sight.

    Loading and compiling leave millions of long-lived Python objects (compiled graphs, guards,
    module trees). Python's full collections scan all of them, while holding the GIL, so each one
    stalls the event loop and the engine thread together, mid-conversation. Frozen objects are
    never scanned again; what sessions allocate later is still collected as usual.
    """
    import gc

    before = gc.get_freeze_count()  # (called again once more has loaded: the turn model after the engines)
    gc.collect()
    gc.freeze()
    log.info("froze %d objects allocated at start-up out of the garbage collector's scans (%d in all, process %d)",
             gc.get_freeze_count() - before, gc.get_freeze_count(), os.getpid())
