"""How a benchmark hands its figures over: the JSON on stdout, and the same into `--out` when given."""

from __future__ import annotations

import json
import platform
from pathlib import Path


def emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")


def cpu_model() -> str:
    """The processor's model name (Linux's /proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
