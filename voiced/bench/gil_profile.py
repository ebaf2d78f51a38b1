"""Who holds the GIL: py-spy samples of a running daemon, summarised per thread.

The daemon's event loop and its engine threads share one interpreter lock. Every PyTorch op called
from Python drops it and takes it back, so while one thread runs Python, each op of another thread
can wait for the lock up to the switch interval (the convoy effect): an engine step of a few
milliseconds of GPU work becomes tens of milliseconds of wall time. A torch.profiler capture of the
engine thread shows that time inside the ops, not whose Python it waited for; py-spy's `--gil` mode
samples only the thread holding the lock, which answers that.

Two captures of `seconds` each, one after the other: the lock holder alone (`--gil`), then every
thread idle or not (`--idle`), both as py-spy's raw (collapsed stack) format. `summarise` reads one:
per thread, its share of the samples and the functions it spent them in (inclusive). py-spy is an
optional tool (`pip install py-spy`), needs the right to read the process's memory (root, or
ptrace permission), and is looked up on PATH.
"""

from __future__ import annotations

import collections
import logging
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("voiced.bench.gil")

RATE_HZ = 250


@dataclass
class ThreadShare:
    samples: int
    share: float  # of all samples in the file
    top: list[tuple[str, float]] = field(default_factory=list)  # (function, share of this thread's samples)


def _frame_name(frame: str) -> str:
    """'Segmenter.push (voiced/core/segmenter.py:200)' -> 'Segmenter.push (segmenter.py)'."""
    name, _, where = frame.partition(" (")
    if not where:
        return name
    return f"{name} ({where.rsplit('/', 1)[-1].split(':', 1)[0]})"


def summarise(raw: Path, top: int = 12) -> dict:
    """Per thread (py-spy's `thread (id): name` root frame, the id dropped), the samples it holds and
    its `top` functions by inclusive share."""
    samples: collections.Counter[str] = collections.Counter()
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]
        samples[thread] += int(count)
        for name in {_frame_name(f) for f in frames[1:]}:
            inclusive[thread][name] += int(count)
    total = sum(samples.values()) or 1
    return {
        "samples": total,
        "threads": {
            t: ThreadShare(n, round(n / total, 3),
                           [(f, round(c / n, 3)) for f, c in inclusive[t].most_common(top)]).__dict__
            for t, n in samples.most_common()
        },
    }


class GilProfile:
    """py-spy on `pid` for `seconds` (lock holder), then `seconds` more (every thread), started
    `delay_s` after `start_after`; raw files and a summary land in `out_dir`."""

    def __init__(self, pid: int, seconds: float, out_dir: Path, label: str):
        self.pid, self.out_dir, self.label = pid, out_dir, label
        self.duration_s = max(1, round(seconds))  # py-spy records whole seconds
        self.summary: dict = {}

    def start_after(self, delay_s: float) -> threading.Timer | None:
        if shutil.which("py-spy") is None:
            log.warning("py-spy is not on PATH: no GIL profile of %s (pip install py-spy)", self.label)
            return None
        timer = threading.Timer(delay_s, self._run)
        timer.daemon = True
        timer.start()
        return timer

    def _record(self, mode: str) -> Path:
        out = self.out_dir / f"gil-{self.label}-{mode}.txt"
        cmd = ["py-spy", "record", f"--{mode}", "--nonblocking", "--threads", "--rate", str(RATE_HZ),
               "--duration", str(self.duration_s), "--format", "raw", "--output", str(out),
               "--pid", str(self.pid)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            log.warning("py-spy --%s failed: %s", mode, proc.stderr.strip()[-300:])
        return out

    def _run(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        held = self._record("gil")
        every = self._record("idle")
        if held.exists():
            self.summary = summarise(held)
            # Samples taken while some thread held the lock, of all the samples the capture asked for.
            self.summary["held_fraction"] = round(self.summary["samples"] / (RATE_HZ * self.duration_s), 3)
        if every.exists():
            self.summary["every_thread"] = summarise(every)["threads"]
        log.info("GIL profile of %s written to %s", self.label, self.out_dir)
