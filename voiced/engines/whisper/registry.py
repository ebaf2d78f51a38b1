"""Official Whisper model names, where they download from, and where they live in the cache.

Kept free of torch imports: `voiced models list/pull` use it without loading a framework.
OpenAI's download URLs carry each file's sha256 in their path; pulls are verified against it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from voiced.hub import ModelNotFoundError, cache_dir, download

from .tokenizer import TIKTOKEN_FILES

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
    return [*_OPENAI, *_ALIASES, *_HF]


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
    """Download an official model and its tokenizer file into the cache (skipping what is there)."""
    model = official_model(name, root)
    if model is None:
        raise ModelNotFoundError(f"unknown Whisper model {name!r}; known: {', '.join(official_names())}")
    base = whisper_cache(root)
    tiktoken_name = "multilingual.tiktoken" if model.multilingual else "gpt2.tiktoken"
    url, sha = TIKTOKEN_FILES[tiktoken_name]
    files = [*model.files, RemoteFile(url, tiktoken_name, sha)]
    out = []
    for f in files:
        out.append(download(f.url, base / f.filename, f.sha256, desc=f"{model.name}: {Path(f.filename).name}"))
    return out


def cached(root: Path | None = None) -> list[tuple[str, Path]]:
    """Official models whose files are all in the cache."""
    out = []
    for name in [*_OPENAI, *_HF]:
        model = official_model(name, root)
        if model and all((whisper_cache(root) / f.filename).is_file() for f in model.files):
            out.append((name, model.path))
    return out
