"""`voiced models pull spark-tts-0.5b` / `voiced models list`: the Spark-TTS provider (no heavy imports)."""

from __future__ import annotations

from pathlib import Path

from voiced import hub

from .checkpoint import MODEL_NAME, PUBLISHED_FILES, expected_layout
from .checkpoint import pull as _pull


def names() -> list[str]:
    return [MODEL_NAME]


def _root(root: Path | None) -> Path:
    return Path(root) / MODEL_NAME if root else hub.cache_dir() / MODEL_NAME


def pull(name: str, root: Path | None = None) -> list[Path]:
    """Download the published Spark-TTS-0.5B directory (progress bars; finished files are skipped)."""
    if name != MODEL_NAME:
        raise hub.ModelNotFoundError(f"unknown Spark-TTS model {name!r}; known: {MODEL_NAME}")
    dest = _pull(_root(root))
    return [dest / rel for rel in PUBLISHED_FILES]


def cached(root: Path | None = None) -> list[tuple[str, Path]]:
    d = _root(root)
    return [(MODEL_NAME, d)] if all((d / rel).exists() for rel in PUBLISHED_FILES) else []


def missing(root: Path | None = None) -> list[str]:
    """What `voiced models list` says when Spark-TTS is not (completely) in the cache."""
    d = _root(root)
    if cached(root):
        return []
    absent = [rel for rel in PUBLISHED_FILES if not (d / rel).exists()]
    state = "not downloaded" if len(absent) == len(PUBLISHED_FILES) else f"incomplete (missing {', '.join(absent)})"
    return [f"Spark-TTS: {state}; `voiced models pull {MODEL_NAME}` fetches {expected_layout(d)}"]
