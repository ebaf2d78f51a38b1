"""End to end through a front door: N concurrent calls against one daemon on one GPU.

The daemon runs in this process as `voiced serve` runs it (voiced.bench.bench_daemon: server, sessions,
schedulers, the engines built and placed by voiced.assembly), with random full-size weights (Whisper large-v3-turbo dimensions, Spark-TTS-0.5B), the
echo agent, forced decode lengths. The callers run in processes of their own (so they do not share
the server's interpreter; one per 64 callers, `--caller-processes`) and stream a WAV in real time as 20 ms
frames, looping it, each caller starting at a different point of the loop. Reported per concurrency level, p50/p95/p99 of:

- asr_ms: end of speech detected -> final transcript sent (server-measured `latency_ms`)
- asr_engine_ms: the part of asr_ms in the engines' process, from the request's submission to its worker to its
  transcript (the command queue and the engine); asr_worker_ms: the same on the daemon's side (with the pipe)
- tts_engine_ms: a reply's time in the engines' process, submission to last chunk; its queue_ms is the wait
  for a batch row (all taken), held_ms the time in one (prefill, decode and the vocoder's last windows)
- loop_lag_ms: how late the daemon's event loop ran a callback due every 10 ms (its worst, and when in the level)
- agent_ms: end of speech -> the agent's first text
- first_audio_ms (voice-to-voice): end of speech detected -> first reply audio chunk sent
- tts_first_chunk_ms: the agent's text -> first audio chunk (first_audio_ms - agent_ms)
- rtf: reply generation time / reply audio duration (first text to last chunk, per reply)

The figures above are the daemon's own (gRPC events carry them). `--front grpc audiosocket media_ws`
runs every level through each named door in turn (same daemon, same engines; barge-in off, as on
gRPC) and reports, for every door, v2v_client_ms: voice-to-voice as the caller hears it, from the
daemon detecting the end of speech to the first reply audio arriving (voiced.bench.phone_callers
says how the caller knows that moment), v2v_real_end_ms: the same reply timed from the caller's real
end of speech (the last sound it sent before that moment: the first figure plus the wait for the end of
the turn; gRPC, AudioSocket and media WebSocket callers), and door_overhead_ms: each door's v2v_client_ms p50/p95 minus
gRPC's. AudioSocket callers send slin16 (type 0x12, the very samples gRPC callers send); media
WebSocket callers send mu-law 8 kHz as Twilio does. Realtime callers (OpenAI's events over
/v1/realtime, audio/pcm at 24 kHz) time voice-to-voice from the door's `speech_stopped` event to the
first `response.output_audio.delta`, and asr_client_ms from `speech_stopped` to the transcript.
Wyoming callers play Home Assistant's part (voiced.bench.wyoming_caller): their own end of speech,
`transcribe`, then the transcript spoken back with `synthesize`.

`--asr-model NAME|DIR` runs a real Whisper instead (loaded as `voiced serve --asr-model` loads it, its
own thresholds, no forced lengths) with smart turn detection (voiced.core.turns; the end-of-turn model
pulled as `voiced serve` finds it): the words decide where turns end, so v2v_real_end_ms is voice-to-voice
from the caller's real end of speech with the detector's wait in it. Give it real
speech with pauses as --wav (Spark stays random, as above). `--turn-detection silence` runs the same
Whisper with turns ended on silence: the A/B of what the detector costs the engines.

Every level also records what went wrong (failed_callers, notices, unanswered: utterances with words no
reply answered; turns_without_words: turns the daemon ended and dropped, their words a hallucination, which
are owed no reply) and, on a GPU, its own memory peak (gpu_memory). Replies are paired with the turn they
answer by its id (gRPC). A caller sweep (`--sessions 1 2 4 8 16 24
32 48 64`) runs every level on the same warm daemon; after them, the run reports where it saturates
(`saturation`: the largest caller count whose voice-to-voice p99 as heard stays under
`--saturation-ms`, voiced.bench.saturation), and `--refine N` measures up to N more levels that halve
the bracket between the last passing and the first failing count. `voiced bench plot` draws it.

    voiced bench e2e --wav speech.wav --sessions 1 4 16 --out e2e.json
    voiced bench e2e --wav speech.wav --front grpc audiosocket media_ws --out doors.json
    voiced bench e2e --wav speech.wav --sessions 1 2 4 8 16 24 32 48 64 --duration 10 \
        --refine 2 --out sweep.json
    voiced bench e2e --wav speech.wav --asr-model tiny.en-pypi --sessions 16 --out e2e-turns.json
    voiced bench e2e --wav speech.wav --tiny-cpu --asr-dims tiny-random --sessions 2 --duration 5    (a CPU dry run)
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
import threading
import time
from pathlib import Path

from voiced.bench.bench_daemon import (
    MEMORY,
    GcPauses,
    bench_spec,
    gpu_memory,
    runtime_report,
    serve,
    start_server,
    target_info,
    turn_detection,
)
from voiced.bench.report import emit
from voiced.bench.saturation import next_level, saturation
from voiced.bench.steps import pct

log = logging.getLogger("voiced.bench.e2e")
TARGET_KEYS = ("door_overhead_p50_ms_audiosocket_16", "door_overhead_p50_ms_media_ws_16")


# ----------------------------------------------------------------------------------- server side


class EngineProfile:
    """A torch.profiler capture of the engine thread for a few seconds of one level: where each engine
    step's time goes (host ops, GPU kernels, synchronisations), per engine method (record_function
    ranges around the StepTimer's parts). Started and stopped on the engine thread itself, between
    steps, so it records exactly that thread's work."""

    def __init__(self, thread, seconds: float, out_dir: Path, label: str, trace: bool = False):
        self.thread, self.seconds, self.out_dir, self.label = thread, seconds, out_dir, label
        self.trace = trace  # also the timeline: every thread's ops and every stream's kernels (trace-LABEL.json.gz)
        self.prof = None

    def start_after(self, delay_s: float) -> threading.Timer:

        timer = threading.Timer(delay_s, self._run)
        timer.daemon = True
        timer.start()
        return timer

    def _run(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=activities, record_shapes=False)
        self.thread.call(self.prof.start)
        time.sleep(self.seconds)
        self.thread.call(self.prof.stop)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        averages = self.prof.key_averages()
        text = "\n\n".join(
            f"## sorted by {key} ({self.seconds:g} s of {self.label})\n" + averages.table(sort_by=key, row_limit=45)
            for key in ("cpu_time_total", "self_cpu_time_total", "self_cuda_time_total")
            if key != "self_cuda_time_total" or torch.cuda.is_available())
        (self.out_dir / f"profile-{self.label}.txt").write_text(text)
        if self.trace:
            self.prof.export_chrome_trace(str(self.out_dir / f"trace-{self.label}.json.gz"))  # (.gz: torch compresses)
        log.info("engine profile of %s written to %s", self.label, self.out_dir)


