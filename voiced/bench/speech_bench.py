"""First audio of a one-shot synthesis: /v1/audio/speech's first byte next to gRPC Synthesize's first chunk.

The daemon runs in this process as `voiced bench e2e` runs it (random full-size Spark-TTS weights forced
to speak `--reply-seconds`, both engines warmed up), with the gRPC and HTTP doors open. The callers run
in a separate process: `--concurrency` workers, each asking in turn through one door then the other,
for the same text in the same audio (16-bit PCM at 24 kHz: `response_format=pcm` over HTTP, LINEAR16
24000 Hz over gRPC), reading every response to its end. Reported per level, p50/p95/p99 of:

- grpc_first_chunk_ms: Synthesize sent -> its first AudioChunk received
- http_first_byte_ms: POST /v1/audio/speech sent -> the first byte of the body received
- http_sse_first_event_ms: the same with stream_format=sse -> the first speech.audio.delta received

    voiced bench speech --tiktoken-dir DIR --concurrency 1 16 --out speech.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from voiced.bench.steps import pct

log = logging.getLogger("voiced.bench.speech")

TEXT = "Thank you for calling. Your table for two is booked for eight o'clock tonight."


async def one_worker(grpc_address: str, http_address: str, k: int, duration_s: float, sse: bool, out: dict) -> None:
    import aiohttp
    import grpc
    from voiced_client.proto import voiced_pb2 as pb
    from voiced_client.proto import voiced_pb2_grpc as pb_grpc

    fmt = pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=24000)
    url = f"http://{http_address}/v1/audio/speech"
    fronts = ["grpc", "http"] + (["sse"] if sse else [])
    async with grpc.aio.insecure_channel(grpc_address) as channel, aiohttp.ClientSession() as http:
        stub = pb_grpc.VoicedStub(channel)
        t_end = time.monotonic() + duration_s
        i = k
        while time.monotonic() < t_end:
            front = fronts[i % len(fronts)]
            i += 1
            t0 = time.monotonic()
            first = None
            if front == "grpc":
                async for _ in stub.Synthesize(pb.SynthesizeRequest(text=TEXT, output_format=fmt)):
                    first = first or time.monotonic()
                out["grpc_first_chunk_ms"].append((first - t0) * 1000)
                continue
            body = {"model": "tts-1", "input": TEXT, "voice": "female", "response_format": "pcm"}
            if front == "sse":
                body["stream_format"] = "sse"
            async with http.post(url, json=body) as resp:
                if resp.status != 200:
                    out["errors"].append(f"{resp.status}: {(await resp.text())[:200]}")
                    continue
                if front == "http":
                    await resp.content.readany()
                    first = time.monotonic()
                else:
                    async for line in resp.content:
                        if line.startswith(b"data:") and b"speech.audio.delta" in line:
                            first = time.monotonic()
                            break
                await resp.read()
            key = "http_first_byte_ms" if front == "http" else "http_sse_first_event_ms"
            out[key].append((first - t0) * 1000)


async def workers(grpc_address: str, http_address: str, concurrency: int, duration_s: float, sse: bool) -> dict:
    out = {k: [] for k in ("grpc_first_chunk_ms", "http_first_byte_ms", "http_sse_first_event_ms", "errors")}
    await asyncio.gather(*(one_worker(grpc_address, http_address, k, duration_s, sse, out)
                           for k in range(concurrency)))
    report = {k: pct(v) for k, v in out.items() if k != "errors" and v}
    report["errors"] = out["errors"][:10]
    g, h = report.get("grpc_first_chunk_ms", {}).get("p50"), report.get("http_first_byte_ms", {}).get("p50")
    if g is not None and h is not None:
        report["http_minus_grpc_p50_ms"] = round(h - g, 1)
        report["within_5_ms"] = abs(h - g) <= 5.0
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiktoken-dir", type=Path, required=True, help="folder holding multilingual.tiktoken")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--duration", type=float, default=30.0, help="seconds each level runs")
    ap.add_argument("--reply-seconds", type=float, default=2.0, help="forced speech length (random weights)")
    ap.add_argument("--first-chunk-tokens", type=int, default=10)
    ap.add_argument("--chunk-tokens", type=int, default=25)
    ap.add_argument("--tts-batch", type=int, default=64)
    ap.add_argument("--sse", action="store_true", help="also time stream_format=sse")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--tiny-cpu", action="store_true", help="dry run on the CPU with tiny random models")
    ap.add_argument("--workers", default=None, help=argparse.SUPPRESS)  # internal: run the callers only
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.workers:
        grpc_address, http_address, n = args.workers.split("@")
        report = asyncio.run(workers(grpc_address, http_address, int(n), args.duration, args.sse))
        print(json.dumps(report))
        return report

    import torch

    from voiced.bench import e2e_bench

    # The e2e bench's server, as it builds it (its options with their defaults, ASR small: idle here).
    server_args = argparse.Namespace(
        asr_dims="tiny-random" if args.tiny_cpu else "large-v3-turbo", tiktoken_dir=args.tiktoken_dir,
        asr_tokens=8, asr_batch=8, tts_batch=args.tts_batch, reply_seconds=args.reply_seconds,
        first_chunk_tokens=args.first_chunk_tokens, chunk_tokens=args.chunk_tokens, separate_threads=False,
        no_gc_freeze=False, tiny_cpu=args.tiny_cpu)
    grpc_address, server, loop = e2e_bench.start_server(server_args)
    http_address = server.services.doors["http"]
    result = {"bench": "speech", "gpu": "cpu (dry run)" if args.tiny_cpu else torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "reply_seconds": args.reply_seconds,
              "first_chunk_tokens": args.first_chunk_tokens, "date": time.strftime("%Y-%m-%d"), "levels": {}}
    for n in args.concurrency:
        cmd = [sys.executable, "-m", "voiced.bench.speech_bench", "--tiktoken-dir", str(args.tiktoken_dir),
               "--duration", str(args.duration), "--workers", f"{grpc_address}@{http_address}@{n}"]
        if args.sse:
            cmd.append("--sse")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if proc.returncode != 0:
            result["levels"][n] = {"error": proc.stderr[-2000:]}
            continue
        result["levels"][n] = json.loads(proc.stdout.strip().splitlines()[-1])
        log.info("%d at once: %s", n, json.dumps(result["levels"][n]))
    asyncio.run_coroutine_threadsafe(server.drain_and_stop(grace=0), loop).result(60)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
