"""The engines' switches from the environment (VOICED_WHISPER_..., VOICED_SPARK_..., ...): each is 1 (on) or 0
(off), unset or empty for its default. Any other value is refused: a misspelt value that quietly took the
default would run, and measure, something other than what was asked."""

from __future__ import annotations

import os


def env_switch(name: str, default: bool) -> bool:
    """Environment variable `name` as a switch: 1 on, 0 off (spaces around ignored), `default` where it is unset
    or empty; raises ValueError naming the variable for any other value."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name}={value!r}: use 1 (on) or 0 (off), or leave it unset for the default")
    return default if value == "" else value == "1"
