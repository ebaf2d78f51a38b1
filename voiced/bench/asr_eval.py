"""Accuracy and speed of speech recognition on a folder of recordings, ours next to the references.

`voiced eval DIR` (voiced/cli/eval.py) runs this. A set is a folder of audio files with same-name
`.txt` references, or a `manifest.jsonl` (one `{"audio": PATH, "text": REFERENCE}` a line, paths
relative to the manifest), which wins when both are there.

Every system decodes every utterance the same way: greedy (or the same beam), no timestamps, no
prompt or previous text, no voice-activity filter, one temperature (no fallback), the language
given. Utterances are taken one at a time, as a live caller's would be, and the systems take turns
on each utterance (ours, faster-whisper, openai-whisper, ours, ...) so that a machine shared with
other work slows them alike; with `repeats` > 1 each utterance's latency is the median of its runs.

Figures per system: WER and CER (jiwer) after text normalisation, real-time factor (decoding
time / audio time) and per-utterance latency percentiles (p50, p90: audio in memory -> text).
Normaliser: openai-whisper's EnglishTextNormalizer (English) or BasicTextNormalizer (other
languages) when openai-whisper is installed, the ones Whisper's published WERs use; otherwise
`simple_normalize` (lower case, punctuation removed, spaces collapsed), and the report says which.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import statistics
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from voiced.bench.report import cpu_model

log = logging.getLogger(__name__)

AUDIO_EXTENSIONS = (".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".webm")
WINDOW = 30 * 16000


class EvalError(ValueError):
    """A set or an option that cannot be evaluated; the message says what to fix."""


# ----------------------------------------------------------------------------------- the set
@dataclass
class Utterance:
    name: str
    audio: np.ndarray  # 16 kHz mono float32
    text: str

    @property
    def seconds(self) -> float:
        return len(self.audio) / 16000


def load_audio(path: Path) -> np.ndarray:
    """16 kHz mono float32 from a WAV (any rate, PCM / float / G.711), or other formats through PyAV."""
    if path.suffix.lower() == ".wav":
        from voiced.audio.wavfile import load_16k

        return load_16k(path)
    try:
        import av
    except ImportError:
        raise EvalError(f"{path}: reading {path.suffix} files needs PyAV (pip install av); or convert to WAV") from None
    from voiced.audio.wavfile import to_16k

    with av.open(str(path)) as container:
        stream = container.streams.audio[0]
        resampler = av.AudioResampler(format="flt", layout="mono", rate=16000)
        parts = [frame.to_ndarray().reshape(-1) for packet in container.demux(stream) for f in packet.decode()
                 for frame in resampler.resample(f)]
        parts += [frame.to_ndarray().reshape(-1) for frame in resampler.resample(None)]
    return to_16k(np.concatenate(parts) if parts else np.zeros(0, np.float32), 16000)


def load_set(path: str | Path, limit: int | None = None) -> list[Utterance]:
    """A folder (audio + same-name .txt, or a manifest.jsonl in it) or a .jsonl manifest file."""
    path = Path(path)
    if not path.exists():
        raise EvalError(f"{path} does not exist; make a set with `voiced eval make-set {path}`")
    manifest = path if path.is_file() else path / "manifest.jsonl"
    pairs: list[tuple[str, Path, str]] = []
    if manifest.is_file():
        for i, line in enumerate(manifest.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                audio, text = rec["audio"], rec["text"]
            except (ValueError, KeyError, TypeError):
                raise EvalError(f"{manifest}:{i}: expected a JSON object with \"audio\" and \"text\"") from None
            p = Path(audio) if Path(audio).is_absolute() else manifest.parent / audio
            pairs.append((Path(audio).stem, p, str(text)))
    elif path.is_dir():
        for p in sorted(path.iterdir()):
            if p.suffix.lower() in AUDIO_EXTENSIONS:
                ref = p.with_suffix(".txt")
                if not ref.is_file():
                    raise EvalError(f"{p} has no reference text: write it to {ref.name} next to it")
                pairs.append((p.stem, p, ref.read_text().strip()))
    else:
        raise EvalError(f"{path} is neither a folder nor a .jsonl manifest")
    if not pairs:
        raise EvalError(f"{path} holds no audio files ({', '.join(AUDIO_EXTENSIONS)}) and no manifest.jsonl")
    out = []
    for name, p, text in pairs[:limit]:
        if not p.is_file():
            raise EvalError(f"{p} (listed in {manifest}) does not exist")
        out.append(Utterance(name, load_audio(p), text))
    return out


# --------------------------------------------------------------------------------- normalising
def simple_normalize(text: str) -> str:
    """Lower case, punctuation and symbols to spaces (apostrophes inside words kept), spaces collapsed."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(c if c.isalnum() or c in " '" else " " for c in text)
    text = re.sub(r"(?<!\w)'|'(?!\w)", " ", text)
    return " ".join(text.split())


