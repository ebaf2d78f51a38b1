"""Smart Turn v3: an audio model of whether a caller has finished their turn.

Pipecat's end-of-turn model (BSD-2-Clause, Copyright (c) 2024-2026 Daily): a Whisper-tiny encoder with
a linear head, about 8 M parameters, exported to ONNX (`smart-turn-v3.2-cpu.onnx`, int8). It reads the
last 8 s of a turn and gives the probability that the turn is complete. How it is run, as Pipecat's
`LocalSmartTurnAnalyzerV3` runs it (pipecat-ai 1.14.0, pipecat/audio/turn/smart_turn/):

- 16 kHz mono float audio from the start of the turn (with a little audio before it) to now, the
  silence that ended it included;
- the last 8 s (128,000 samples) kept, or zeros put *in front* up to 8 s;
- the waveform normalised to zero mean and unit variance over those 8 s (Hugging Face's
  `WhisperFeatureExtractor(do_normalize=True)`), then Whisper's log-mel: 80 bands, 25 ms window,
  10 ms hop, 800 frames (`voiced.engines.whisper.audio.log_mel_spectrogram` computes exactly that);
- input `input_features` (batch, 80, 800); output (batch, 1), a sigmoid probability of "complete".

It runs with onnxruntime on the CPU: 8 M int8 parameters take ~10-60 ms per clip there, the
published file is that int8 export (its weights would have to be dequantised from the ONNX graph to
run through our own Whisper encoder, for no gain at one clip per pause), and a CPU-only server has
it too. `predict` takes a batch.

Where the weights come from (`voiced models pull NAME`, into `<cache>/smart-turn/NAME/`):
- `smart-turn-v3`: the Hugging Face repository `pipecat-ai/smart-turn-v3`, pinned to the commit that
  published v3.2, sha256-checked;
- `smart-turn-v3-pypi`: the same file from PyPI's `pipecat-ai` 1.14.0 wheel, fetched with pip (so
  machines that reach a package index but no model hub have it), the wheel and the model file both
  sha256-checked; only the model file is kept.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from voiced.hub import DownloadError, ModelNotFoundError, cache_dir, download, pip_download, sha256_file

log = logging.getLogger(__name__)

RATE = 16000
WINDOW_SAMPLES = 8 * RATE  # the model reads the last 8 s
ONNX_FILE = "smart-turn-v3.2-cpu.onnx"
ONNX_SHA256 = "2bb026316b14a660486a75b1733cd3fbab8c2fd0314dc9af7be49f8cca967e4f"  # 8,679,182 bytes
HF_REPO = "pipecat-ai/smart-turn-v3"
HF_COMMIT = "f766f81d3cfdf7737ac64aad813d91bbfd56bf93"  # "Smart Turn v3.2"
HF_URL = f"https://huggingface.co/{HF_REPO}/resolve/{HF_COMMIT}/{{path}}"
HUB_NAME = "smart-turn-v3"
PYPI_NAME = "smart-turn-v3-pypi"
PYPI_PACKAGE, PYPI_VERSION = "pipecat-ai", "1.14.0"
PYPI_WHEEL_SHA256 = "0352f504b44e78bdf524e45af4bc759601c835b9b7dc195efe5e03384b974a44"
PYPI_MEMBER = f"pipecat/audio/turn/smart_turn/data/{ONNX_FILE}"
ABOUT = {
    HUB_NAME: f"Smart Turn v3.2 end-of-turn model (BSD-2-Clause, Daily), Hugging Face {HF_REPO}@{HF_COMMIT[:7]}, "
              "sha256-checked",
    PYPI_NAME: f"Smart Turn v3.2 end-of-turn model (BSD-2-Clause, Daily), from PyPI's {PYPI_PACKAGE} "
               f"{PYPI_VERSION} wheel ({PYPI_MEMBER}), sha256-checked",
}


# ------------------------------------------------------------------------------------- the cache


def smart_turn_cache(root: Path | None = None) -> Path:
    """`<voiced cache>/smart-turn`, where `root` overrides the voiced cache directory."""
    return (Path(root) if root is not None else cache_dir()) / "smart-turn"


def names() -> list[str]:
    return [HUB_NAME, PYPI_NAME]


def model_path(name: str, root: Path | None = None) -> Path:
    """Where a pulled model's ONNX file lives (whether or not it is there)."""
    if name not in ABOUT:
        raise ModelNotFoundError(f"unknown end-of-turn model {name!r}; known: {', '.join(names())}")
    return smart_turn_cache(root) / name / ONNX_FILE


def resolve(name_or_path: str | Path, root: Path | None = None) -> Path:
    """An ONNX file that exists, or a model name whose file is in the cache."""
    p = Path(name_or_path).expanduser()
    if p.is_file():
        return p
    if str(name_or_path) not in ABOUT:
        raise ModelNotFoundError(f"{name_or_path!r} is neither an ONNX file nor a known end-of-turn model name "
                                 f"(known: {', '.join(names())})")
    path = model_path(str(name_or_path), root)
    if not path.is_file():
        raise ModelNotFoundError(f"the end-of-turn model {name_or_path!r} is not in the cache ({path} is missing); "
                                 f"run `voiced models pull {name_or_path}` first")
    return path


