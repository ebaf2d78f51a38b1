"""The sizes of the LM's steps: how many decode steps one host round trip runs, how many prompt tokens
one packed prefill takes (and what its activations and buffers cost), and the buckets that keep the
number of distinct shapes (CUDA graphs) small."""

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


def padded_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket(n: int, base: int) -> int:
    """Smallest base * 2**k >= n."""
    b = base
    while b < n:
        b *= 2
    return b


def prefill_capacity(max_seq: int, graph_tokens: int) -> int:
    """Packed tokens a `lm_graphs.PrefillIO` holds: the longest prompt padded to a 64-token bucket, or the
    longest graphed pack."""
    return padded_to(max(max_seq, graph_tokens) + 64, 64)


def prefill_io_bytes(cfg, max_batch: int, max_seq: int, graph_tokens: int, itemsize: int) -> int:
    """Device bytes of the served LM's `PrefillIO` (ids, segments, positions, slots; last tokens; output)."""
    return (4 * prefill_capacity(max_seq, graph_tokens) + max_batch) * 8 + max_batch * cfg.hidden_size * itemsize