def e2e_targets(levels: dict) -> dict:
    """The end-to-end targets (voiced.bench.targets) against the levels this run measured (first audio chunk =
    reply text -> first chunk; voice-to-voice = end of speech -> first reply audio sent, and the same as the
    callers hear it)."""
    from voiced.bench.targets import E2E_LEVEL_TARGETS, judge

    return judge({key: levels.get(n, {}).get(figure, {}).get(q)
                  for key, (figure, q, n) in E2E_LEVEL_TARGETS.items()})


FRONTS = ("grpc", "audiosocket", "media_ws", "realtime", "wyoming")


def door_overhead(fronts: dict) -> dict:
    """Each door's voice-to-voice as its callers hear it, minus gRPC's at the same level (ms)."""
    base = fronts.get("grpc")
    if base is None:
        return {}
    out = {}
    for front, levels in fronts.items():
        if front == "grpc":
            continue
        out[front] = {}
        for n, level in levels.items():
            ours, theirs = level.get("v2v_client_ms", {}), base.get(n, {}).get("v2v_client_ms", {})
            if ours.get("n") and theirs.get("n"):
                out[front][n] = {q: round(ours[q] - theirs[q], 1) for q in ("p50", "p95")}
    return out


def door_targets(overhead: dict) -> dict:
    from voiced.bench.targets import judge

    return judge({f"door_overhead_p50_ms_{front}_16": levels.get(16, {}).get("p50")
                  for front, levels in overhead.items() if f"door_overhead_p50_ms_{front}_16" in TARGET_KEYS})


