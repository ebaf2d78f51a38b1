"""`voiced speak TEXT`: text to a WAV file with the PyTorch Spark-TTS engine, no daemon needed."""

from __future__ import annotations

import argparse
import json
import sys

from voiced.cli import CliError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("speak", help="synthesize speech with Spark-TTS (PyTorch engine)")
    p.add_argument("text", metavar="TEXT", help="what to say ('-' reads standard input)")
    p.add_argument("--model", default="spark-tts-0.5b", help="spark-tts-0.5b (the cached download) or the path "
                   "of a Spark-TTS-0.5B directory; or a Piper voice on the CPU: piper-joe-pypi, piper:<voice>, a .onnx")
    p.add_argument("--voice", default=None, help="a preset (female, male, female-high, ..., or gender:pitch:speed "
                   "like male:low:moderate) or a voice added with `voiced voices add` (default: female)")
    p.add_argument("--out", default="speech.wav", help="output WAV (default: speech.wav)")
    p.add_argument("--encoding", default="linear16", choices=["linear16", "mulaw", "alaw"],
                   help="WAV encoding: 16-bit PCM (default) or G.711 for telephony")
    p.add_argument("--sample-rate", type=int, default=16000, help="WAV sample rate (default 16000; 8000 for phones)")
    p.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="LM precision "
                   "(default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same audio)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-seconds", type=float, default=60.0, help="cap on the audio length (default: 60)")
    p.add_argument("--voices-dir", default=None, help="where cloned voices live (default: <cache>/voices)")
    p.add_argument("--json", action="store_true", help="print durations, token counts and first-chunk latency")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from voiced.engines.base import EngineError, TTSOptions
    from voiced.engines.spark.checkpoint import CheckpointError
    from voiced.hub import ModelNotFoundError

    text = sys.stdin.read() if args.text == "-" else args.text
    from voiced.engines.piper import registry as piper

    if piper.is_piper(args.model):
        return _speak_piper(args, text)
    try:
        from voiced.engines.spark.engine import SparkTTSEngine

        engine = SparkTTSEngine.load(args.model, device=args.device, dtype=args.dtype, max_batch=1,
                                     voices_dir=args.voices_dir)
        opts = TTSOptions(voice=args.voice, seed=args.seed, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, max_seconds=args.max_seconds)
        result = engine.synthesize(text, opts)
    except (ModelNotFoundError, CheckpointError, EngineError) as e:
        raise CliError(str(e)) from None
    try:
        write_speech(args.out, result.audio, args.encoding.upper(), args.sample_rate)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot write {args.out}: {e}") from None
    stats = {
        "out": args.out,
        "voice": args.voice or "female",
        "audio_seconds": round(result.audio_seconds, 3),
        "first_chunk_ms": None if result.first_chunk_s is None else round(result.first_chunk_s * 1000, 1),
        "total_ms": round(result.total_s * 1000, 1),
        "real_time_factor": round(result.total_s / result.audio_seconds, 3) if result.audio_seconds else None,
        "semantic_tokens": result.semantic_tokens,
        "prompt_tokens": result.prompt_tokens,
        "sentences": result.segments,
        "chunks": result.chunks,
        "device": engine.device,
    }
    if args.json:
        print(json.dumps(stats))
    else:
        print(f"wrote {args.out}: {stats['audio_seconds']:.2f} s of audio in {stats['total_ms'] / 1000:.2f} s "
              f"(first audio after {stats['first_chunk_ms']} ms)")
    return 0


def _speak_piper(args: argparse.Namespace, text: str) -> int:
    """`voiced speak` with a Piper voice: the engine the daemon steps, run to the end of the text."""
    import time

    from voiced.engines.base import SAMPLE_RATE, EngineError, TTSOptions
    from voiced.engines.piper.engine import PiperEngine
    from voiced.hub import ModelNotFoundError

    try:
        engine = PiperEngine.load(args.model)
        t0 = time.perf_counter()
        audio = engine.synthesize(text, TTSOptions(voice=args.voice, max_seconds=args.max_seconds))
        took = time.perf_counter() - t0
        write_speech(args.out, audio, args.encoding.upper(), args.sample_rate)
    except (ModelNotFoundError, EngineError) as e:
        raise CliError(str(e)) from None
    except (OSError, ValueError) as e:
        raise CliError(f"cannot write {args.out}: {e}") from None
    seconds = len(audio) / SAMPLE_RATE
    stats = {"out": args.out, "voice": engine.voices.default_name if not args.voice else args.voice,
             "audio_seconds": round(seconds, 3), "total_ms": round(took * 1000, 1),
             "real_time_factor": round(took / seconds, 3) if seconds else None, "device": engine.device}
    engine.close()
    print(json.dumps(stats) if args.json else f"wrote {args.out}: {seconds:.2f} s of audio in {took:.2f} s")
    return 0


def write_speech(path: str, audio, encoding: str, sample_rate: int) -> None:
    """The engine's 16 kHz float audio as a WAV in `encoding` at `sample_rate`.

    Converted by the daemon's own output path (FrameEncoder), so this file holds exactly the bytes a
    caller with that output format receives for the same text, voice and seed.
    """
    import numpy as np
    from voiced_client.wavio import write_g711_wav, write_wav

    from voiced.audio.ingest import Format, FrameEncoder

    data = FrameEncoder(Format(encoding, sample_rate)).encode(audio, last=True)
    if encoding == "LINEAR16":
        write_wav(path, np.frombuffer(data, dtype="<i2"), sample_rate)
    else:
        write_g711_wav(path, data, sample_rate, encoding)
