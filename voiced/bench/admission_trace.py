"""Where a one-shot synthesis spends its time between the caller and the TTS engine, per door (a CPU trace).

Runs the speech bench's daemon (`voiced.bench.e2e_bench.start_server`, tiny random models on the CPU) with
the gRPC and HTTP doors open, and a caller process that sends a gRPC Synthesize and a streamed
POST /v1/audio/speech at the same moment (the same text, voice and audio as `voiced bench speech`; who
goes first alternates), `--rounds` times, one pair at a time. Each request is stamped (CLOCK_MONOTONIC,
shared by both processes) at:

- send: the caller, just before the request leaves;
- intercept (gRPC only): the server's first interceptor sees the call;
- handler: the door's handler starts (VoicedService.Synthesize, OpenAIAudio.speech);
- put: the request is queued for the engine thread (EngineWorker.stream);
- submit: the engine thread hands it to the engine (the step log's "submit");
- prefill: the engine's step that prefills it begins (the request joins the batch);
- first: its first audio reaches the door.

Prints the p50 of each interval per door, how often each door reached the engine first, and the paired
(same round) differences. What it shows is the doors' and the engine's scheduling overhead on this
machine, not GPU figures.

    python -m voiced.bench.admission_trace --rounds 50 --out trace.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import statistics
import subprocess
import sys
import time

TEXT = "Thank you for calling. Your table for two is booked for eight o'clock tonight."
VOICE = "female"
INTERVALS = (("send", "intercept"), ("send", "handler"), ("handler", "put"), ("put", "submit"), ("send", "submit"),
             ("submit", "prefill"), ("send", "prefill"), ("send", "first"))

_door: contextvars.ContextVar[str | None] = contextvars.ContextVar("door", default=None)
_record: contextvars.ContextVar[dict | None] = contextvars.ContextVar("record", default=None)


class _StampedQueue:
    """The engine thread's command queue, noting which traced request each submission belongs to."""

    def __init__(self, q, by_id: dict[int, dict]):
        self._q, self._by_id = q, by_id
        self.get, self.get_nowait = q.get, q.get_nowait

    def put(self, command) -> None:
        rec = _record.get()
        if command[1] == "submit" and rec is not None:
            self._by_id[command[2]] = rec
        self._q.put(command)


def _instrument_doors(events: dict[str, list[dict]], intercepts: list[float]) -> None:
    """Before the daemon starts: the doors bind their handlers when they open."""
    from voiced.core import scheduler
    from voiced.doors import grpc_server, openai_http

    guard = grpc_server.DecodeGuard.intercept_service

    async def intercept_service(self, continuation, details):
        if details.method.endswith("/Synthesize"):
            intercepts.append(time.monotonic())
        return await guard(self, continuation, details)

    synthesize = grpc_server.VoicedService.Synthesize

    async def grpc_synthesize(self, request, context):
        _door.set("grpc")
        events["grpc"].append({"handler": time.monotonic()})
        async for response in synthesize(self, request, context):
            yield response

    speech = openai_http.OpenAIAudio.speech

    async def http_speech(self, request):
        _door.set("http")
        events["http"].append({"handler": time.monotonic()})
        return await speech(self, request)

    stream = scheduler.EngineWorker.stream

    async def traced_stream(self, request):
        door = _door.get()
        rec = events[door][-1] if door and self.name == "tts" else None
        if rec is not None:
            rec["put"] = time.monotonic()
            _record.set(rec)
        async for value in stream(self, request):
            if rec is not None and "first" not in rec:
                rec["first"] = time.monotonic()
            yield value

    grpc_server.DecodeGuard.intercept_service = intercept_service
    grpc_server.VoicedService.Synthesize = grpc_synthesize
    openai_http.OpenAIAudio.speech = http_speech
    scheduler.EngineWorker.stream = traced_stream


def _instrument_engine(services) -> None:
    by_id: dict[int, dict] = {}
    worker, engine = services.tts, services.tts.engine
    worker.thread.commands = _StampedQueue(worker.thread.commands, by_id)
    submit, prefill_fresh = engine.submit, engine._prefill_fresh

    def traced_submit(request_id, request):
        if request_id in by_id:
            by_id[request_id]["submit"] = time.monotonic()
        return submit(request_id, request)

    def traced_prefill(outputs):
        t = time.monotonic()
        fresh, hidden = prefill_fresh(outputs)
        for r in fresh:
            by_id.get(r.rid, {}).setdefault("prefill", t)
        return fresh, hidden

    engine.submit, engine._prefill_fresh = traced_submit, traced_prefill


