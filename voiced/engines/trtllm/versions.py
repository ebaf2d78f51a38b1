"""Which TensorRT-LLM releases each of our paths supports, and how we tell at run time.

Two ways to run Whisper / Spark-TTS on TensorRT-LLM exist across releases:

1. The **engine path** (what the seeds' recipes use): ``convert_checkpoint.py`` + ``trtllm-build``
   produce TensorRT engines; the C++ executor (``tensorrt_llm.bindings.executor.Executor``, created by
   ``tensorrt_llm.runtime.ModelRunnerCpp.from_dir``) runs them with in-flight batching and a paged KV
   cache. Whisper runs on it since 0.13 ("Supported OpenAI Whisper in C++ runtime", 0.13.0 release
   notes). We target **0.17.0 - 1.2.x** (seed 004 built its engine with 0.17.0.post1; our calls were
   matched against the sources listed in docs/TRTLLM.md, and the Dockerfile pins 1.0.0) (the example
   scripts moved from ``examples/whisper`` and ``examples/qwen`` to ``examples/models/core/...`` in
   0.18; build.py looks in both places).

2. The **LLM API path** (PyTorch backend): ``tensorrt_llm.LLM(model=<HF checkpoint dir>)`` with
   ``generate_async(...)``. The newest development line removed the TensorRT engine backend
   ("Migration Guide: TensorRT Backend Removed", docs/source/legacy/tensorrt-backend-removal.md) and
   added a PyTorch-flow Whisper (``tensorrt_llm/_torch/models/modeling_whisper.py``: audio arrives as
   ``multi_modal_data["audio"] = (waveform, 16000)``, the decoder prompt as the text prompt;
   ``generate_async`` returns a per-request result with ``abort()``). voiced does **not** run this
   path yet: ``detect()`` reports it and the loaders refuse such a release with a clear message.
   Adding it means an adapter that presents ``LLM.generate_async`` results through the executor
   interface of executor.py (enqueue / await / cancel), so the routing loop stays the same.

Capability, not version numbers, decides at run time (``detect()``), because release candidates
and vendor containers carry odd version strings; the numbers above are what we say to people.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass

# The releases whose sources we matched our calls against (docs/TRTLLM.md lists the files).
ENGINE_PATH_RELEASES = "0.17.0 - 1.2.x"
LLMAPI_WHISPER_RELEASES = "1.3 development line (main after the TensorRT backend removal); not used yet"
# The container our Dockerfile pins; its TensorRT-LLM has both the engine path and trtllm-build.
CONTAINER_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.0.0"

DIST_NAMES = ("tensorrt_llm", "tensorrt-llm", "tensorrt_llm_cu12")


@dataclass(frozen=True)
class TRTLLMInfo:
    installed: bool
    version: str | None
    engine_path: bool  # tensorrt_llm.runtime.ModelRunnerCpp + bindings.executor present
    llmapi_whisper: bool  # tensorrt_llm._torch.models.modeling_whisper present


def installed_version() -> str | None:
    """The installed TensorRT-LLM version from package metadata, without importing it.

    Importing tensorrt_llm takes seconds and initialises CUDA and MPI; metadata is enough to name
    the version in a manifest or an error message.
    """
    for name in DIST_NAMES:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_installed() -> bool:
    return importlib.util.find_spec("tensorrt_llm") is not None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def detect() -> TRTLLMInfo:
    """What the installed TensorRT-LLM can do, found without importing its heavy top module.

    find_spec on a submodule imports the parent package, so this is only called where we are about
    to use TensorRT-LLM anyway (runner loading, `voiced doctor`); `choose_backend` uses
    `is_installed()` alone.
    """
    if not is_installed():
        return TRTLLMInfo(False, None, False, False)
    version = installed_version()
    engine = _has_module("tensorrt_llm.runtime.model_runner_cpp") and _has_module("tensorrt_llm.bindings")
    whisper_llmapi = _has_module("tensorrt_llm._torch.models.modeling_whisper")
    return TRTLLMInfo(True, version, engine, whisper_llmapi)


def missing_message(what: str = "the TensorRT-LLM backend") -> str:
    return (
        f"{what} needs the `tensorrt_llm` package, which is not installed in this Python "
        f"({_python()}). It only installs on NVIDIA's TensorRT-LLM container or a matching CUDA setup: "
        f"run the daemon from the image built by our Dockerfile (FROM {CONTAINER_IMAGE}; "
        "`docker compose up`), or `pip install 'voiced[trtllm]'` on such a machine. "
        "Or use `--backend torch`."
    )


def _python() -> str:
    import sys

    return sys.executable