def find(root: Path | None = None) -> Path | None:
    """The first of the known models that is in the cache, or None."""
    for name in names():
        path = model_path(name, root)
        if path.is_file():
            return path
    return None


def cached(root: Path | None = None) -> list[tuple[str, Path]]:
    return [(name, model_path(name, root)) for name in names() if model_path(name, root).is_file()]


def missing(root: Path | None = None) -> list[str]:
    if cached(root):
        return []
    return [f"End-of-turn model: none yet (turn detection falls back to silence). `voiced serve` fetches "
            f"{HUB_NAME} on first run; `voiced models pull {HUB_NAME}` (Hugging Face) or `voiced models pull "
            f"{PYPI_NAME}` (PyPI) gets it."]


def describe(name: str) -> str:
    return ABOUT.get(name, "")


def pull(name: str, root: Path | None = None) -> list[Path]:
    """Download a model into the cache (a no-op when it is there); the files it consists of."""
    dest = model_path(name, root)
    if dest.is_file() and sha256_file(dest) == ONNX_SHA256:
        log.info("already have %s", dest)
        return [dest]
    if name == HUB_NAME:
        return [download(HF_URL.format(path=ONNX_FILE), dest, ONNX_SHA256, desc=f"{name}: {ONNX_FILE}")]
    return [_pull_wheel(dest)]


def _pull_wheel(dest: Path) -> Path:
    """The ONNX file out of pipecat-ai's wheel; the wheel itself is not kept."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull-") as tmp:
        wheel = pip_download(PYPI_PACKAGE, PYPI_VERSION, PYPI_WHEEL_SHA256, Path(tmp))
        part = Path(tmp) / ONNX_FILE
        with zipfile.ZipFile(wheel) as z, z.open(PYPI_MEMBER) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        got = sha256_file(part)
        if got != ONNX_SHA256:
            raise DownloadError(f"{PYPI_NAME}: {PYPI_MEMBER} in the wheel has sha256 {got}, expected {ONNX_SHA256}; "
                                "pull again")
        (dest.parent / "SOURCE.json").write_text(json.dumps({
            "name": PYPI_NAME, "about": ABOUT[PYPI_NAME], "package": PYPI_PACKAGE, "version": PYPI_VERSION,
            "wheel_sha256": PYPI_WHEEL_SHA256, "member": PYPI_MEMBER, "sha256": got}, indent=2) + "\n")
        shutil.move(part, dest)  # last: the file appears only when complete
    log.info("%s: %s", PYPI_NAME, dest)
    return dest


# ------------------------------------------------------------------------------------- inference


def features(clips: list[np.ndarray]) -> np.ndarray:
    """The model's input for a batch of clips: (batch, 80, 800) float32 (module docstring)."""
    from voiced.engines.whisper.audio import log_mel_spectrogram  # torch: the daemon's ASR has it loaded

    batch = np.zeros((len(clips), WINDOW_SAMPLES), dtype=np.float32)
    for row, clip in zip(batch, clips):
        tail = np.asarray(clip, dtype=np.float32)[-WINDOW_SAMPLES:]
        row[WINDOW_SAMPLES - len(tail):] = tail  # zeros in front, as Pipecat pads
    batch -= batch.mean(axis=1, keepdims=True)
    batch /= np.sqrt(batch.var(axis=1, keepdims=True) + 1e-7)
    return log_mel_spectrogram(batch, 80).numpy()


@dataclass
class SmartTurn:
    """A loaded Smart Turn model; `predict` is thread-safe (onnxruntime sessions are)."""

    session: object  # onnxruntime.InferenceSession
    path: Path

    def predict(self, clips: list[np.ndarray]) -> list[float]:
        """For each clip (float32, 16 kHz, the turn so far with its trailing silence): the probability
        that the speaker's turn is complete."""
        if not clips:
            return []
        out = self.session.run(None, {"input_features": features(clips)})[0]
        return [float(p) for p in np.asarray(out).reshape(len(clips))]


def load_smart_turn(path: str | Path, threads: int = 1) -> SmartTurn:
    """Load the ONNX model at `path` for the CPU. One thread by default: clips come one per pause,
    and the ASR shares the cores."""
    import onnxruntime as ort

    path = Path(path)
    if not path.is_file():
        raise ModelNotFoundError(f"no end-of-turn model at {path}")
    so = ort.SessionOptions()
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.inter_op_num_threads = 1
    so.intra_op_num_threads = threads
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(path), sess_options=so, providers=["CPUExecutionProvider"])
    names_in = [i.name for i in session.get_inputs()]
    if names_in != ["input_features"]:
        raise ValueError(f"{path} is not a Smart Turn v3 model (inputs {names_in}, expected input_features)")
    return SmartTurn(session, path)