# ----------------------------------------------------------------------------------- caller side


async def one_caller(address: str, pcm: bytes, start_frame: int, duration_s: float, reply_s: float, seed: int,
                     out: dict) -> None:
    import grpc
    from voiced_client.proto import voiced_pb2 as pb
    from voiced_client.proto import voiced_pb2_grpc as pb_grpc

    frame = 640  # 20 ms of 16 kHz LINEAR16
    frames = [pcm[i : i + frame] for i in range(0, len(pcm) - frame + 1, frame)]
    fmt = pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=16000)
    cfg = pb.SessionConfig(input_format=fmt, output_format=fmt, barge_in=pb.BargeInConfig(enabled=False),
                           speech=pb.SpeechConfig(seed=seed, max_seconds=reply_s),
                           recognition=pb.RecognitionConfig(language="en"))
    from voiced.bench.phone_callers import EndOfSpeech, paced

    clock = EndOfSpeech()
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.VoicedStub(channel).Converse()
        await call.write(pb.SessionRequest(config=cfg))
        replies: dict[int, dict] = {}

        async def read():
            async for ev in call:
                kind = ev.WhichOneof("event")
                now = time.monotonic()
                if kind == "started" and ev.started.effective_config.segmentation.turn_detection == pb.TURN_DETECTION_SMART:
                    # The caller's own copy of the segmenter only knows silence: the daemon's SPEECH_ENDED
                    # says when a smart detector ended the turn (the real end stays the last sound sent).
                    clock.door_decides = True
                elif kind == "speech" and ev.speech.type == pb.SpeechActivity.SPEECH_ENDED:
                    clock.decided(now, ev.turn_id)  # (with silence detection: names the utterance its own clock found)
                elif kind == "transcript" and ev.transcript.is_final:
                    out["asr_ms"].append(ev.transcript.latency_ms)
                    if ev.transcript.text.strip():
                        clock.transcribed(ev.turn_id)
                elif kind == "agent_text" and ev.agent_text.latency_ms > 0:
                    out["agent_ms"].append(ev.agent_text.latency_ms)
                    replies[ev.turn_id] = {"agent_ms": ev.agent_text.latency_ms, "t_text": now, "bytes": 0}
                elif kind == "audio":
                    r = replies.setdefault(ev.turn_id, {"t_text": now, "bytes": 0})
                    r["bytes"] += len(ev.audio.audio)
                    r["t_last"] = now
                    if ev.audio.sequence == 0:
                        clock.reply_started(out, now, ev.turn_id)
                        out["first_audio_ms"].append(ev.audio.latency_ms)
                        if "agent_ms" in r:
                            out["tts_first_chunk_ms"].append(ev.audio.latency_ms - r["agent_ms"])
                    if ev.audio.last and r["bytes"]:
                        out["rtf"].append((r["t_last"] - r["t_text"]) / (r["bytes"] / 32000))
                elif kind == "notice":
                    out["notices"].append(f"{ev.notice.code}: {ev.notice.message[:120]}")

        async def send(frame: bytes) -> None:
            # The clock hears the frame as it goes out: fed after the write, it could hear the frame that ends
            # an utterance after the daemon's SPEECH_ENDED for it had arrived (a busy machine).
            clock.sent(frame, time.monotonic())
            await call.write(pb.SessionRequest(audio=frame))

        reader = asyncio.create_task(read())
        await paced(frames, start_frame, duration_s, send, out)
        await call.done_writing()
        clock.finished(time.monotonic())
        await reader
        out.setdefault("unanswered", []).append(clock.unanswered())  # utterances whose reply never came
        out.setdefault("turns_without_words", []).append(clock.without_words)


