"""What a torch engine holds on its device, as its `load` computes it before anything goes there: the
bytes of a module's weights in a dtype, the dtype a setting names, the check of the computed need
against the engine's share of the GPU (voiced.memory_plan), and the rows an engine takes on a GPU when
none are set."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

from voiced.engines.base import EngineError
from voiced.memory_plan import EngineNeed, MemoryPlanError

log = logging.getLogger(__name__)

# The batch rows a torch engine takes on a GPU when none are set ([asr] / [tts] max_batch = 0): the rows
# the daemon's caller capacity was measured with (docs/BENCHMARKS.md: both engines at 64 on an H200).
# Fewer rows cap the callers whose turns or replies run at once; more were not measured.
AUTO_GPU_ROWS = 64

# The dtype names a setting (or a command-line flag) may use.
DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
                                  "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def parse_dtype(d: str | torch.dtype | None, choices: str) -> torch.dtype | None:
    """A dtype from its name (None and torch dtypes pass through); `choices` ends the error's advice."""
    if d is None or isinstance(d, torch.dtype):
        return d
    if d not in DTYPES:
        raise EngineError(f"unknown dtype {d!r}; use {choices}")
    return DTYPES[d]


def tensor_bytes(module: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of a module's parameters and buffers once moved to `dtype` (floating tensors convert,
    integer ones keep theirs), counting shared tensors once. Works on the meta device."""
    seen, total = set(), 0
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
    return total


def check_memory_limit(need: EngineNeed, memory_limit: tuple[int, float] | None) -> None:
    """`load`'s memory_limit, (free GPU bytes, the engine's [memory] fraction): refuse a need above that
    share with an EngineError naming the setting (nothing has gone to the GPU yet)."""
    if memory_limit is None:
        return
    try:
        need.check(*memory_limit)
    except MemoryPlanError as e:
        raise EngineError(str(e)) from None


def rows_that_fit(top: int, need_at: Callable[[int], EngineNeed], memory_limit: tuple[int, float] | None,
                  what: str, fit: bool = True) -> tuple[int, EngineNeed]:
    """The rows a torch engine takes and their need (`need_at(rows)`). With `fit` (max_batch unset, on a
    GPU): the most rows of `top`, top/2, top/4, ... 1 whose need fits `memory_limit` (free GPU bytes, the
    engine's [memory] fraction), so a GPU too small for `top` rows still starts, with fewer; where not even
    one row fits, one row's need, which `check_memory_limit` then refuses with what to change; no limit:
    `top`. Without `fit` (rows set, or a CPU): `top` as it is."""
    if not fit:
        return top, need_at(top)
    rows = top
    while True:
        need = need_at(rows)
        if memory_limit is None or rows == 1 or need.fits(*memory_limit):
            break
        rows //= 2
    log.info("%s: %d rows (max_batch unset: the most, up to %d, that [memory] %s holds)", what, rows, top,
             need.setting)
    return rows, need
