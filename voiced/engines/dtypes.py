"""The dtype names a setting (or a command-line flag) may use, for the torch engines."""

from __future__ import annotations

import torch

from voiced.engines.base import EngineError

DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
                                  "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def parse_dtype(d: str | torch.dtype | None, choices: str) -> torch.dtype | None:
    """A dtype from its name (None and torch dtypes pass through); `choices` ends the error's advice."""
    if d is None or isinstance(d, torch.dtype):
        return d
    if d not in DTYPES:
        raise EngineError(f"unknown dtype {d!r}; use {choices}")
    return DTYPES[d]
