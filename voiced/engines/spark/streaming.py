"""Chunked detokenization whose concatenation equals the whole-utterance decode, sample for sample.

BiCodec's decoder is non-causal but local: output frame t depends on semantic tokens t-R .. t+R
(R = `BiCodec.receptive_radius()`, about 70 tokens = 1.4 s for the published model). Decoding a chunk
[a, b) inside a window [a-R, b+R) and keeping only the frames of [a, b) therefore reproduces exactly
what decoding the whole utterance would give there. At the utterance's true edges the window simply
stops at 0 / at the last token, where the whole-utterance decode has its edges too. Overlap-and-
crossfade schemes (the Triton recipe's 5-token overlap) cannot do this: their seams differ.

The price is lookahead: the audio for [a, b) can leave once token b+R exists (or the utterance ended),
so the first chunk waits for `first_chunk_tokens + R` tokens. The LM writes tokens far faster than real
time, so on a GPU that is a fraction of a second.

Non-final windows of different requests batch together: padding a window on the right with arbitrary
tokens changes only frames within R of the padding, i.e. at or after b+R-R = b, outside what is kept.
Windows that end at the utterance's true end cannot be padded and are grouped by exact length.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .bicodec import HOP, BiCodec

PAD_MULTIPLE = 16  # pad batched windows to a multiple of this many tokens: fewer distinct conv shapes


@dataclass
class Window:
    start: int  # first token decoded
    keep_from: int  # first token whose audio is released
    keep_to: int  # one past the last token whose audio is released
    end: int  # one past the last token decoded
    final: bool  # `end` is the utterance's true end


class ChunkPlanner:
    """Decides which token windows to decode as tokens arrive, for one utterance."""

    def __init__(self, radius: int, first_chunk_tokens: int, chunk_tokens: int) -> None:
        if first_chunk_tokens < 1 or chunk_tokens < 1:
            raise ValueError("first_chunk_tokens and chunk_tokens must be >= 1")
        self.radius = radius
        self.first = first_chunk_tokens
        self.chunk = chunk_tokens
        self.emitted = 0  # tokens whose audio has been released

    def next_window(self, n_tokens: int, ended: bool) -> Window | None:
        a = self.emitted
        if a >= n_tokens:
            return None
        start = max(0, a - self.radius)
        if ended:
            return Window(start, a, n_tokens, n_tokens, True)
        b = a + (self.first if a == 0 else self.chunk)
        if n_tokens >= b + self.radius:
            return Window(start, a, b, b + self.radius, False)
        return None

    def windows(self, n_tokens: int, ended: bool) -> list[Window]:
        """Every window that can be released now, in order (several when the LM ran ahead)."""
        out = []
        while (w := self.next_window(n_tokens, ended)) is not None:
            out.append(w)
            self.emitted = w.keep_to
        return out


@dataclass
class DecodeJob:
    tokens: torch.Tensor  # [n] all semantic ids of the utterance so far (long, on the codec's device)
    speaker: torch.Tensor  # [C] speaker vector
    window: Window


@torch.no_grad()
def decode_jobs(codec: BiCodec, jobs: list[DecodeJob]) -> list[np.ndarray]:
    """Decode windows of (possibly) many requests in as few batched calls as possible; returns the
    kept audio of each job (float32, 320 samples per kept token)."""
    results: list[np.ndarray | None] = [None] * len(jobs)
    padded = [i for i, j in enumerate(jobs) if not j.window.final]
    exact: dict[int, list[int]] = {}
    for i, j in enumerate(jobs):
        if j.window.final:
            exact.setdefault(j.window.end - j.window.start, []).append(i)
    groups: list[tuple[list[int], int]] = []
    if padded:
        longest = max(jobs[i].window.end - jobs[i].window.start for i in padded)
        groups.append((padded, -(-longest // PAD_MULTIPLE) * PAD_MULTIPLE))
    groups += [(idxs, length) for length, idxs in exact.items()]
    for idxs, length in groups:
        rows = []
        for i in idxs:
            w = jobs[i].window
            seg = jobs[i].tokens[w.start : w.end]
            if seg.shape[0] < length:
                seg = torch.cat([seg, seg.new_zeros(length - seg.shape[0])])
            rows.append(seg)
        spk = torch.stack([jobs[i].speaker for i in idxs])
        wav = codec.decode(torch.stack(rows), spk).float().cpu().numpy()
        for row, i in enumerate(idxs):
            w = jobs[i].window
            lo, hi = (w.keep_from - w.start) * HOP, (w.keep_to - w.start) * HOP
            results[i] = wav[row, lo:hi]
    return results  # type: ignore[return-value]


@torch.no_grad()
def stream_decode(codec: BiCodec, semantic_ids: torch.Tensor, global_ids: torch.Tensor,
                  first_chunk_tokens: int, chunk_tokens: int, radius: int | None = None) -> list[np.ndarray]:
    """Feed `semantic_ids [n]` one token at a time, as the LM would, and return the chunks released."""
    radius = codec.receptive_radius() if radius is None else radius
    planner = ChunkPlanner(radius, first_chunk_tokens, chunk_tokens)
    spk = codec.speaker_vector(global_ids.view(1, -1))[0]
    chunks = []
    n = semantic_ids.shape[0]
    for t in range(1, n + 1):
        for w in planner.windows(t, ended=t == n):
            chunks += decode_jobs(codec, [DecodeJob(semantic_ids, spk, w)])
    return chunks
