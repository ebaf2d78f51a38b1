"""`voiced transcribe FILE...`: speech to text with the PyTorch Whisper engine, no daemon needed.

It reads what the daemon reads (voiced.audio.files: WAV, FLAC, Ogg, MP3, WebM, M4A, AAC, AIFF, any rate
and channel count, mixed down to 16 kHz mono), and every file is read before the model loads, so a
wrong path costs no wait. Without --model it runs the model `voiced serve` would (voiced.engines.provision:
the default for the device, fetched on first use, or its PyPI copy where the hub is out of reach).
Audio longer than Whisper's 30 s window is cut into consecutive 30 s windows, each decoded alone,
and their texts are joined (segment times are shifted to the file's clock).
"""

from __future__ import annotations

import argparse
import json
import sys

from voiced.cli import CliError
from voiced.config import ASR_WINDOWS

WINDOW = 30 * 16000


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("transcribe", help="transcribe audio files with Whisper (PyTorch engine)")
    p.add_argument("files", nargs="+", metavar="FILE", help="audio files: WAV, FLAC, Ogg, MP3, WebM, M4A, AAC or AIFF "
                   "(any rate, any channel count)")
    p.add_argument("--model", default="auto", help="auto (the default: what `voiced serve` runs on this device), a "
                   "name (see `voiced models list`) or a checkpoint path (OpenAI .pt file, Hugging Face or "
                   "CTranslate2/faster-whisper directory)")
    p.add_argument("--language", default=None, help="language code or name (default: detect)")
    p.add_argument("--task", choices=["transcribe", "translate"], default="transcribe")
    p.add_argument("--beam-size", type=int, default=1, help="1 = greedy (default)")
    p.add_argument("--timestamps", action="store_true", help="decode with timestamps and print segments")
    p.add_argument("--word-timestamps", action="store_true",
                   help="time every word (openai-whisper's cross-attention alignment); printed one word a line, "
                        "or as \"words\" with --json")
    p.add_argument("--initial-prompt", default=None, help="text to condition on (names, spelling, style)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="cap on decoded tokens per 30 s window")
    p.add_argument("--device", default="auto", help="auto (the default: cuda where torch sees a GPU, else cpu), cpu or "
                   "cuda[:N]")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16", "int8"],
                   help="default: float16 on cuda, float32 on cpu; int8: int8 GEMMs on the cpu (approximate, faster)")
    p.add_argument("--window", choices=ASR_WINDOWS, default="full",
                   help="the encoder's window: full (the default: 30 s, openai-whisper's tokens) or auto (the "
                        "daemon's: on a cpu sized to each clip, ~30 %% faster, approximate; 30 s on a gpu)")
    p.add_argument("--json", action="store_true", help="one JSON object per file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from voiced.engines.base import ASROptions, ASRRequest, EngineError
    from voiced.engines.whisper.checkpoint import CheckpointError
    from voiced.engines.whisper.engine import WhisperEngine
    from voiced.engines.whisper.tokenizer import TokenizerFileNotFound
    from voiced.hub import ModelNotFoundError

    audio = {path: _read(path) for path in args.files}
    if not any(a is not None for a in audio.values()):
        return 1  # nothing to transcribe: each file's problem was said, and no model was loaded for nothing
    from voiced.engines.loader import resolve_device

    try:
        device = resolve_device(args.device)
    except ValueError as e:
        raise CliError(str(e)) from None
    model = _model(args.model, device)
    try:
        engine = WhisperEngine.load(model, device=device, dtype=args.dtype, max_batch=max(1, args.beam_size),
                                    window=args.window)
    except (ModelNotFoundError, CheckpointError, TokenizerFileNotFound, EngineError) as e:
        raise CliError(f"{e}{_cached_hint()}") from None
    opts = ASROptions(language=args.language, task=args.task, beam_size=args.beam_size,
                      timestamps=args.timestamps, initial_prompt=args.initial_prompt,
                      max_new_tokens=args.max_new_tokens, word_timestamps=args.word_timestamps)
    status = 0
    for path, samples in audio.items():
        if samples is None:
            status = 1
            continue
        try:
            windows = [samples[i:i + WINDOW] for i in range(0, max(len(samples), 1), WINDOW)]
            results = [engine.transcribe(ASRRequest(w, opts)) for w in windows]
        except EngineError as e:
            raise CliError(f"{path}: {e}") from None
        print(json.dumps(_merge(path, results, args.timestamps, args.word_timestamps)) if args.json
              else _plain(path, results, args), flush=True)
    return status


def _read(path: str):
    """The file as 16 kHz mono float32, or None after one line on stderr saying why it cannot be read."""
    from voiced.audio.files import AudioFileError, decode_file
    from voiced.audio.ingest import int16_to_float

    try:
        with open(path, "rb") as f:
            data = f.read()
        pcm, _ = decode_file(data, 16000)
    except OSError as e:
        print(f"voiced transcribe: {path}: {e.strerror or e}", file=sys.stderr)
        return None
    except AudioFileError as e:
        print(f"voiced transcribe: {path}: {e}", file=sys.stderr)
        return None
    return int16_to_float(pcm)


def _model(name: str, device: str) -> str:
    """What `voiced serve` would load for `name` on `device`: "auto" is the device's default, fetched on
    first use, or its PyPI copy where the hub cannot be reached (voiced.engines.provision)."""
    from voiced.config import Config
    from voiced.engines import provision
    from voiced.hub import DownloadError, ModelNotFoundError

    config = Config()
    config.asr.model, config.tts.enabled, config.segmentation.turn_detection = name, False, "silence"
    try:
        out = provision.provision(config, device, device)
    except (ModelNotFoundError, DownloadError) as e:
        raise CliError(f"{e}{_cached_hint()}") from None
    for missing in out.left_out:
        print(f"voiced transcribe: reading with Whisper {out.asr_model} instead of {missing}", file=sys.stderr)
    return out.asr_model


def _cached_hint() -> str:
    """The Whisper models already in the cache, as a hint after an error about another one."""
    from voiced.engines.whisper import registry

    cached = [name for name, _ in registry.cached()]
    return f" In the cache now: {', '.join(cached)} (pass --model NAME)." if cached else ""


def _merge(path: str, results: list, timestamps: bool, word_timestamps: bool = False) -> dict:
    """One record per file from its 30 s windows (a single window is reported as is)."""
    first = results[0]
    n_tokens = sum(len(r.tokens) for r in results)
    rec = {
        "file": path,
        "text": " ".join(r.text for r in results if r.text),
        "language": first.language,
        "tokens": [t for r in results for t in r.tokens],
        # Weighted so that a multi-window file still reports sum(logprob) / (tokens + 1) per window.
        "avg_logprob": sum(r.avg_logprob * (len(r.tokens) + 1) for r in results) / (n_tokens + len(results)),
        "no_speech_prob": max(r.no_speech_prob for r in results),
        "compression_ratio": max(r.compression_ratio for r in results),
        "is_hallucination": any(r.is_hallucination for r in results),
    }
    if first.language_probs:
        rec["language_prob"] = first.language_probs.get(first.language)
    if timestamps:
        rec["segments"] = [{"start": round(s.start + 30 * i, 2), "end": round(s.end + 30 * i, 2),
                            "text": s.text, "tokens": s.tokens}
                           for i, r in enumerate(results) for s in r.segments]
    if word_timestamps:
        rec["words"] = [{"word": w.word, "start": round(w.start_s + 30 * i, 3), "end": round(w.end_s + 30 * i, 3),
                         "probability": round(w.probability, 4)}
                        for i, r in enumerate(results) for w in r.words]
    return rec


def _plain(path: str, results: list, args: argparse.Namespace) -> str:
    if args.word_timestamps:
        lines = [f"# {path}"] if len(args.files) > 1 else []
        lines += [f"[{w.start_s + 30 * i:7.2f} --> {w.end_s + 30 * i:7.2f}] {w.word}"
                  for i, r in enumerate(results) for w in r.words]
        return "\n".join(lines)
    if not args.timestamps:
        text = " ".join(r.text for r in results if r.text)
        return f"{path}: {text}" if len(args.files) > 1 else text
    lines = [f"# {path}"] if len(args.files) > 1 else []
    for i, r in enumerate(results):
        for s in r.segments:
            lines.append(f"[{s.start + 30 * i:7.2f} --> {s.end + 30 * i:7.2f}] {s.text}")
    return "\n".join(lines)
