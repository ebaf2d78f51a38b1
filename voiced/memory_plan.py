"""One GPU, two models: how the KV-cache memory is split between Whisper and the TTS LM.

TensorRT-LLM's executor takes 90 % of the *free* GPU memory for its KV cache unless told
otherwise, so loading two executors in one process without a plan either fails or starves the
second one. This module holds the one plan the daemon validates at start, prints (``voiced doctor``
and the start-up log) and hands to both backends:

- ``whisper_kv_fraction``: Whisper decoder's KV pool as a fraction of free GPU memory. It is passed
  to TensorRT-LLM as ``kv_cache_free_gpu_memory_fraction`` and holds self- *and* cross-attention KV.
- ``whisper_cross_kv_fraction``: the share of that pool reserved for cross-attention KV (the encoder
  output's keys/values, 1500 positions per request). Passed as ``cross_kv_cache_fraction``; it is a
  fraction *of the Whisper pool*, not of the GPU (that is how TensorRT-LLM defines it).
- ``tts_kv_fraction``: the Spark-TTS LM's KV pool as a fraction of free GPU memory.
- ``headroom_fraction``: what must stay free for everything else (activations, CUDA graphs, the
  BiCodec vocoder in PyTorch, the allocator's slack). Validation enforces
  ``whisper_kv_fraction + tts_kv_fraction <= 1 - headroom_fraction``.

The PyTorch backend sizes its static caches from the same numbers (``kv_slots``).

Configuration: the ``[memory]`` TOML table (voiced.config), and like every key the
``VOICED_MEMORY_<KEY>`` environment overlay (``VOICED_MEMORY_TTS_KV_FRACTION``; voiced.config).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

log = logging.getLogger(__name__)


def env_name(key: str) -> str:
    """The environment variable that sets [memory] `key` (voiced.config's overlay)."""
    return f"VOICED_MEMORY_{key.upper()}"


# Below this a KV pool cannot hold even one 30 s Whisper request on a small GPU; a typo such as
# 0.0025 for 0.25 is far likelier than a deliberate choice.
MIN_POOL_FRACTION = 0.01
# Headroom below 5 % leaves nothing for activations and the vocoder: out-of-memory at the first burst.
MIN_HEADROOM = 0.05


class MemoryPlanError(ValueError):
    """A plan that cannot work; the message names the setting and what to change."""


@dataclass(frozen=True)
class KVShape:
    """What one cached token costs: 2 (K and V) x layers x KV heads x head dim x bytes."""

    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # fp16 / bf16

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes


def kv_slots(budget_bytes: int, shape: KVShape, tokens_per_slot: int) -> int:
    """How many fixed-size cache slots (batch rows) fit in `budget_bytes`.

    A slot is a static KV cache row of `tokens_per_slot` positions, as gpt-fast allocates them:
    slots = floor(budget / (bytes_per_token x tokens_per_slot)). Paged caches (TensorRT-LLM) are
    more frugal because short requests use fewer pages; this is the worst case, which is what a
    static cache must plan for.
    """
    if tokens_per_slot <= 0:
        raise ValueError("tokens_per_slot must be positive")
    per_slot = shape.bytes_per_token * tokens_per_slot
    return max(0, budget_bytes // per_slot)


@dataclass(frozen=True)
class MemoryPlan:
    whisper_kv_fraction: float = 0.25
    whisper_cross_kv_fraction: float = 0.5  # the seeds' Triton recipe uses 0.5
    tts_kv_fraction: float = 0.35
    headroom_fraction: float = 0.10

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> MemoryPlan:
        """Build from the ``[memory]`` TOML table. Unknown keys are an error (typos must not pass)."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MemoryPlanError(
                f"[memory]: unknown key(s) {', '.join(unknown)}; valid keys are {', '.join(sorted(known))}"
            )
        values = {k: _as_fraction(f"[memory] {k}", v) for k, v in data.items()}
        return cls(**values)

    # ------------------------------------------------------------------ validation

    def validate(self) -> MemoryPlan:
        """Raise MemoryPlanError with every problem found; return self when the plan is sound."""
        problems: list[str] = []
        for name in ("whisper_kv_fraction", "tts_kv_fraction"):
            v = getattr(self, name)
            if not (MIN_POOL_FRACTION <= v < 1.0):
                problems.append(
                    f"{name} = {v:g} must be in [{MIN_POOL_FRACTION:g}, 1) (env {env_name(name)})"
                )
        c = self.whisper_cross_kv_fraction
        if not (0.0 < c < 1.0):
            problems.append(
                f"whisper_cross_kv_fraction = {c:g} must be in (0, 1): it splits Whisper's pool between "
                "cross-attention (encoder output) and self-attention, and both need some"
            )
        h = self.headroom_fraction
        if not (MIN_HEADROOM <= h < 1.0):
            problems.append(
                f"headroom_fraction = {h:g} must be in [{MIN_HEADROOM:g}, 1): activations and the vocoder "
                "need free memory outside the KV pools"
            )
        total = self.whisper_kv_fraction + self.tts_kv_fraction
        if total > 1.0 - h + 1e-9:
            problems.append(
                f"whisper_kv_fraction + tts_kv_fraction = {total:.2f} leaves less than the "
                f"{h:.0%} headroom; lower them so they sum to at most {1.0 - h:.2f}"
            )
        if problems:
            raise MemoryPlanError("invalid memory plan:\n  - " + "\n  - ".join(problems))
        return self

    # ------------------------------------------------------------------ what the backends use

    def executor_fractions(self, load_order: tuple[str, ...] = ("whisper", "tts")) -> dict[str, float]:
        """The `free_gpu_memory_fraction` to pass to each TensorRT-LLM executor, in load order.

        TensorRT-LLM applies the fraction to the memory free *when that executor starts*. After the
        first executor took its share, less is free, so the second one must ask for a larger fraction
        of what remains to end up with its planned share of the original free memory:
        f2' = f2 / (1 - f1). (The second model's weights also come out of the remainder; they are small
        next to the pools — 1 GB for the 0.5B LM — and the headroom absorbs them.)
        """
        wanted = {"whisper": self.whisper_kv_fraction, "tts": self.tts_kv_fraction}
        unknown = [k for k in load_order if k not in wanted]
        if unknown:
            raise ValueError(f"unknown model(s) in load order: {unknown}; expected 'whisper' and/or 'tts'")
        out: dict[str, float] = {}
        taken = 0.0
        for name in load_order:
            out[name] = min(0.99, wanted[name] / (1.0 - taken))
            taken += wanted[name]
        return out

    def budget_bytes(self, free_bytes: int) -> dict[str, int]:
        """Bytes of KV budget per pool given the free GPU memory at start (for the PyTorch backend)."""
        whisper = int(free_bytes * self.whisper_kv_fraction)
        cross = int(whisper * self.whisper_cross_kv_fraction)
        return {
            "whisper_self": whisper - cross,
            "whisper_cross": cross,
            "tts": int(free_bytes * self.tts_kv_fraction),
        }

    # ------------------------------------------------------------------ display

    def table(self, free_bytes: int | None = None) -> str:
        """A small human-readable table for `voiced doctor` and the start-up log."""
        w, c, t, h = self.whisper_kv_fraction, self.whisper_cross_kv_fraction, self.tts_kv_fraction, self.headroom_fraction
        rows = [
            ("Whisper self-attention KV", w * (1 - c), f"kv_cache_free_gpu_memory_fraction={w:g}"),
            ("Whisper cross-attention KV", w * c, f"cross_kv_cache_fraction={c:g} (of Whisper's pool)"),
            ("Spark-TTS LM KV", t, f"kv_cache_free_gpu_memory_fraction={t:g}"),
            ("headroom (activations, vocoder)", h, "kept free"),
            ("unassigned", max(0.0, 1.0 - w - t - h), ""),
        ]
        header = f"{'pool':<34}{'share':>7}" + (f"{'GiB':>9}" if free_bytes is not None else "") + "  setting"
        lines = ["GPU memory shares for TensorRT-LLM's executors (of free GPU memory at start; caps on the torch engines)",
                 header, "-" * len(header)]
        for name, share, note in rows:
            gib = f"{share * free_bytes / 2**30:>9.1f}" if free_bytes is not None else ""
            lines.append(f"{name:<34}{share:>7.1%}{gib}  {note}")
        return "\n".join(lines)


def _as_fraction(where: str, value: Any) -> float:
    if isinstance(value, bool):
        raise MemoryPlanError(f"{where}: expected a number between 0 and 1, got {value!r}")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise MemoryPlanError(f"{where}: expected a number between 0 and 1, got {value!r}") from None
    if math.isnan(v) or math.isinf(v):
        raise MemoryPlanError(f"{where}: expected a number between 0 and 1, got {value!r}")
    if 1.0 < v <= 100.0:
        # A percentage ("30") is a common slip; say so instead of guessing.
        raise MemoryPlanError(f"{where} = {value!r}: give a fraction (e.g. {v / 100:g}), not a percentage")
    return v


# ---------------------------------------------------------------------- the PyTorch backend's plan
#
# The fractions above are what TensorRT-LLM's executors take. The PyTorch engines allocate static
# caches sized by max_batch, so their need is computed, before the weights go to the GPU, from the
# checkpoint's dimensions and the engine settings: weights, caches, what the CUDA graphs keep (their
# static inputs and outputs), the cuBLAS workspace PyTorch keeps per stream, and an estimate of the
# largest transient of one serving step. The fractions stay as caps on that need.


@dataclass(frozen=True)
class Need:
    """One thing an engine holds on the GPU."""

    what: str
    bytes: int
    transient: bool = False  # held only during a step (the engines step one at a time on one thread)


@dataclass
class EngineNeed:
    """What one PyTorch engine will hold on the GPU, item by item."""

    engine: str
    setting: str  # the [memory] key whose share of free memory caps this engine
    items: list[Need]

    @property
    def total(self) -> int:
        """Everything held plus the largest of its step transients (one step runs at a time)."""
        return sum(i.bytes for i in self.items if not i.transient) + max(
            (i.bytes for i in self.items if i.transient), default=0)

    def fits(self, free_bytes: int, fraction: float) -> bool:
        """Whether the need is within its share of the free memory."""
        return self.total <= int(free_bytes * fraction)

    def check(self, free_bytes: int, fraction: float) -> None:
        """Refuse (MemoryPlanError) a need larger than its share of the free memory, or than the free memory."""
        cap = int(free_bytes * fraction)
        if not self.fits(free_bytes, fraction):
            raise MemoryPlanError(
                f"{self.engine} needs {_gib(self.total)} on the GPU but [memory] {self.setting} = {fraction:g} allows "
                f"{_gib(cap)} of the {_gib(free_bytes)} free; raise {self.setting} (env {env_name(self.setting)}) "
                f"or lower max_batch\n{plan_table([self])}")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan_total(needs: list[EngineNeed], concurrent: bool = False) -> int:
    """What the engines hold together at their peak: everything held, plus the largest step transient
    (engines stepped one after the other on one thread never hold theirs at once), or, `concurrent`
    (a thread each: `engines.threads = "separate"`), each engine's largest transient."""
    held = sum(i.bytes for n in needs for i in n.items if not i.transient)
    largest = [max((i.bytes for i in n.items if i.transient), default=0) for n in needs]
    return held + (sum(largest) if concurrent else max(largest, default=0))


def plan_table(needs: list[EngineNeed], free_bytes: int | None = None, concurrent: bool = False) -> str:
    """The torch engines' plan, one row per item in bytes, a subtotal per engine and the total."""
    lines = ["GPU memory plan (torch backend: computed from the checkpoints and max_batch; "
             "the [memory] fractions are caps)",
             f"{'engine':<11}{'item':<58}{'bytes':>15}{'MiB':>10}"]
    lines.append("-" * len(lines[-1]))
    for n in needs:
        for i in n.items:
            lines.append(f"{n.engine:<11}{i.what:<58}{i.bytes:>15,}{i.bytes / 2**20:>10.1f}")
        lines.append(f"{n.engine:<11}{'subtotal (capped by ' + n.setting + ')':<58}{n.total:>15,}{n.total / 2**20:>10.1f}")
    total = plan_total(needs, concurrent)
    what = "each engine's largest transient" if concurrent else "the largest one transient"
    lines.append(f"{'total (held + ' + what + ')':<69}{total:>15,}{total / 2**20:>10.1f}")
    if free_bytes is not None:
        lines.append(f"{'free at start':<69}{free_bytes:>15,}{free_bytes / 2**20:>10.1f}")
    return "\n".join(lines)


# The batch rows a torch engine takes on a GPU when none are set ([asr] / [tts] max_batch = 0): the rows
# the daemon's caller capacity was measured with (docs/BENCHMARKS.md: both engines at 64).
# Fewer rows cap the callers whose turns or replies run at once; more were not measured.
AUTO_GPU_ROWS = 64


def tensor_bytes(module, dtype) -> int:
    """Bytes of a module's parameters and buffers once moved to `dtype` (floating tensors convert,
    integer ones keep theirs), counting shared tensors once. Works on the meta device."""
    import itertools

    seen, total = set(), 0
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) in seen:
            continue
        seen.add(id(t))
        total += t.numel() * (dtype.itemsize if t.is_floating_point() else t.element_size())
    return total


