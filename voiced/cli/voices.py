"""`voiced voices add|list|delete`: the Spark-TTS voices (built-in presets and cloned voices)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from voiced.cli import CliError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("voices", help="list, add (clone from a recording) and delete TTS voices")
    sub = p.add_subparsers(dest="voices_command", metavar="ACTION")
    sub.required = True
    add = sub.add_parser("add", help="clone a voice from a 3-10 s recording and its transcript")
    add.add_argument("name", help="the voice's name (letters, digits, _ - .)")
    add.add_argument("--audio", required=True, help="reference recording (WAV, any rate / channels)")
    add.add_argument("--text", required=True, help="what is said in the recording")
    add.add_argument("--model", default="spark-tts-0.5b", help="Spark-TTS model name or directory")
    add.add_argument("--device", default=None, help="cpu or cuda[:N]")
    add.set_defaults(func=_add)
    ls = sub.add_parser("list", help="presets and cloned voices")
    ls.add_argument("--json", action="store_true", help="one JSON object per voice")
    ls.set_defaults(func=_list)
    rm = sub.add_parser("delete", help="delete a cloned voice")
    rm.add_argument("name")
    rm.set_defaults(func=_delete)
    for q in (add, ls, rm):
        q.add_argument("--voices-dir", default=None, help="where cloned voices live (default: <cache>/voices)")


def _store(args: argparse.Namespace):
    """The voice store without loading a model (listing and deleting need none)."""
    from voiced.engines.spark.voices import VoiceStore
    from voiced.hub import cache_dir

    def no_model(_audio):
        raise RuntimeError("tokenizing needs the model")

    return VoiceStore(Path(args.voices_dir) if args.voices_dir else cache_dir() / "voices", "", no_model)


def _add(args: argparse.Namespace) -> int:
    from voiced.audio.wavfile import WavError, load_16k
    from voiced.engines.base import EngineError
    from voiced.engines.spark.checkpoint import CheckpointError
    from voiced.engines.spark.engine import SparkTTSEngine
    from voiced.hub import ModelNotFoundError

    try:
        audio = load_16k(args.audio)
    except (OSError, WavError) as e:
        raise CliError(str(e)) from None
    try:
        engine = SparkTTSEngine.load(args.model, device=args.device, max_batch=1, voices_dir=args.voices_dir)
        before = engine.voices.tokenize_calls
        info = engine.voices.add(args.name, audio, args.text)
    except (ModelNotFoundError, CheckpointError, EngineError) as e:
        raise CliError(str(e)) from None
    cached = engine.voices.tokenize_calls == before
    print(f"added voice {info.name!r}: {info.description}{' (tokens from cache)' if cached else ''}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from voiced.engines.spark.voices import info_dict

    voices = _store(args).list()
    if args.json:
        for v in voices:
            print(json.dumps(info_dict(v)))
        return 0
    width = max(len(v.name) for v in voices)
    for v in voices:
        print(f"{v.name:<{width}}  {v.kind:<6}  {v.description}")
    return 0


def _delete(args: argparse.Namespace) -> int:
    from voiced.engines.base import EngineError

    try:
        removed = _store(args).delete(args.name)
    except EngineError as e:
        raise CliError(str(e)) from None
    if not removed:
        raise CliError(f"no cloned voice named {args.name!r} (see `voiced voices list`)")
    print(f"deleted voice {args.name!r}")
    return 0
