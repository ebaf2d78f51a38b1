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

Configuration: the ``[memory]`` TOML table (``MemoryPlan.from_mapping``), overridden by
``VOICED_WHISPER_KV_FRACTION``, ``VOICED_WHISPER_CROSS_KV_FRACTION``, ``VOICED_TTS_KV_FRACTION`` and
``VOICED_GPU_HEADROOM_FRACTION`` (``MemoryPlan.apply_env``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

ENV_VARS = {
    "whisper_kv_fraction": "VOICED_WHISPER_KV_FRACTION",
    "whisper_cross_kv_fraction": "VOICED_WHISPER_CROSS_KV_FRACTION",
    "tts_kv_fraction": "VOICED_TTS_KV_FRACTION",
    "headroom_fraction": "VOICED_GPU_HEADROOM_FRACTION",
}

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

    def apply_env(self, environ: Mapping[str, str] | None = None) -> MemoryPlan:
        """Return a copy with the ``VOICED_*`` environment overrides applied."""
        env = os.environ if environ is None else environ
        changes = {}
        for name, var in ENV_VARS.items():
            raw = env.get(var)
            if raw is not None and raw.strip() != "":
                changes[name] = _as_fraction(var, raw)
        return replace(self, **changes) if changes else self

    # ------------------------------------------------------------------ validation

    def validate(self) -> MemoryPlan:
        """Raise MemoryPlanError with every problem found; return self when the plan is sound."""
        problems: list[str] = []
        for name in ("whisper_kv_fraction", "tts_kv_fraction"):
            v = getattr(self, name)
            if not (MIN_POOL_FRACTION <= v < 1.0):
                problems.append(
                    f"{name} = {v:g} must be in [{MIN_POOL_FRACTION:g}, 1) (env {ENV_VARS[name]})"
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
        lines = ["GPU memory plan (shares of free GPU memory at start)", header, "-" * len(header)]
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
    if 1.0 < v <= 100.0 and where.startswith("VOICED_"):
        # A percentage in an environment variable ("30") is a common slip; say so instead of guessing.
        raise MemoryPlanError(f"{where}={value!r}: give a fraction (e.g. {v / 100:g}), not a percentage")
    return v
