"""What word timings cost the Whisper engine: GPU kernel time and engine-thread time per request.

    python -m benchmarks.words_bench --wav speech.wav --asr-model tiny.en-pypi [--rows 1 4 16] [--out words.json]
    python -m benchmarks.words_bench --wav speech.wav --dims large-v3-turbo --tiktoken-dir DIR     (random weights)

R requests (cuts of 1.5-6 s of the WAV, each forced to the same number of tokens) are decoded together by the
served engine, with word timings and without (the reference, in the same run); for each: the wall and the
thread CPU of the steps (the engine's thread: what the other engine waits for where the two share it), and the
GPU kernels' own time (torch.profiler). The per-request cost of word timings is the difference over R. The
smart end-of-turn rule asks for word timings at every pause. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

CUTS_S = (1.5, 3.0, 4.5, 6.0)


def build(args):
    from voiced.engines.whisper.engine import WhisperEngine

    if args.asr_model:
        from voiced.engines.whisper import registry
        from voiced.hub import cache_dir

        return WhisperEngine.load(registry.resolve(args.asr_model, cache_dir()), device="cuda", max_batch=64,
                                  max_encoder_batch=16)
    from voiced.engines.random_weights import WHISPER_DIMS, random_whisper
    from voiced.engines.whisper.tokenizer import WhisperTokenizer

    dims = WHISPER_DIMS[args.dims]
    tok = WhisperTokenizer.load(dims.multilingual, dims.num_languages, [args.tiktoken_dir] if args.tiktoken_dir else None)
    model = random_whisper(dims, "cuda", torch.float16)
    return WhisperEngine(model, tok, model_name=f"{args.dims} (random)", max_batch=64, max_encoder_batch=16)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wav", type=Path, required=True, help="speech, at least 6 s (cut into the requests' audio)")
    ap.add_argument("--asr-model", default=None, help="a Whisper name or path, as `voiced serve` takes it")
    ap.add_argument("--dims", default="large-v3-turbo", help="random weights of this size (without --asr-model)")
    ap.add_argument("--tiktoken-dir", type=Path, default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16], help="requests finishing together")
    ap.add_argument("--tokens", type=int, default=24, help="tokens each request is forced to")
    ap.add_argument("--runs", type=int, default=20, help="timed repeats per mode (the thread's time is noisy)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    from voiced.audio.wavfile import load_16k
    from voiced.bench.report import emit
    from voiced.engines.base import ASROptions, ASRRequest

    engine = build(args)
    engine.warmup()
    audio = load_16k(args.wav)
    clips = [audio[: int(s * 16000)] for s in CUTS_S]
    ids = iter(range(10**9))

    def run(engine, n: int, words: bool) -> None:
        opts = ASROptions(language="en", word_timestamps=words, max_new_tokens=args.tokens, min_new_tokens=args.tokens)
        for i in range(n):
            engine.submit(next(ids), ASRRequest(clips[i % len(clips)], opts))
        while engine.has_work():
            engine.step()

    modes = {"without words": False, "words": True}
    out = {"bench": "words", "gpu": torch.cuda.get_device_name(), "model": args.asr_model or f"{args.dims} (random)",
           "tokens": args.tokens, "rows": {}}
    for n in args.rows:
        row = {}
        for name, words in modes.items():
            for _ in range(3):
                run(engine, n, words)  # every shape met once
            torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(args.runs):
                run(engine, n, words)
            torch.cuda.synchronize()
            wall, cpu = (time.perf_counter() - t0) / args.runs * 1e3, (time.thread_time() - c0) / args.runs * 1e3
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.runs):
                    run(engine, n, words)
                torch.cuda.synchronize()
            gpu = sum(e.self_device_time_total for e in prof.key_averages()) / args.runs / 1e3
            row[name] = {"wall_ms": round(wall, 2), "thread_cpu_ms": round(cpu, 2), "gpu_kernels_ms": round(gpu, 3)}
        base = row["without words"]
        row["words"]["per_request"] = {k: round((row["words"][k] - base[k]) / n, 3) for k in base}
        out["rows"][n] = row
        print(f"{n:3d} together: word timings per request {row['words']['per_request']}")
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
