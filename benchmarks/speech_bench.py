"""First audio of a one-shot synthesis: /v1/audio/speech's first byte next to gRPC Synthesize's first chunk.

The daemon runs in this process as `voiced bench e2e` runs it (random full-size Spark-TTS weights forced
to speak `--reply-seconds`, both engines warmed up), with the gRPC and HTTP doors open. The callers run
in a separate process: `--concurrency` callers in groups of one per door; a group's callers send their
request at the same moment (who goes first takes turns), for the same text, voice and audio (16-bit PCM
at 24 kHz: `response_format=pcm` over HTTP, LINEAR16 24000 Hz over gRPC), read every response to its
end, and go again. Requests sent together join the same TTS batch step, so the paired difference of
their first audio is what the doors add, free of the batch's own spread. Reported per level,
p50/p95/p99 of:

- grpc_first_chunk_ms: Synthesize sent -> its first AudioChunk received
- http_first_byte_ms: POST /v1/audio/speech sent -> the first byte of the body received
- http_sse_first_event_ms: the same with stream_format=sse -> the first speech.audio.delta received
  (with --sse)
- http_minus_grpc_paired_ms (and sse_...): per group and round, the HTTP request's first byte minus
  the gRPC request's first chunk; `within_5_ms`: both this p50 and the difference of the p50s above
  are within 5 ms (issue 19's bar)

Whisper is loaded (the daemon needs it) but idle: `--asr-dims tiny-random` saves its warm-up.
VOICED_SPARK_COMPILE=0 runs the TTS LM's steps uncompiled (CUDA graphs still), as `voiced serve` does
with it set.

    python -m benchmarks.speech_bench --tiktoken-dir DIR --concurrency 2 16 --out speech.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from voiced.bench.report import emit
from voiced.bench.steps import pct

log = logging.getLogger("voiced.bench.speech")

TEXT = "Thank you for calling. Your table for two is booked for eight o'clock tonight."
VOICE = "female"  # both doors ask for it: the same voice check and prompt on either path


async def one_group(grpc_address: str, http_address: str, k: int, duration_s: float, fronts: list[str],
                    out: dict) -> None:
    """One caller per door, asking at the same moment for the same speech, again and again: the requests
    of a round reach the TTS batch together, so the difference of their first audio is the doors' own."""
    import aiohttp
    import grpc
    from voiced_client.proto import voiced_pb2 as pb
    from voiced_client.proto import voiced_pb2_grpc as pb_grpc

    fmt = pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=24000)
    url = f"http://{http_address}/v1/audio/speech"

    async def call(front: str) -> float | None:
        """ms from sending the request to its first audio (the whole response is read)."""
        t0 = time.monotonic()
        first = None
        if front == "grpc":
            request = pb.SynthesizeRequest(text=TEXT, output_format=fmt, speech=pb.SpeechConfig(voice=VOICE))
            async for _ in stub.Synthesize(request):
                first = first or time.monotonic()
            return (first - t0) * 1000
        body = {"model": "tts-1", "input": TEXT, "voice": VOICE, "response_format": "pcm"}
        if front == "sse":
            body["stream_format"] = "sse"
        async with http.post(url, json=body) as resp:
            if resp.status != 200:
                out["errors"].append(f"{resp.status}: {(await resp.text())[:200]}")
                return None
            if front == "http":
                await resp.content.readany()  # the body's first bytes: audio (pcm has no header)
                first = time.monotonic()
            else:
                async for line in resp.content:
                    if line.startswith(b"data:") and b"speech.audio.delta" in line:
                        first = time.monotonic()
                        break
            await resp.read()
        return (first - t0) * 1000

    async with grpc.aio.insecure_channel(grpc_address) as channel, aiohttp.ClientSession() as http:
        stub = pb_grpc.VoicedStub(channel)
        t_end = time.monotonic() + duration_s
        i = k
        while time.monotonic() < t_end:
            order = fronts[i % len(fronts):] + fronts[:i % len(fronts)]  # who is sent first takes turns
            i += 1
            took = dict(zip(order, await asyncio.gather(*(call(f) for f in order))))
            for front, ms in took.items():
                if ms is not None:
                    out[KEYS[front]].append(ms)
            for front in fronts[1:]:
                if took[front] is not None and took["grpc"] is not None:
                    out[f"{front}_minus_grpc_paired_ms"].append(took[front] - took["grpc"])


