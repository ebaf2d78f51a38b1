"""Benchmark callers for the Wyoming door: Home Assistant's voice pipeline, with an echo agent.

For every spoken command, Home Assistant runs its own VAD over the satellite's audio and opens one
connection to transcribe (transcribe, audio-start, audio-chunk..., audio-stop -> transcript) and,
once its agent has answered, one to speak the answer (synthesize -> audio-start, audio-chunk...).
A caller here plays that part in real time with the `wyoming` package's client: it runs the
daemon's own segmenter (a gRPC session's default settings) over the 20 ms frames it streams, opens
a transcription when speech starts (sending the pre-roll first, as a session's utterance has it),
and sends audio-stop on the very frame on which the segmenter ends the utterance: the moment the
daemon itself detects the end of speech on gRPC. The transcript is the echo agent's answer.

- v2v_client_ms: audio-stop sent -> first reply audio received (voice-to-voice as the caller hears
  it; the same moment the other doors' callers start their clock, so the figures compare)
- asr_ms: audio-stop sent -> transcript received
- tts_first_chunk_ms: synthesize sent -> first audio chunk received
- rtf: synthesize sent -> last chunk, over the reply's audio duration
- unanswered: commands whose answer never sounded (no transcript, or no audio)

A satellite that is still in a command when its time is up finishes it with silence, as an open
microphone does, and waits for the answer: every door's callers are owed the same replies.

Against a running daemon (`voiced serve --wyoming tcp://127.0.0.1:10300`):

    python -m voiced.bench.wyoming_caller --address tcp://127.0.0.1:10300 --wav speech.wav --sessions 4
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import time
from pathlib import Path

FRAME_BYTES = 640  # 20 ms of 16 kHz 16-bit mono
FORMAT = {"rate": 16000, "width": 2, "channels": 1}


async def wyoming_caller(address: str, pcm: bytes, start_frame: int, duration_s: float, out: dict) -> None:
    """Stream `pcm` (16 kHz LINEAR16, looped from `start_frame`) for `duration_s` as one satellite."""
    import numpy as np
    from wyoming.asr import Transcribe, Transcript
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize

    from voiced.bench.phone_callers import hold_line, paced
    from voiced.config import Config
    from voiced.core.segmenter import Segmenter, SpeechStarted, Utterance
    from voiced.core.spec import segmentation_for
    from voiced.doors.shared import split_address

    host, port = split_address(address, scheme="tcp")
    seg_config = segmentation_for(Config())
    segmenter = Segmenter(seg_config)
    frames = [pcm[i : i + FRAME_BYTES] for i in range(0, len(pcm) - FRAME_BYTES + 1, FRAME_BYTES)]
    recent: collections.deque[bytes] = collections.deque(maxlen=max(1, seg_config.pre_roll_ms // 20) + 50)
    tasks: list[asyncio.Task] = []
    stt: AsyncTcpClient | None = None

    async def answer(c: AsyncTcpClient, stopped_at: float) -> None:
        """Transcript, then the spoken answer; an utterance whose answer never sounded counts unanswered."""
        if not await speak_answer(c, stopped_at):
            out["unanswered"].append(1)

    async def speak_answer(c: AsyncTcpClient, stopped_at: float) -> bool:
        try:
            while (event := await c.read_event()) is not None and not Transcript.is_type(event.type):
                pass
            if event is None:
                out["notices"].append("transcription: connection closed without a transcript")
                return False
            heard = time.monotonic()
            out["asr_ms"].append((heard - stopped_at) * 1000)
            text = Transcript.from_event(event).text.strip() or "I did not catch that."
        finally:
            await c.disconnect()
        async with AsyncTcpClient(host, port) as tts:
            asked = time.monotonic()
            await tts.write_event(Synthesize(text=text).event())
            first = None
            samples = 0
            while (event := await tts.read_event()) is not None:
                if AudioChunk.is_type(event.type):
                    if first is None:
                        first = time.monotonic()
                        out["tts_first_chunk_ms"].append((first - asked) * 1000)
                        out["v2v_client_ms"].append((first - stopped_at) * 1000)
                    samples += len(AudioChunk.from_event(event).audio) // 2
                elif AudioStop.is_type(event.type):
                    if samples:
                        out["rtf"].append((time.monotonic() - asked) / (samples / 16000))
                    break
                elif event.type == "error":
                    out["notices"].append(f"synthesize: {event.data.get('text', '')[:120]}")
                    break
            return first is not None

    async def send(frame: bytes) -> None:
        nonlocal stt
        recent.append(frame)
        events = segmenter.push(np.frombuffer(frame, dtype="<i2"))
        for ev in events:
            if isinstance(ev, SpeechStarted) and stt is None:
                stt = AsyncTcpClient(host, port)
                await stt.connect()
                await stt.write_event(Transcribe(language="en").event())
                await stt.write_event(AudioStart(**FORMAT).event())
                first = max(0, ev.offset // 320 - seg_config.pre_roll_ms // 20)  # what the utterance holds
                behind = segmenter.offset // 320 - first  # frames from there to this one (this one included)
                for past in list(recent)[-behind:-1]:
                    await stt.write_event(AudioChunk(**FORMAT, audio=past).event())
        if stt is not None:
            await stt.write_event(AudioChunk(**FORMAT, audio=frame).event())
            if any(isinstance(ev, Utterance) for ev in events):
                await stt.write_event(AudioStop().event())
                tasks.append(asyncio.create_task(answer(stt, time.monotonic())))
                stt = None

    await paced(frames, start_frame, duration_s, send, out)
    # A command still open (the segmenter has not ended it) is finished with the silence an open microphone
    # sends, as the other doors' callers hold their line: every utterance spoken is owed its answer.
    await hold_line(bytes(FRAME_BYTES), send, lambda: stt is not None, out)
    if stt is not None:
        await stt.disconnect()
        out["unanswered"].append(1)
    await asyncio.gather(*tasks)


async def callers(address: str, wav: Path, sessions: int, duration_s: float) -> dict:
    from collections import Counter

    from voiced_client.wavio import read_wav

    from voiced.bench.steps import pct

    samples, rate = read_wav(wav)
    if rate != 16000:
        raise SystemExit("the bench WAV must be 16 kHz")
    pcm = samples.astype("<i2").tobytes()
    n_frames = len(pcm) // FRAME_BYTES
    out = {k: [] for k in ("asr_ms", "tts_first_chunk_ms", "v2v_client_ms", "rtf", "late_ms", "notices", "unanswered")}
    t0 = time.monotonic()
    await asyncio.gather(*(wyoming_caller(address, pcm, (n_frames * k) // sessions, duration_s, out)
                           for k in range(sessions)))
    report = {k: pct(v) for k, v in out.items() if k not in ("notices", "unanswered")}
    report["notices"] = dict(Counter(out["notices"]))
    report["unanswered"] = sum(out["unanswered"])
    report["wall_s"] = round(time.monotonic() - t0, 1)
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", required=True, help="the Wyoming door, tcp://HOST:PORT")
    ap.add_argument("--wav", type=Path, required=True, help="16 kHz speech with pauses (looped by every caller)")
    ap.add_argument("--sessions", type=int, default=1, help="satellites speaking at once")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds each satellite streams")
    args = ap.parse_args(argv)
    report = asyncio.run(callers(args.address, args.wav, args.sessions, args.duration))
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
