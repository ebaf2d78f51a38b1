"""Smart Turn v3 alone, run as Pipecat runs it: the reference `voiced bench turns` measures ours against.

Pipecat's default turn taking (pipecat-ai 0.0.102 and later; `BaseSmartTurn` in
pipecat/audio/turn/smart_turn/base_smart_turn.py):

1. A VAD marks speech; it stops after `VAD_STOP_S` (0.2 s) without speech.
2. At the stop, Smart Turn reads the turn so far: from `PRE_SPEECH_S` (0.5 s) before the turn's first
   speech to now (the trailing silence included), its last 8 s.
3. "Complete" (probability > 0.5) ends the turn as soon as the model has answered. "Incomplete" keeps
   the turn open: more speech continues it (the next stop asks the model again, over the whole turn),
   and `FALLBACK_S` (3 s) of silence after the stop ends it anyway.

Here the VAD is the daemon's segmenter (webrtcvad with its loudness gate and keypad-tone filter) with a
0.2 s hangover and Pipecat's 0.2 s start, not Silero; the run is offline over the caller's WAV, frame by
frame, and each decision is dated at the end of the 20 ms frame that triggered it plus the model's
inference time measured here, on this machine's CPU (the clock `voiced.bench.turn_bench` times the
daemon's detectors with). The inference time is the CPU time this process spent on it (features and
model), not the wall clock: on a shared machine other programs' load would otherwise be counted as the
model's (the wall time is reported beside it). On a machine of its own the wall time is no longer: the
feature extraction's threads make it shorter.
"""

from __future__ import annotations

import time

import numpy as np

from voiced.audio.ingest import FRAME_SAMPLES, RATE

VAD_STOP_S = 0.2
VAD_START_S = 0.2
PRE_SPEECH_S = 0.5
FALLBACK_S = 3.0
THRESHOLD = 0.5


def run_reference(model, audio: np.ndarray) -> tuple[list[float], list[float], list[float]]:
    """Turn ends (caller's audio time, seconds) for one caller's float32 16 kHz audio, and the model's
    inference time of each call: CPU ms (what the decisions are dated with) and wall-clock ms.
    `model.predict(clips) -> [probability complete]`."""
    from voiced.core.segmenter import Segmenter, SegmenterConfig, SpeechEnded, SpeechStarted

    seg = Segmenter(SegmenterConfig(hangover_ms=int(VAD_STOP_S * 1000), min_speech_ms=int(VAD_START_S * 1000),
                                    keep_audio=False))
    pcm = np.clip(audio * 32768, -32768, 32767).astype(np.int16)
    ends: list[float] = []
    inference: list[float] = []
    wall: list[float] = []
    turn_start: int | None = None  # sample where the open turn's audio starts
    fallback_at: float | None = None  # audio time at which the open turn ends for lack of speech
    n_frames = len(pcm) // FRAME_SAMPLES
    for n in range(n_frames):
        now = (n + 1) * FRAME_SAMPLES / RATE  # the frame is complete
        if fallback_at is not None and now >= fallback_at:
            ends.append(fallback_at)
            turn_start = fallback_at = None
        for ev in seg.push(pcm[n * FRAME_SAMPLES: (n + 1) * FRAME_SAMPLES]):
            if isinstance(ev, SpeechStarted):
                fallback_at = None  # more speech: the turn goes on
                if turn_start is None:
                    turn_start = max(0, ev.offset - int(PRE_SPEECH_S * RATE))
            elif isinstance(ev, SpeechEnded) and turn_start is not None:
                clip = audio[turn_start: (n + 1) * FRAME_SAMPLES]
                t0, c0 = time.perf_counter(), time.process_time()
                p = model.predict([clip])[0]
                ms = (time.process_time() - c0) * 1000
                inference.append(ms)
                wall.append((time.perf_counter() - t0) * 1000)
                if p > THRESHOLD:
                    ends.append(now + ms / 1000)
                    turn_start = fallback_at = None
                else:
                    fallback_at = now + FALLBACK_S
    if turn_start is not None:  # the caller hangs up: the turn ends with the call
        ends.append(n_frames * FRAME_SAMPLES / RATE)
    return ends, inference, wall