def summarize(events: dict[str, list[dict]]) -> dict:
    def p50(xs):
        return round(statistics.median(xs), 2) if xs else None

    out: dict = {}
    for door, rows in events.items():
        out[door] = {f"{a}->{b}_ms": p50([(r[b] - r[a]) * 1000 for r in rows if a in r and b in r])
                     for a, b in INTERVALS}
        out[door]["n"] = len(rows)
    pairs = [(g, h) for g, h in zip(events["grpc"], events["http"]) if "submit" in g and "submit" in h]
    out["reached_the_engine_first"] = {"grpc": sum(g["submit"] < h["submit"] for g, h in pairs),
                                       "http": sum(h["submit"] < g["submit"] for g, h in pairs)}
    out["prefilled_in_the_same_step"] = sum(g.get("prefill") == h.get("prefill") for g, h in pairs)
    for key in ("submit", "prefill", "first"):
        out[f"paired_{key}_http_minus_grpc_ms"] = p50([(h[key] - g[key]) * 1000 for g, h in pairs
                                                       if key in g and key in h])
    return out


def serve(args) -> dict:
    from voiced.bench import e2e_bench
    from voiced.engines.whisper.tokenizer import find_tiktoken_file

    ns = argparse.Namespace(asr_dims="tiny-random", tiktoken_dir=find_tiktoken_file("multilingual.tiktoken").parent,
                            asr_tokens=8, asr_batch=8, tts_batch=8, reply_seconds=args.reply_seconds,
                            first_chunk_tokens=10, chunk_tokens=25, engine_threads="auto", no_gc_freeze=False,
                            tiny_cpu=True, front=["grpc", "realtime"])
    events: dict[str, list[dict]] = {"grpc": [], "http": []}
    intercepts: list[float] = []
    _instrument_doors(events, intercepts)
    addresses, server, loop = e2e_bench.start_server(ns)
    _instrument_engine(server.services)
    try:
        proc = subprocess.run([sys.executable, "-m", "voiced.bench.admission_trace", "--rounds", str(args.rounds),
                               "--caller", f"{addresses['grpc']}@{addresses['http']}"],
                              capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"the caller failed:\n{proc.stderr[-3000:]}")
        sent = json.loads(proc.stdout.strip().splitlines()[-1])
    finally:
        asyncio.run_coroutine_threadsafe(server.drain_and_stop(grace=0), loop).result(60)
    for door in events:
        for rec, t0 in zip(events[door], sent[door]):
            rec["send"] = t0
    for rec, t in zip(events["grpc"], intercepts):
        rec["intercept"] = t
    return {"summary": summarize(events), "events": events}


async def caller(addresses: str, rounds: int) -> dict[str, list[float]]:
    import aiohttp
    import grpc
    from voiced_client.proto import voiced_pb2 as pb
    from voiced_client.proto import voiced_pb2_grpc as pb_grpc

    grpc_address, http_address = addresses.split("@")
    fmt = pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=24000)
    sent: dict[str, list[float]] = {"grpc": [], "http": []}
    async with grpc.aio.insecure_channel(grpc_address) as channel, aiohttp.ClientSession() as http:
        stub = pb_grpc.VoicedStub(channel)

        async def call(door: str) -> None:
            if door == "grpc":
                request = pb.SynthesizeRequest(text=TEXT, output_format=fmt, speech=pb.SpeechConfig(voice=VOICE))
                sent["grpc"].append(time.monotonic())
                async for _ in stub.Synthesize(request):
                    pass
                return
            body = {"model": "tts-1", "input": TEXT, "voice": VOICE, "response_format": "pcm"}
            sent["http"].append(time.monotonic())
            async with http.post(f"http://{http_address}/v1/audio/speech", json=body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"{resp.status}: {await resp.text()}")
                await resp.read()

        for i in range(rounds):
            order = ["grpc", "http"] if i % 2 == 0 else ["http", "grpc"]
            await asyncio.gather(*(call(d) for d in order))
    return sent


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=50, help="pairs of requests, one pair at a time")
    ap.add_argument("--reply-seconds", type=float, default=0.3, help="forced speech length (random weights)")
    ap.add_argument("--out", default=None, help="write the summary and every request's stamps here (JSON)")
    ap.add_argument("--caller", default=None, help=argparse.SUPPRESS)  # internal: run the caller process
    args = ap.parse_args(argv)
    if args.caller:
        sent = asyncio.run(caller(args.caller, args.rounds))
        print(json.dumps(sent))
        return sent
    result = serve(args)
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