async def realtime_caller(address: str, pcm: bytes, start_frame: int, duration_s: float, reply_s: float, seed: int,
                          out: dict) -> None:
    """One caller speaking OpenAI's Realtime events over /v1/realtime (aiohttp's WebSocket client)."""
    import base64
    from collections import deque

    import aiohttp
    import numpy as np
    import soxr

    from voiced.bench.phone_callers import hold_line, paced

    x = soxr.resample(np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768, 16000, 24000)
    pcm24 = (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
    frame = 960  # 20 ms of 24 kHz audio/pcm
    frames = [pcm24[i : i + frame] for i in range(0, len(pcm24) - frame + 1, frame)]
    url = f"ws://{address}/v1/realtime?model=voiced"
    session = {"type": "realtime", "audio": {
        "input": {"format": {"type": "audio/pcm", "rate": 24000},
                  "turn_detection": {"type": "server_vad", "interrupt_response": False}},
        "output": {"format": {"type": "audio/pcm", "rate": 24000}}}}
    async with aiohttp.ClientSession() as http, http.ws_connect(url, protocols=("realtime",), max_msg_size=0) as ws:
        await ws.send_json({"type": "session.update", "session": session})
        async for msg in ws:
            if json.loads(msg.data)["type"] == "session.updated":
                break
        ended: dict[str, float] = {}  # user item -> when its speech_stopped arrived
        speaking = False  # the server heard speech start and not yet stop
        answered: deque[float] = deque()  # speech-ended times of heard turns, in the order replies come
        replies: dict[str, dict] = {}

        async def read():
            nonlocal speaking
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                ev = json.loads(msg.data)
                kind, now = ev["type"], time.monotonic()
                if kind == "input_audio_buffer.speech_started":
                    speaking = True
                elif kind == "input_audio_buffer.speech_stopped":
                    speaking = False
                    ended[ev["item_id"]] = now
                elif kind == "conversation.item.input_audio_transcription.completed":
                    t_end = ended.pop(ev["item_id"], None)
                    if t_end is not None:
                        out["asr_client_ms"].append((now - t_end) * 1000)
                        if ev["transcript"].strip():
                            answered.append(t_end)
                elif kind == "response.created":
                    replies[ev["response"]["id"]] = {"t_end": answered.popleft() if answered else None, "bytes": 0}
                elif kind == "response.output_audio_transcript.delta":
                    r = replies.get(ev["response_id"])
                    if r is not None and "t_text" not in r:
                        r["t_text"] = now
                elif kind == "response.output_audio.delta":
                    r = replies.get(ev["response_id"])
                    if r is None:
                        continue
                    if not r["bytes"] and r["t_end"] is not None:
                        out["v2v_client_ms"].append((now - r["t_end"]) * 1000)
                    r["bytes"] += len(ev["delta"]) * 3 // 4
                    r["t_last"] = now
                elif kind == "response.done":
                    r = replies.pop(ev["response"]["id"], None)
                    if r and r["bytes"] and "t_text" in r:
                        out["rtf"].append((r["t_last"] - r["t_text"]) / (r["bytes"] / 48000))
                elif kind == "error":
                    out["notices"].append(f"{ev['error']['code']}: {ev['error']['message'][:120]}")

        async def send(frame: bytes) -> None:  # (the same 20 ms grid as the 16 kHz WAV)
            await ws.send_str(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(frame).decode()}))

        reader = asyncio.create_task(read())
        await paced(frames, start_frame, duration_s, send, out)
        # Wait for the answer before hanging up (the server's VAD ends the turn in progress on the silence),
        # until the last reply has finished.
        await hold_line(bytes(len(frames[0])), send, lambda: bool(speaking or ended or answered or replies), out)
        out["unanswered"].append(len(ended) + len(answered))  # heard, never answered
        await ws.close()
        await reader