def normalizer(language: str | None) -> tuple[Callable[[str], str], str]:
    """(normalise, its name): Whisper's when openai-whisper is installed, else `simple_normalize`."""
    english = (language or "en") == "en"
    try:
        from whisper.normalizers import BasicTextNormalizer, EnglishTextNormalizer
    except ImportError:
        return simple_normalize, "simple (lower case, no punctuation; openai-whisper is not installed)"
    if english:
        return EnglishTextNormalizer(), "openai-whisper EnglishTextNormalizer"
    return BasicTextNormalizer(), "openai-whisper BasicTextNormalizer"


# ----------------------------------------------------------------------------------- systems
@dataclass
class DecodeSettings:
    language: str | None
    beam_size: int = 1
    threads: int = 1


class System:
    """One recogniser: `name`, and `transcribe(audio) -> text` (16 kHz float32, any length)."""

    name: str

    def transcribe(self, audio: np.ndarray) -> str:  # pragma: no cover - interface
        raise NotImplementedError


class Voiced(System):
    def __init__(self, model: str, dtype: str, device: str, s: DecodeSettings, **engine_kw):
        from voiced.engines.base import ASROptions
        from voiced.engines.whisper.engine import WhisperEngine

        self.engine = WhisperEngine.load(model, device=device, dtype=dtype, max_batch=max(1, s.beam_size), **engine_kw)
        self.options = ASROptions(language=s.language, beam_size=s.beam_size)
        self.name = f"voiced {dtype}" + ("" if engine_kw.get("window", "full") == "full" else f" {engine_kw['window']} window")

    def transcribe(self, audio: np.ndarray) -> str:
        from voiced.engines.base import ASRRequest

        windows = [audio[i:i + WINDOW] for i in range(0, max(len(audio), 1), WINDOW)]
        return " ".join(t for t in (self.engine.transcribe(ASRRequest(w, self.options)).text for w in windows) if t)


class FasterWhisper(System):
    def __init__(self, model_dir: str, compute_type: str, s: DecodeSettings):
        from faster_whisper import WhisperModel

        logging.getLogger("faster_whisper").setLevel(logging.WARNING)  # a line per call otherwise
        self.model = WhisperModel(model_dir, device="cpu", compute_type=compute_type, cpu_threads=s.threads)
        self.kw = dict(language=s.language, beam_size=s.beam_size, temperature=[0.0], without_timestamps=True,
                       condition_on_previous_text=False, vad_filter=False)
        self.name = f"faster-whisper {compute_type}"

    def transcribe(self, audio: np.ndarray) -> str:
        segments, _ = self.model.transcribe(audio, **self.kw)
        return " ".join(seg.text.strip() for seg in segments).strip()


