"""How a benchmark hands its figures over: the JSON on stdout, and the same into `--out` when given."""

from __future__ import annotations

import json
from pathlib import Path


def emit(result: dict, out: Path | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
