"""GPU memory of the daemon's two engines: the printed plan against what PyTorch's allocator holds.

Builds Whisper (random weights at --asr-dims) and Spark-TTS-0.5B (random weights) as the end-to-end
benchmark does, computes each engine's plan with the functions `voiced serve` prints it from
(voiced.memory_plan; `memory_need` of each engine), warms both up on one engine thread as the daemon
does, then serves the largest steps the engines take: --asr-batch utterances and --tts-batch replies
submitted at once, stepped in turn until done. Reported (GiB, and the plan's error in %):

- held: what each engine holds after its warm-up, against its plan without the step transient (for
  Spark-TTS including the idle part of its CUDA graphs' shared memory pool, which the allocator counts
  as reserved, not allocated; added to the serving peak too);
- warm-up peak per phase (Whisper's; the TTS engine's decode graphs, prefill lengths, vocoder shapes);
- serving peak, against the plan's total (held + the largest step transient);
- the warm-up peak over the serving peak (a warm-up that needs more than serving fails first on a
  GPU shared with other work).

--trace records every allocation's Python stack (torch.cuda.memory._record_memory_history) and lists
what is held after warm-up by the line that allocated it: where memory the plan does not know comes from.

    python -m benchmarks.memory_bench --tiktoken-dir DIR --out memory.json [--trace]
"""

from __future__ import annotations

import argparse
import logging
import platform
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from voiced.bench.report import emit

log = logging.getLogger("voiced.bench.memory")
GIB = 2**30


def _gib(n: float) -> float:
    return round(n / GIB, 3)


def graph_pool_idle_bytes(pool) -> int:
    """Bytes a CUDA-graph memory pool keeps that no live tensor holds: the graphs' activations between
    replays. The allocator counts them as reserved, not allocated, yet nothing else can use them."""
    if pool is None:
        return 0
    return sum(seg["total_size"] - seg["allocated_size"] for seg in torch.cuda.memory_snapshot()
               if tuple(seg.get("segment_pool_id") or ()) == tuple(pool))


def held_by_line(top: int = 25) -> list[dict]:
    """Live allocations grouped by the innermost frame in voiced/ (else the innermost frame) that made them."""
    snap = torch.cuda.memory._snapshot()
    sizes: dict[str, int] = defaultdict(int)
    counts: dict[str, int] = defaultdict(int)
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            frames = blk.get("frames") or []
            ours = [f for f in frames if "/voiced/" in f.get("filename", "")]
            f = (ours or frames or [{"filename": "?", "line": 0, "name": "?"}])[0]
            key = f"{f['filename'].split('/voiced/')[-1]}:{f['line']} {f['name']}"
            sizes[key] += blk["size"]
            counts[key] += 1
    rows = sorted(sizes.items(), key=lambda kv: -kv[1])[:top]
    return [{"where": k, "mib": round(v / 2**20, 1), "blocks": counts[k]} for k, v in rows]


