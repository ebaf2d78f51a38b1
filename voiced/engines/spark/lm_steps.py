"""The sizes of the LM's steps: how many decode steps one host round trip runs, and how many prompt
tokens one packed prefill takes (and what its activations cost)."""

from __future__ import annotations

# Decode steps per host round trip. Each round trip costs a graph launch, two small copies and one
# sync (about 1-3 ms on a host that intercepts driver calls); 8 steps amortise that to a fraction of a
# step while adding at most 7 steps (a few ms) to when a request's first chunk can leave.
DECODE_STEPS = 8
# Packed prefill: the prompts one step prefills go through the LM together, up to this many tokens (a
# longer prompt goes alone); the rest wait for the next prefill turn. The pass is padded to a multiple
# of PREFILL_BUCKET tokens, so a GPU meets only the lengths `warmup` ran.
PREFILL_STEP_TOKENS = 1024
PREFILL_BUCKET = 64


def prefill_bytes(cfg, tokens: int, itemsize: int) -> int:
    """A packed prefill's activations, estimated: its boolean mask and the attention's float one, the
    MLP's activations and the attention's inputs in the LM's dtype."""
    t = tokens
    return t * t * (1 + itemsize) + t * itemsize * (3 * cfg.intermediate_size + 4 * cfg.hidden_size)