async def callers(address: str, wav: Path, sessions: int, duration_s: float, reply_s: float,
                  front: str = "grpc", hang_up: str = "after-utterance", first: int = 0, last: int | None = None) -> dict:
    """Callers `first` to `last` (default: all) of a level of `sessions`, each starting at its own point of the
    loop: their raw figures, for `level_report` to merge with the other caller processes' (`--caller-processes`)."""
    from voiced_client.wavio import float_to_int16

    from voiced.audio.wavfile import load_16k
    from voiced.bench.phone_callers import audiosocket_caller, media_ws_caller, talk_seconds

    pcm = float_to_int16(load_16k(wav)).astype("<i2").tobytes()  # any rate: the callers send 16 kHz
    n_frames = len(pcm) // 640
    out = {k: [] for k in ("asr_ms", "agent_ms", "first_audio_ms", "tts_first_chunk_ms", "rtf", "late_ms", "notices",
                           "v2v_client_ms", "v2v_real_end_ms", "asr_client_ms", "unmatched_replies", "unanswered",
                           "turns_without_words")}

    def caller(k: int):
        start = (n_frames * k) // sessions
        # (at-duration: every caller at once, mid-sentence: the old way)
        seconds = talk_seconds(pcm, start, duration_s) if hang_up == "after-utterance" else duration_s
        if front == "audiosocket":
            return audiosocket_caller(address, pcm, start, seconds, reply_s, out)
        if front == "media_ws":
            return media_ws_caller(address, pcm, start, seconds, out)
        if front == "realtime":
            return realtime_caller(address, pcm, start, seconds, reply_s, k, out)
        if front == "wyoming":
            from voiced.bench.wyoming_caller import wyoming_caller

            return wyoming_caller(address, pcm, start, seconds, out)
        return one_caller(address, pcm, start, seconds, reply_s, k, out)

    t0 = time.monotonic()
    # One caller's failure is that caller's, counted for its level; the others' figures still stand.
    ks = range(first, sessions if last is None else last)
    failed = [r for r in await asyncio.gather(*(caller(k) for k in ks), return_exceptions=True)
              if isinstance(r, BaseException)]
    return {"callers": len(ks), "samples": out, "failed": [f"{type(e).__name__}: {str(e)[:160]}" for e in failed],
            "wall_s": round(time.monotonic() - t0, 1)}


def level_report(parts: list[dict]) -> dict:
    """One level's figures from its caller processes' raw ones (`callers`)."""
    from collections import Counter

    out = {k: [x for part in parts for x in part["samples"][k]] for k in parts[0]["samples"]}
    counts = ("unanswered", "turns_without_words")
    report = {k: pct(v) for k, v in out.items() if k not in ("notices", "unmatched_replies", *counts) and v}
    report["callers"] = sum(part["callers"] for part in parts)
    report["caller_processes"] = len(parts)
    report["unmatched_replies"] = len(out["unmatched_replies"])
    report["unanswered"] = sum(out["unanswered"])
    # turns the daemon ended and dropped (their words a hallucination): no transcript, no reply owed
    report["turns_without_words"] = sum(out["turns_without_words"])
    report["failed_callers"] = dict(Counter(f for part in parts for f in part["failed"]))
    report["notices"] = dict(Counter(out["notices"]))
    report["wall_s"] = max(part["wall_s"] for part in parts)
    return report