def main(argv: list[str] | None = None) -> dict:
    from voiced.bench.targets import judge
    from voiced.core.scheduler import EngineThread
    from voiced.engines.base import ASROptions, ASRRequest, TTSOptions, TTSRequest
    from voiced.engines.random_weights import WHISPER_DIMS, chirps, random_spark, random_whisper
    from voiced.engines.spark.memory_plan import memory_need as spark_need
    from voiced.engines.spark.memory_plan import vocoder_step_bytes
    from voiced.engines.whisper.engine import WhisperEngine
    from voiced.engines.whisper.memory import memory_need as whisper_need
    from voiced.engines.whisper.tokenizer import WhisperTokenizer
    from voiced.memory_plan import plan_table, plan_total, stream_workspace_bytes, tensor_bytes

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiktoken-dir", type=Path, required=True, help="folder holding multilingual.tiktoken")
    ap.add_argument("--asr-dims", default="large-v3-turbo", choices=sorted(WHISPER_DIMS))
    ap.add_argument("--asr-batch", type=int, default=64, help="Whisper decoder rows (the e2e bench's)")
    ap.add_argument("--tts-batch", type=int, default=64, help="Spark-TTS rows (the e2e bench's)")
    ap.add_argument("--tts-max-seq", type=int, default=2048)
    ap.add_argument("--reply-seconds", type=float, default=2.0)
    ap.add_argument("--asr-tokens", type=int, default=24)
    ap.add_argument("--trace", action="store_true", help="record allocation stacks; list held memory by line")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    assert torch.cuda.is_available(), "this benchmark measures a CUDA GPU's memory"
    dev = "cuda"
    res: dict = {"bench": "memory", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
                 "asr_dims": args.asr_dims, "asr_batch": args.asr_batch, "tts_batch": args.tts_batch,
                 "tts_max_seq": args.tts_max_seq}
    if args.trace:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    thread = EngineThread("engines")  # one thread loads, warms and steps both, as `voiced serve` steps them
    phases: dict[str, dict] = {}

    def mark(name: str) -> None:
        torch.cuda.synchronize()
        phases[name] = {"allocated_gib": _gib(torch.cuda.memory_allocated()),
                        "peak_gib": _gib(torch.cuda.max_memory_allocated())}
        log.info("%s: %s", name, phases[name])
        torch.cuda.reset_peak_memory_stats()

    # ---- Whisper, as the e2e bench builds it
    dims = WHISPER_DIMS[args.asr_dims]
    tok = WhisperTokenizer.load(dims.multilingual, dims.num_languages, [args.tiktoken_dir])
    torch.cuda.reset_peak_memory_stats()
    workspace = thread.call(stream_workspace_bytes, dev)
    model = random_whisper(dims, dev, torch.float16)
    asr = thread.call(lambda: WhisperEngine(model, tok, model_name=args.asr_dims, max_batch=args.asr_batch,
                                            cuda_graphs=True))
    w_need = whisper_need(dims, torch.float16, tensor_bytes(model, torch.float16), asr.max_batch, cuda=True,
                          max_encoder_batch=asr.max_encoder_batch, decode_chunk=asr.decode_chunk,
                          workspace_bytes=workspace, alignment_heads=len(asr.alignment_heads))
    mark("asr_load")
    thread.call(asr.warmup)
    mark("asr_warmup")
    asr_held = torch.cuda.memory_allocated()

    # ---- Spark-TTS, as the e2e bench builds it (forced lengths, a fixed cloned voice, compiled)
    work = Path(tempfile.mkdtemp())
    tts = thread.call(lambda: random_spark(dev, torch.bfloat16, torch.bfloat16, args.tts_batch,
                                                args.tts_max_seq, work))
    tts.vocoder_graphs = False  # the eager vocoder, whose step transient the plan below counts (no graphs' rows)
    tts.force_reply_lengths()
    tts.use_random_voice(seed=0)
    tts.lm.compile_decode()
    s_need = spark_need(tts.lm.config, torch.bfloat16, tensor_bytes(tts.lm, torch.bfloat16),
                        tensor_bytes(tts.codec, torch.bfloat16), tts.max_batch, tts.max_seq_len, cuda=True,
                        graphs=tts.use_cuda_graphs, decode_steps=tts.decode_steps, workspace_bytes=workspace,
                        vocoder_bytes=vocoder_step_bytes(tts.codec.config, torch.bfloat16))
    mark("tts_load")
    thread.call(tts.warmup)
    mark("tts_warmup")
    res["tts_warmup_peaks_gib"] = tts.warmup_stats["peak_gib"]
    # the LM's graphs' shared pool (ServedLM.graph_pool): held for good, though not "allocated"
    pool = graph_pool_idle_bytes(tts.lm._pool)
    res["tts_graph_pool_idle_gib"] = _gib(pool)
    tts_held = torch.cuda.memory_allocated() - asr_held + pool
    res["plan"] = plan_table([w_need, s_need])
    log.info("\n%s", res["plan"])
    if args.trace:
        res["held_after_warmup_by_line"] = held_by_line()
        for row in res["held_after_warmup_by_line"]:
            log.info("held: %9.1f MiB in %4d blocks  %s", row["mib"], row["blocks"], row["where"])

    # ---- serving: every row of both engines busy at once, stepped in turn on the engine thread
    audio = chirps(args.asr_batch, seconds=10.0)
    opts = ASROptions(language="en", max_new_tokens=args.asr_tokens, min_new_tokens=args.asr_tokens)
    text = "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all."

    def serve() -> dict:
        for i, a in enumerate(audio):
            asr.submit(i, ASRRequest(a, opts))
        for i in range(args.tts_batch):
            tts.submit(i, TTSRequest(text, TTSOptions(voice="bench", seed=i, max_seconds=args.reply_seconds)))
        steps = {"asr": 0, "tts": 0}
        while asr.has_work() or tts.has_work():
            for name, eng in (("asr", asr), ("tts", tts)):
                if eng.has_work():
                    for out in eng.step():
                        assert out.error is None, out.error
                    steps[name] += 1
        return steps

    res["serving_steps"] = thread.call(serve)
    mark("serving")

    held_plan = {e.engine: sum(i.bytes for i in e.items if not i.transient) for e in (w_need, s_need)}
    total = plan_total([w_need, s_need])
    pool_after = graph_pool_idle_bytes(tts.lm._pool)  # the same unless serving captured a new graph
    res["tts_graph_pool_idle_after_serving_gib"] = _gib(pool_after)
    serving_peak = phases["serving"]["peak_gib"] * GIB + pool_after
    # the TTS warm-up resets the allocator's peak after each phase and reports each phase's own
    warm_peak = max(phases["asr_warmup"]["peak_gib"], phases["tts_warmup"]["peak_gib"],
                    *res["tts_warmup_peaks_gib"].values()) * GIB
    res["phases"] = phases
    res["summary"] = {
        "whisper_held_gib": _gib(asr_held), "whisper_plan_held_gib": _gib(held_plan["Whisper"]),
        "whisper_held_error_pct": round(100 * (held_plan["Whisper"] - asr_held) / asr_held, 1),
        "tts_held_gib": _gib(tts_held), "tts_plan_held_gib": _gib(held_plan["Spark-TTS"]),
        "tts_held_error_pct": round(100 * (held_plan["Spark-TTS"] - tts_held) / tts_held, 1),
        "plan_total_gib": _gib(total), "serving_peak_gib": _gib(serving_peak),
        "plan_error_pct": round(100 * (total - serving_peak) / serving_peak, 1),
        "warmup_peak_gib": _gib(warm_peak), "warmup_over_serving_gib": _gib(warm_peak - serving_peak),
    }
    s = res["summary"]
    log.info("plan %.2f GiB against a serving peak of %.2f GiB (%+.1f %%); warm-up peak %.2f GiB (%+.2f GiB over "
             "serving)", s["plan_total_gib"], s["serving_peak_gib"], s["plan_error_pct"], s["warmup_peak_gib"],
             s["warmup_over_serving_gib"])
    res["targets"] = judge({"memory_plan_error_pct": abs(s["plan_error_pct"]),
                            "memory_warmup_over_serving_gib": s["warmup_over_serving_gib"]})
    emit(res, args.out)
    return res


if __name__ == "__main__":
    main()
