"""A/B of the Spark-TTS engine's environment settings, in one process on one GPU, one after the other.

    voiced bench spark-env --out ab.json VOICED_SPARK_PDL=0 VOICED_SPARK_PDL=1 VOICED_SPARK_PDL=0

Each mode (`VAR=VALUE[,VAR=VALUE...]`, or `default`) is set in the environment, the LM's decode step is
compiled and the engine warmed up again (so every CUDA graph, the vocoder's too, is captured under it),
then measured with spark_bench's own functions: the engine's decode step (sampled, 8 steps per sync) at
1, 16 and 64 rows (median of 3), the first audio chunk of one reply alone (median of 5) and audio
written by 64 replies of 10 s at once (twice). Greedy tokens at batch 1 are compared with the first mode's. Random
full-size weights (Spark-TTS-0.5B). Repeat the first mode last to see the drift of the run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from voiced.bench import spark_bench as sb


def parse_mode(mode: str) -> dict[str, str]:
    if mode == "default":
        return {}
    pairs = [p.split("=", 1) for p in mode.split(",")]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise SystemExit(f"spark_env_ab: mode {mode!r} is not VAR=VALUE[,VAR=VALUE...] or 'default'")
    unknown = [name for name, _ in pairs if not read_by_voiced(name)]
    if unknown:  # a misspelt name would measure the default twice and call it an A/B
        raise SystemExit(f"spark_env_ab: {', '.join(unknown)} in mode {mode!r}: no such setting is read anywhere "
                         "in voiced (the engines' switches are listed in the README)")
    return dict(pairs)


def read_by_voiced(name: str) -> bool:
    """Whether `name` appears, quoted, in the voiced package's source: every setting the engines read does."""
    return f'"{name}"' in _voiced_source()


@functools.cache
def _voiced_source() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in Path(__file__).parents[1].rglob("*.py"))


def set_mode(env: dict[str, str], modes: list[tuple[str, dict[str, str]]]) -> None:
    """Make one mode's environment: every variable any of `modes` sets is cleared, then this one's set."""
    for k in {k for _, e in modes for k in e}:
        os.environ.pop(k, None)
    os.environ.update(env)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("modes", nargs="+")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    modes = [(m, parse_mode(m)) for m in args.modes]
    if not torch.cuda.is_available():
        raise SystemExit("spark_env_ab needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    import triton

    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                 "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        eng = sb.build("cuda", torch.bfloat16, torch.bfloat16, 64, 1024, Path(tmp))
        eng.force_reply_lengths()
        eng.use_random_voice(seed=0)
        prompt = torch.randint(0, 151643, (300,), generator=torch.Generator().manual_seed(0)).cuda()
        first_tokens = None
        for mode, env in modes:
            set_mode(env, modes)
            eng.lm.compile_decode()
            eng.codec._graphs = None  # the vocoder's graphs too are captured again, under this mode
            t0 = time.perf_counter()
            eng.warmup()
            r: dict = {"mode": mode, "warmup_s": round(time.perf_counter() - t0, 1)}
            tokens, _ = sb.steps_decode(eng, prompt, 200, 1, use_graph=True)
            first_tokens = first_tokens or tokens
            r["greedy_tokens_equal_first_mode"] = tokens == first_tokens
            r["greedy_tokens"] = tokens  # (to compare runs of two trees)
            for b in (1, 16, 64):
                times = [sb.steps_decode(eng, prompt, 96, 50, use_graph=True, batch=b)[1] for _ in range(3)]
                r[f"step_ms_b{b}"] = round(1000 * statistics.median(times), 3)
            sb.engine_run(eng, 1, 1.0, 10, 25)
            firsts = [sb.engine_run(eng, 1, 2.0, 10, 25)["first_chunk_ms_p50"] for _ in range(5)]
            r["first_chunk_ms_1"], r["first_chunk_ms_1_runs"] = statistics.median(firsts), firsts
            runs64 = [sb.engine_run(eng, 64, 10.0, 10, 25) for _ in range(2)]
            r["audio_s_per_s_64"] = [e["audio_s_per_s"] for e in runs64]
            r["first_chunk_ms_64_p50"] = [e["first_chunk_ms_p50"] for e in runs64]
            r["vocoder_decoded_tokens_per_audio_token_64"] = [e["vocoder_decoded_tokens_per_audio_token"] for e in runs64]
            print(json.dumps(r), flush=True)
            res["runs"].append(r)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