def check_memory_limit(need: EngineNeed, memory_limit: tuple[int, float] | None) -> None:
    """An engine `load`'s memory_limit, (free GPU bytes, the engine's [memory] fraction): refuse a need above
    that share with an EngineError naming the setting (nothing has gone to the GPU yet)."""
    if memory_limit is None:
        return
    from voiced.engines.base import EngineError

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


_WORKSPACE: dict[str, int] = {}


def stream_workspace_bytes(device: str) -> int:
    """Bytes PyTorch allocates per (thread, stream) pair that runs cuBLAS / cuBLASLt (its workspace, kept
    for the life of the process), measured once. Call it on the thread and stream that will run the
    engines' eager work, so the workspace it makes is one that would be made anyway."""
    import torch
    import torch.nn.functional as F

    dev = torch.device(device)
    # "cuda" and "cuda:0" are one device: probing it twice would leave a second workspace behind
    key = f"{dev.type}:{torch.cuda.current_device() if dev.index is None else dev.index}"
    if key in _WORKSPACE:
        return _WORKSPACE[key]
    x = torch.ones(32, 32, device=dev, dtype=torch.bfloat16)
    xf = torch.ones(32, 32, device=dev)
    bias = torch.ones(32, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    out = (F.linear(x, x, bias), xf @ xf, torch.bmm(x[None], x[None]))
    torch.cuda.synchronize(dev)
    del out
    _WORKSPACE[key] = max(0, torch.cuda.memory_allocated(dev) - before)
    return _WORKSPACE[key]


def peak_live_bytes(fn) -> int:
    """The most bytes that tensors made by `fn()` hold at once while it runs (views share their base's
    storage; a tensor counts until it is freed). Run it on the meta device: the same operators as on a
    GPU, no memory, no arithmetic, so a step's transient is known before anything loads. Workspaces a
    library takes outside PyTorch's tensors (cuDNN, cuBLAS) are not seen."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class _Live(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live = self.peak = 0
            self.storages: set[int] = set()

        def _free(self, key: int, n: int) -> None:
            self.storages.discard(key)
            self.live -= n

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if not hasattr(t, "untyped_storage"):
                    continue
                storage = t.untyped_storage()
                key = id(storage) if t.is_meta else storage.data_ptr()
                if t._is_view() or key in self.storages:
                    continue
                n = storage.nbytes()
                self.storages.add(key)
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._free, key, n)
            return out

    with _Live() as live:
        result = fn()
        del result
    return live.peak
