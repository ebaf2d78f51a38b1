"""The admission's decoder prefill of SOT sequences, padded to a row bucket, as one CUDA graph replay per
(prompt length, bucket) (`Prefills`)."""

from __future__ import annotations

import torch
from torch import Tensor

from voiced.engines.rows import to_device

from .cuda_graphs import CudaGraphs
from .model import KVCache, TextDecoder, decode_attention_kernels

# The prompt lengths the admission's prefill graphs cover: initial tokens that are the SOT sequence
# alone (<|startoftranscript|> [language task] [<|notimestamps|>]: 1 to 4 tokens, no text prompt). A
# text prompt (<|startofprev|> ...) makes them longer and of any length: those prefills run eagerly.
PREFILL_GRAPH_TOKENS = 4


class Prefills:
    """The admission's decoder prefill (`TextDecoder.prefill`) of initial tokens that are an SOT
    sequence, as one CUDA graph replay per (prompt length, row bucket) when `graphs` is given, else the
    same padded pass eagerly. Eagerly the prefill is ~25 PyTorch calls per decoder layer, each of which
    gives up the GIL and waits to win it back from the event loop and the TTS thread (at 128 callers,
    40 % of the recognition thread's time); a replay is one call.

    The inputs are one static block on the device, [row, slot | tokens], written with one copy; a group
    of n rows runs as its bucket b >= n, the padding rows repeating the last real row (its slot and
    tokens): they compute the very same values and write them to the same cache entries, so whichever
    write lands, the cache holds what the unpadded pass would write, and no other slot is touched (a
    full engine has no free slot to pad into). The graph also takes the last position's logits and the
    no-speech probability at <|startoftranscript|> (position 0), so its static outputs are [b, vocab]
    and [b], not the [b, T, vocab] logits. Attention runs under `decode_attention_kernels` (never
    cuDNN's, which picked other kernels for captured calls than for eager ones).
    """

    def __init__(self, decoder: TextDecoder, cache: KVCache, buckets: list[int], no_speech: int,
                 graphs: CudaGraphs | None = None) -> None:
        self.decoder, self.cache, self.buckets, self.no_speech = decoder, cache, buckets, no_speech
        self.inputs = torch.zeros(buckets[-1], 1 + PREFILL_GRAPH_TOKENS, dtype=torch.long, device=cache.self_k.device)
        self.slots, self.tokens = self.inputs[:, 0], self.inputs[:, 1:]
        self.graphs = graphs

    def covers(self, length: int, sot_indexes: set[int], rows: int) -> bool:
        """Whether a group of `rows` rows whose initial tokens have this length, with <|startoftranscript|>
        at these positions, runs here: SOT sequences alone (no text prompt), in an encoder-batch bucket
        (more rows, from beams, run eagerly: warm-up meets none of them)."""
        return length <= PREFILL_GRAPH_TOKENS and sot_indexes == {0} and rows <= self.buckets[-1]

    def run(self, tokens: list[list[int]], slots: list[int]) -> tuple[Tensor, Tensor]:
        """Prefill `tokens` (one equal-length list per row, each covered) into cache `slots`; returns the
        logits of the last position [n, vocab] and the no-speech probabilities [n] (float32, views of
        the graph's static outputs: read them before the next prefill)."""
        n, t = len(slots), len(tokens[0])
        b = next(x for x in self.buckets if x >= n)
        block = [[s, *tk] for s, tk in zip(slots, tokens)]
        block += [block[-1]] * (b - n)
        # Through pinned memory (to_device): a group of another length may follow in the same admission
        # before this copy has run, so a reused host block could be overwritten under it.
        self.inputs[:b, :1 + t].copy_(to_device(block, self.inputs.device))
        if self.graphs is None:
            last, no_speech = self.forward(b, t)
        else:
            last, no_speech = self.graphs.replay((f"prefill {t}", b), lambda: self.forward(b, t))
        return last[:n], no_speech[:n]

    def forward(self, b: int, t: int) -> tuple[Tensor, Tensor]:
        """The pass a graph records: rows 0..b-1 of the static block, t tokens each."""
        with decode_attention_kernels(True):
            logits = self.decoder.prefill(self.tokens[:b, :t], self.slots[:b], self.cache)
        # Copies, not views: a graph's outputs keep their storage alive, and views would keep the
        # [b, t, vocab] logits and the [b, vocab] softmax (memory.memory_need counts [b, vocab] + [b]).
        return logits[:, -1].clone(), logits[:, 0].softmax(dim=-1)[:, self.no_speech].clone()

