"""Which backend runs a model: TensorRT-LLM engines or our PyTorch engines.

``choose_backend("auto", kind, engine_dir)`` picks TensorRT-LLM where the ``tensorrt_llm`` package is
importable *and* a complete engine for that model exists, else PyTorch. Asking for ``"trtllm"``
explicitly when either is missing is an error that says how to fix it. Nothing here imports
tensorrt_llm (that takes seconds and initialises CUDA); we only ask whether it could be imported.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from voiced.engines.trtllm import versions
from voiced.engines.trtllm.build import engine_files_present
from voiced.engines.trtllm.manifest import MANIFEST, Manifest

log = logging.getLogger(__name__)

BACKENDS = ("auto", "trtllm", "torch")
KINDS = ("whisper", "spark-tts")


class BackendError(RuntimeError):
    """The requested backend cannot run here; the message says what to do instead."""


def build_command(kind: str, model: str | None = None) -> str:
    """The command that builds the engine `choose_backend` looked for."""
    if kind == "whisper":
        return f"voiced engines build whisper --model {model or 'large-v3'}"
    return "voiced engines build spark-tts" + (f" --model {model}" if model else "")


def engine_status(kind: str, engine_dir: str | os.PathLike | None) -> tuple[bool, str]:
    """(ready?, reason) for the engine folder of one model."""
    if engine_dir is None:
        return False, "no engine directory is configured"
    d = Path(engine_dir)
    if not d.is_dir():
        return False, f"{d} does not exist"
    manifest = Manifest.read(d)
    if manifest is None:
        return False, f"{d} has no {MANIFEST} (the engine was never built, or its build did not finish)"
    if manifest.kind != kind:
        return False, f"{d} holds a {manifest.kind} engine, not {kind}"
    if not engine_files_present(kind, d):
        return False, f"{d} is missing engine files (config.json / *.engine)"
    installed = versions.installed_version()
    if installed is not None and manifest.trtllm_version != installed:
        # TensorRT engines only load in the TensorRT(-LLM) version that built them.
        return False, (
            f"{d} was built with TensorRT-LLM {manifest.trtllm_version} but {installed} is installed; "
            "engines must be rebuilt for the installed version"
        )
    return True, f"{d} ({manifest.model}, TensorRT-LLM {manifest.trtllm_version})"


def choose_backend(requested: str, kind: str, engine_dir: str | os.PathLike | None) -> str:
    """Return "trtllm" or "torch" for `kind` ("whisper" | "spark-tts").

    requested: "auto" | "trtllm" | "torch". engine_dir: the model's engine folder
    (engines/<name>/, holding manifest.json). Raises BackendError when "trtllm" is requested but
    cannot run.
    """
    if requested not in BACKENDS:
        raise BackendError(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    if kind not in KINDS:
        raise BackendError(f"unknown model kind {kind!r}; expected one of {', '.join(KINDS)}")
    if requested == "torch":
        return "torch"
    have_trtllm = versions.is_installed()
    ready, reason = engine_status(kind, engine_dir)
    model = _model_hint(engine_dir)
    if requested == "trtllm":
        if not have_trtllm:
            raise BackendError(versions.missing_message(f"--backend trtllm for {kind}"))
        if not ready:
            raise BackendError(
                f"--backend trtllm for {kind}: no usable engine: {reason}. Build it with "
                f"`{build_command(kind, model)}` (or point the config at an engine folder), "
                "or use --backend torch."
            )
        return "trtllm"
    # auto
    if have_trtllm and ready:
        log.info("%s: using TensorRT-LLM engine %s", kind, reason)
        return "trtllm"
    if have_trtllm:
        log.info("%s: tensorrt_llm is installed but %s; using PyTorch (build with `%s`)",
                 kind, reason, build_command(kind, model))
    return "torch"


def _model_hint(engine_dir: str | os.PathLike | None) -> str | None:
    """Guess the model name from a folder like engines/whisper-large-v3 for the build hint."""
    if engine_dir is None:
        return None
    m = Manifest.read(Path(engine_dir)) if Path(engine_dir).is_dir() else None
    if m is not None:
        return m.model
    name = Path(engine_dir).name
    return name[len("whisper-"):] if name.startswith("whisper-") else None