class OpenAIWhisper(System):
    """openai-whisper's model class and `transcribe`, on the same weights as ours (read by our
    checkpoint reader, so any format we open)."""

    def __init__(self, model: str, s: DecodeSettings):
        import whisper
        import whisper.model as wm

        from voiced.engines.whisper.checkpoint import read_checkpoint
        from voiced.engines.whisper.registry import resolve

        ckpt = read_checkpoint(resolve(model))
        self.model = wm.Whisper(wm.ModelDimensions(**ckpt.dims.as_dict()))
        self.model.load_state_dict({k: v.float() for k, v in ckpt.state.items()}, strict=False)
        self.model.eval()
        self._whisper = whisper
        self.kw = dict(language=s.language, beam_size=s.beam_size if s.beam_size > 1 else None, temperature=0.0,
                       without_timestamps=True, condition_on_previous_text=False, fp16=False, verbose=None)
        self.name = "openai-whisper float32"

    def transcribe(self, audio: np.ndarray) -> str:
        return self._whisper.transcribe(self.model, audio, **self.kw)["text"].strip()


def installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


# ----------------------------------------------------------------------------------- running
@dataclass
class SystemResult:
    name: str
    hypotheses: list[str] = field(default_factory=list)
    latencies: list[list[float]] = field(default_factory=list)  # per utterance, per repeat (s)

    def utterance_ms(self) -> list[float]:
        """Each utterance's latency (the median of its timed runs), in milliseconds."""
        return [statistics.median(x) * 1000 for x in self.latencies]

    def figures(self, utts: list[Utterance], normalize: Callable[[str], str]) -> dict:
        import jiwer

        refs = [normalize(u.text) for u in utts]
        hyps = [normalize(h) for h in self.hypotheses]
        keep = [i for i, r in enumerate(refs) if r.strip()]  # jiwer takes no empty reference
        r, h = [refs[i] for i in keep], [hyps[i] for i in keep]
        lat = [statistics.median(x) for x in self.latencies]
        audio_s = sum(u.seconds for u in utts)
        q = statistics.quantiles(lat, n=10, method="inclusive") if len(lat) > 1 else [lat[0]] * 9
        return {
            "system": self.name,
            "wer": jiwer.wer(r, h) if r else float("nan"),
            "cer": jiwer.cer(r, h) if r else float("nan"),
            "rtf": sum(lat) / audio_s if audio_s else float("nan"),
            "latency_p50_ms": statistics.median(lat) * 1000,
            "latency_p90_ms": q[8] * 1000,
            "latency_mean_ms": statistics.fmean(lat) * 1000,
            "utterances": len(utts),
            "scored": len(keep),
        }


def evaluate(utts: list[Utterance], systems: list[System], repeats: int = 1, progress: bool = True) -> list[SystemResult]:
    """Decode every utterance with every system, taking turns per utterance; `repeats` timed runs each
    (the text is the first run's). One untimed warm-up decode per system first."""
    from tqdm import tqdm

    results = [SystemResult(s.name) for s in systems]
    for s in systems:
        s.transcribe(utts[0].audio)
    bar = tqdm(total=len(utts) * len(systems) * repeats, desc="eval", unit="decode", disable=not progress)
    for res in results:
        res.latencies = [[] for _ in utts]
    for rep in range(repeats):
        for i, u in enumerate(utts):
            for s, res in zip(systems, results):
                t0 = time.perf_counter()
                text = s.transcribe(u.audio)
                res.latencies[i].append(time.perf_counter() - t0)
                if rep == 0:
                    res.hypotheses.append(text)
                bar.set_postfix_str(s.name, refresh=False)
                bar.update()
    bar.close()
    return results


def machine() -> dict:
    import torch

    cpu = cpu_model()
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "load_average_1m": load,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def table(rows: list[dict]) -> str:
    head = f"{'system':26s} {'WER':>7s} {'CER':>7s} {'RTF':>7s} {'p50 ms':>8s} {'p90 ms':>8s} {'utts':>5s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['system']:26s} {100 * r['wer']:6.2f}% {100 * r['cer']:6.2f}% {r['rtf']:7.3f} "
                     f"{r['latency_p50_ms']:8.0f} {r['latency_p90_ms']:8.0f} {r['utterances']:5d}")
    return "\n".join(lines)
