"""Third-party packages that come with a pip extra of `voiced`, and the error when one is missing.

`pip install voiced` brings the daemon's transport and audio plumbing; the engines need more
(torch, the Spark-TTS tokenizer, ...), which `pip install 'voiced[torch]'` (what `make run` does)
brings. Those imports happen where they are used, so `voiced --help` stays instant; when one fails,
`missing_extra` turns the bare ModuleNotFoundError into a message that names the extra to install
(the command line does it for every command; code that runs after start-up, such as registering a
voice, does it where it imports).
tests/test_dependencies.py checks this table against pyproject.toml and the imports in voiced/.
"""

from __future__ import annotations

# Top-level import name -> (distribution, the extra that brings it).
EXTRAS: dict[str, tuple[str, str]] = {
    "torch": ("torch", "torch"),
    "safetensors": ("safetensors", "torch"),
    "yaml": ("pyyaml", "torch"),
    "tokenizers": ("tokenizers", "torch"),
    "transformers": ("transformers", "torch"),
    "tensorrt_llm": ("tensorrt_llm", "trtllm"),
    "matplotlib": ("matplotlib", "bench"),
    "sounddevice": ("sounddevice", "client"),
}


class MissingExtra(ModuleNotFoundError):
    """A package of one of voiced's pip extras is not installed; the message says how to get it."""


def missing_extra(error: ModuleNotFoundError, what: str = "this command") -> MissingExtra | None:
    """The error to show for `error`, when the missing module is one an extra brings; else None."""
    if isinstance(error, MissingExtra):
        return error
    top = (error.name or "").split(".")[0]
    if top not in EXTRAS:
        return None
    dist, extra = EXTRAS[top]
    return MissingExtra(
        f"{what} needs the Python package '{dist}', which is not installed (No module named {error.name!r}); "
        f"install voiced with its '{extra}' extra: pip install 'voiced[{extra}]' (in a checkout: "
        f"pip install -e '.[{extra}]')",
        name=error.name,
    )