KEYS = {"grpc": "grpc_first_chunk_ms", "http": "http_first_byte_ms", "sse": "http_sse_first_event_ms"}


async def workers(grpc_address: str, http_address: str, concurrency: int, duration_s: float, sse: bool) -> dict:
    fronts = ["grpc", "http"] + (["sse"] if sse else [])
    out = {k: [] for k in (*KEYS.values(), "http_minus_grpc_paired_ms", "sse_minus_grpc_paired_ms", "errors")}
    groups = max(1, concurrency // len(fronts))
    await asyncio.gather(*(one_group(grpc_address, http_address, k, duration_s, fronts, out) for k in range(groups)))
    report: dict = {"callers": groups * len(fronts)}
    report.update({k: pct(v) for k, v in out.items() if k != "errors" and v})
    report["errors"] = out["errors"][:10]
    g, h = report.get("grpc_first_chunk_ms", {}).get("p50"), report.get("http_first_byte_ms", {}).get("p50")
    if g is not None and h is not None:
        report["http_minus_grpc_p50_ms"] = round(h - g, 1)
        paired = report["http_minus_grpc_paired_ms"]["p50"]
        report["within_5_ms"] = abs(h - g) <= 5.0 and abs(paired) <= 5.0
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiktoken-dir", type=Path, required=True, help="folder holding multilingual.tiktoken")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[2, 16], help="callers (one per door in each group)")
    ap.add_argument("--asr-dims", default="large-v3-turbo", help="Whisper dimensions (idle here); tiny-random is "
                    "quicker to warm up")
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

    from voiced.bench.bench_daemon import start_server

    # The e2e bench's server, as it builds it (its options with their defaults, ASR small: idle here).
    server_args = argparse.Namespace(
        asr_dims="tiny-random" if args.tiny_cpu else args.asr_dims, tiktoken_dir=args.tiktoken_dir,
        asr_tokens=8, asr_batch=8, tts_batch=args.tts_batch, reply_seconds=args.reply_seconds,
        first_chunk_tokens=args.first_chunk_tokens, chunk_tokens=args.chunk_tokens,
        tiny_cpu=args.tiny_cpu, front=["grpc", "realtime"])  # realtime: the HTTP listener
    server = start_server(server_args)
    grpc_address, http_address = server.addresses["grpc"], server.addresses["http"]
    # The e2e server speaks every voice with one fixed random speaker under the name "bench"; keep the
    # name asked for, so that both doors ask for VOICE and it passes the HTTP door's voice check too.
    voices = server.services.tts.engine.voices
    resolve = voices.resolve
    voices.resolve = lambda name: dataclasses.replace(resolve(name), name=name or "bench")
    result = {"bench": "speech", "gpu": "cpu (dry run)" if args.tiny_cpu else torch.cuda.get_device_name(),
              "torch": torch.__version__, "python": platform.python_version(), "reply_seconds": args.reply_seconds,
              "first_chunk_tokens": args.first_chunk_tokens, "asr_dims": server_args.asr_dims,
              "tts_compiled": server.spec.runtime.tts.compile,
              "text": TEXT, "voice": VOICE, "duration_s": args.duration, "date": time.strftime("%Y-%m-%d"), "levels": {}}
    for n in args.concurrency:
        cmd = [sys.executable, "-m", "benchmarks.speech_bench", "--tiktoken-dir", str(args.tiktoken_dir),
               "--duration", str(args.duration), "--workers", f"{grpc_address}@{http_address}@{n}"]
        if args.sse:
            cmd.append("--sse")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
        if proc.returncode != 0:
            result["levels"][n] = {"error": proc.stderr[-2000:]}
            continue
        result["levels"][n] = json.loads(proc.stdout.strip().splitlines()[-1])
        log.info("%d at once: %s", n, json.dumps(result["levels"][n]))
    server.stop()
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
