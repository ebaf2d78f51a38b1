"""An engine's manifest: everything a built TensorRT-LLM engine depends on, in `manifest.json` next to it.

The build (voiced.engines.trtllm.build) writes it last, so an interrupted build never looks
finished, and skips a build whose manifest matches; the runners and the backend choice read it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# Bumped when the command lines change for the same options, so engines built before rebuild:
# 2 = the Whisper encoder's --max_num_tokens and --kv_cache_type paged (issue 16).
MANIFEST_SCHEMA = 2


@dataclass
class Manifest:
    kind: str
    model: str
    checkpoint_sha256: str
    trtllm_version: str
    options: dict
    commands: list[str] = field(default_factory=list)
    schema: int = MANIFEST_SCHEMA
    built_at: str = ""
    build_seconds: float = 0.0

    def identity(self) -> dict:
        """What must match for an existing engine to be reused (paths and timings do not count)."""
        return {"schema": self.schema, "kind": self.kind, "model": self.model,
                "checkpoint_sha256": self.checkpoint_sha256, "trtllm_version": self.trtllm_version,
                "options": self.options}

    def matches(self, other: Manifest) -> bool:
        return self.identity() == other.identity()

    def differences(self, other: Manifest) -> list[str]:
        a, b = self.identity(), other.identity()
        out = []
        for key in a:
            if key == "options":
                for k in sorted(set(a[key]) | set(b[key])):
                    if a[key].get(k) != b[key].get(k):
                        out.append(f"{k}: {b[key].get(k)!r} -> {a[key].get(k)!r}")
            elif a[key] != b[key]:
                out.append(f"{key}: {b[key]!r} -> {a[key]!r}")
        return out

    def write(self, engine_dir: Path) -> Path:
        path = Path(engine_dir) / MANIFEST
        tmp = path.with_suffix(".json.part")
        tmp.write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, engine_dir: Path) -> Manifest | None:
        path = Path(engine_dir) / MANIFEST
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            return cls(**{k: data[k] for k in ("kind", "model", "checkpoint_sha256", "trtllm_version", "options")},
                       commands=data.get("commands", []), schema=data.get("schema", 0),
                       built_at=data.get("built_at", ""), build_seconds=data.get("build_seconds", 0.0))
        except (ValueError, KeyError, TypeError) as e:
            log.warning("ignoring unreadable manifest %s: %s", path, e)
            return None