def caller_processes(chosen: int, sessions: int) -> int:
    """How many processes a level's callers run in: `chosen`, or (0) one per CALLERS_PER_PROCESS. One Python
    process streaming 224 callers' 20 ms frames and reading their replies ran its frames 218 ms late at the
    median: the level then measured the callers, not the daemon."""
    return max(1, min(sessions, chosen or -(-sessions // CALLERS_PER_PROCESS)))


CALLERS_PER_PROCESS = 64


# ----------------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="voiced bench e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wav", type=Path, help="speech with pauses, a WAV file of any rate (resampled to 16 kHz; looped "
                    "by every caller); needed but with --serve")
    ap.add_argument("--target", metavar="HOST:PORT",
                    help="call a daemon already running there over gRPC (or a balancer in front of several) instead "
                         "of starting one: the same callers and figures, less the daemon's own (engine steps, loop "
                         "lag, GPU memory). Start each daemon with `voiced bench e2e --serve` and this run's engine "
                         "options, so that it serves the random weights with the lengths these callers expect")
    ap.add_argument("--serve", action="store_true",
                    help="run only the daemon, with this run's engines and forced lengths, at --listen (and --http) "
                         "until SIGTERM or Ctrl-C, then drain as `voiced serve` does: what --target calls")
    ap.add_argument("--listen", default="127.0.0.1:50051", help="with --serve: the gRPC address")
    ap.add_argument("--http", metavar="HOST:PORT", help="with --serve: the HTTP listener (a balancer's health check "
                    "reads its /readyz)")
    ap.add_argument("--tiktoken-dir", type=Path, default=None,
                    help="a folder holding multilingual.tiktoken to use before the copy voiced ships (random Whisper)")
    ap.add_argument("--asr-model", default=None,
                    help="a real Whisper model (name or folder, as `voiced serve --asr-model` takes) instead of random "
                         "weights; turns are then decided by the smart detector (the end-of-turn model must be pulled)")
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 4, 16],
                    help="concurrent callers of each level, in the order run (one daemon, one warm-up for all)")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds each level runs")
    ap.add_argument("--saturation-ms", type=float, default=500.0,
                    help="saturation: the largest caller count whose voice-to-voice p99 as heard stays under this")
    ap.add_argument("--refine", type=int, default=0, metavar="N",
                    help="after the levels, up to N more between the last passing and the first failing (bisection)")
    ap.add_argument("--turn-detection", choices=["smart", "silence"], default=None,
                    help="with --asr-model: how the daemon ends turns (default smart); an A/B of the two shows what "
                         "the smart detector's interim decodes cost the engines")
    ap.add_argument("--asr-dims", default="large-v3-turbo")
    ap.add_argument("--asr-tokens", type=int, default=24, help="forced transcript length (random weights)")
    ap.add_argument("--asr-batch", type=int, default=64)
    ap.add_argument("--tts-batch", type=int, default=64)
    ap.add_argument("--reply-seconds", type=float, default=2.0, help="forced reply length (random weights)")
    ap.add_argument("--first-chunk-tokens", type=int, default=10)
    ap.add_argument("--chunk-tokens", type=int, default=25)
    ap.add_argument("--out", type=Path, default=None,
                    help="the report as JSON, rewritten after every level (\"complete\": false until the sweep ends)")
    ap.add_argument("--engine-process", choices=["auto", "inline", "separate"], default="auto",
                    help="as the daemon's engines.process: the engines in the daemon's process or in one of their "
                         "own (auto, the default: separate on a GPU)")
    ap.add_argument("--engine-threads", choices=["auto", "shared", "separate"], default="auto",
                    help="as the daemon's engines.threads: one thread for both engines or one each (auto, the "
                         "default: separate on a GPU, shared with --tiny-cpu)")
    ap.add_argument("--hang-up", choices=["after-utterance", "at-duration"], default="after-utterance",
                    help="when each caller ends its call: after --duration, once its utterance in progress is over "
                         "(the default), or at --duration exactly, every caller mid-sentence at one instant (so the "
                         "daemon ends all their turns at once)")
    ap.add_argument("--engine-overlap", choices=["auto", "on", "off"], default="auto",
                    help="as the daemon's engines.overlap: one engine thread launches each engine's step before "
                         "waiting on any (on), or steps them one after the other (off); auto, the default: on "
                         "on a GPU")
    ap.add_argument("--profile-level", type=int, nargs="*", default=[], metavar="N",
                    help="capture a torch.profiler table of the engine thread in the middle of these levels "
                         "(profile-FRONT-N.txt beside --out)")
    ap.add_argument("--profile-seconds", type=float, default=3.0)
    ap.add_argument("--profile-trace", action="store_true",
                    help="with --profile-level: also write the profile's timeline (trace-FRONT-N.json.gz, Chrome/"
                         "Perfetto format; benchmarks/trace_summary.py in the repository reads it)")
    ap.add_argument("--tiny-cpu", action="store_true", help="dry run on the CPU with tiny random models")
    ap.add_argument("--front", nargs="+", default=["grpc"], choices=FRONTS,
                    help="the doors to call through, each in turn at every level (default grpc)")
    ap.add_argument("--caller-processes", type=int, default=0, metavar="N",
                    help=f"processes each level's callers run in (0, the default: one per {CALLERS_PER_PROCESS} callers)")
    ap.add_argument("--caller", default=None, help=argparse.SUPPRESS)  # internal: run the callers only
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.caller:
        front, address, sessions, first, last = args.caller.split("@")
        report = asyncio.run(callers(address, args.wav, int(sessions), args.duration, args.reply_seconds, front,
                                     args.hang_up, int(first), int(last)))
        print(json.dumps(report))
        return report
    if args.turn_detection and args.asr_model is None:
        ap.error("--turn-detection needs --asr-model: with random weights turns end on silence")
    if args.serve:
        return serve(args)
    if args.wav is None:
        ap.error("--wav is needed: the speech every caller loops")
    if args.target and (args.front != ["grpc"] or args.profile_level):
        ap.error("--target calls over gRPC only, and profiles nothing (the daemon runs elsewhere)")
    from voiced.audio.wavfile import WavError, load_16k
    try:  # here, not after a GPU daemon's minutes of start-up
        load_16k(args.wav)
    except (OSError, WavError) as e:
        ap.error(f"--wav {args.wav}: {e}")

    import gc

    import torch

    if args.target:  # a daemon (or a balancer) already running: the callers' figures only
        server, addresses = None, {"grpc": args.target}
        about = {"gpu": None, **target_info(args.target)}
    else:
        spec = bench_spec(args)  # (resolved again by start_server: the same config gives the same runtime)
        if spec.runtime.process != "inline" and args.profile_level:
            ap.error("--profile-level profiles the engine thread in this process: not with the engines in their "
                     "own (add --engine-process inline)")
        t_start = time.monotonic()
        server = start_server(args)
        addresses = server.addresses
        about = {"gpu": "cpu (dry run)" if args.tiny_cpu else torch.cuda.get_device_name(),
                 **runtime_report(server.spec), "startup_s": round(time.monotonic() - t_start, 1)}
        log.info("daemon up after %.1f s (engines loaded and warmed up)", about["startup_s"])
    gc_pauses = GcPauses()
    gc.callbacks.append(gc_pauses)
    result = {"bench": "e2e", **about, "torch": torch.__version__,
              "python": platform.python_version(), "asr_dims": args.asr_dims, "asr_tokens": args.asr_tokens,
              "asr_model": args.asr_model or "random", "turn_detection": turn_detection(args),
              "reply_seconds": args.reply_seconds, "first_chunk_tokens": args.first_chunk_tokens,
              "hang_up": args.hang_up, "duration_s": args.duration,
              "date": time.strftime("%Y-%m-%d"), "fronts": {}, "saturation": {}}
    serving_peak = 0.0

    def measure(front: str, n: int) -> dict:
        nonlocal serving_peak
        gc_pauses.take()
        if server is not None:
            server.start_level()
        cmd = [sys.executable, "-m", "voiced.bench.e2e_bench", "--wav", str(args.wav), "--duration", str(args.duration),
               "--reply-seconds", str(args.reply_seconds), "--hang-up", args.hang_up]
        timer = None
        if n in args.profile_level:
            profile = EngineProfile(server.services.asr.thread, args.profile_seconds,
                                    (args.out or Path("e2e.json")).parent, f"{front}-{n}", trace=args.profile_trace)
            timer = profile.start_after(args.duration / 2 - args.profile_seconds / 2)
        k = caller_processes(args.caller_processes, n)
        # process i runs callers n*i//k .. n*(i+1)//k of the level's n
        spec = f"{front}@{addresses[front]}@{n}"
        procs = [subprocess.Popen([*cmd, "--caller", f"{spec}@{n * i // k}@{n * (i + 1) // k}"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=os.environ) for i in range(k)]
        outputs = [(p, *p.communicate()) for p in procs]
        if timer is not None:
            timer.join()
        broken = [err for p, _, err in outputs if p.returncode != 0]
        if broken:
            return {"error": broken[0][-2000:]}
        level = level_report([json.loads(stdout.strip().splitlines()[-1]) for _, stdout, _ in outputs])
        if server is not None:
            level["gc"] = gc_pauses.take()  # the daemon's process (the callers run in their own)
            level.update(server.level_figures(f"{front}, {n} callers"))
            serving_peak = max(serving_peak, level.get("gpu_memory", {}).get("peak_gib", 0.0))
        log.info("%s, %d sessions: %s", front, n, json.dumps(level))
        return level

    def save_so_far() -> None:
        """The report as far as it goes, marked incomplete, after every level: a sweep stopped from outside (a
        time limit on a lent machine) keeps the levels it measured. Written whole, then renamed over --out."""
        if args.out:
            partial = dict(result, complete=False, levels=result["fronts"][args.front[0]])
            tmp = Path(f"{args.out}.partial")
            tmp.write_text(json.dumps(partial, indent=2) + "\n")
            os.replace(tmp, args.out)

    for front in args.front:
        levels = result["fronts"][front] = {}
        for i, n in enumerate(args.sessions):
            log.info("%s: level %d of %d, %d callers for %g s", front, i + 1, len(args.sessions), n, args.duration)
            levels[n] = measure(front, n)
            save_so_far()
        # Narrow the saturation bracket with a few more levels on the same warm daemon.
        for _ in range(args.refine):
            n = next_level(levels, args.saturation_ms)
            if n is None:
                break
            log.info("%s: refining saturation at %d callers", front, n)
            levels[n] = measure(front, n)
            save_so_far()
        result["fronts"][front] = levels = dict(sorted(levels.items()))
        sat = result["saturation"][front] = saturation(levels, args.saturation_ms)
        log.info("%s: voice-to-voice p99 under %g ms up to %d callers%s", front, args.saturation_ms, sat["capacity"],
                 f" (first over at {sat['first_over']})" if sat["saturated"] else " (every level measured)")
    result["levels"] = result["fronts"][args.front[0]]  # one door's levels where they always were
    result["door_overhead_ms"] = door_overhead(result["fronts"])
    if server is not None:
        server.stop()
    if not args.tiny_cpu:
        if server is not None and server.spec.runtime.process == "inline":  # (else the engines' memory went with their process: the levels have it)
            gpu_memory("serving")
            MEMORY["serving"]["peak_gib"] = max(MEMORY["serving"]["peak_gib"], serving_peak)  # levels reset the peak
            result["gpu_memory"] = MEMORY
        result["targets"] = e2e_targets(result["fronts"].get("grpc", result["levels"]))
        result["targets"].update(door_targets(result["door_overhead_ms"]))
    result["complete"] = True
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
