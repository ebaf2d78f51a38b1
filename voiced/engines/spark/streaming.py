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

Windows of different requests batch together: padding a window on the right with arbitrary tokens
changes only frames within R of the padding, i.e. at or after b+R-R = b, outside what is kept. A window
that ends at the utterance's true end is padded too, but every time-mixing convolution of the decoder
then sees zeros past that end (its input is masked there), which is exactly the zero padding the
unpadded decode applies at that edge. So every call has a bucketed shape: the window length rounded up
to `PAD_MULTIPLE` (`LONG_PAD_MULTIPLE` past `LONG_PAD_FROM`) and the batch rounded up to one of
`BATCH_BUCKETS` (repeating a row), and a GPU meets no shape that `SparkTTSEngine.warmup` did not run.

Each window pays 2R tokens of context for the chunk it releases (a 25-token chunk decodes ~161 tokens at
R = 68). When the LM has run ahead and several consecutive chunks are ready, the planner can release them
as one window [a, b) (`max_len`): the context is paid once, and the audio is the same by the argument
above (the kept frames of any window [a-R, b+R) are the whole-utterance decode's).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from voiced.engines.rows import to_device

from .bicodec import HOP, BiCodec

PAD_MULTIPLE = 16  # pad batched windows to a multiple of this many tokens: fewer distinct conv shapes
# Windows longer than LONG_PAD_FROM tokens (merged chunks) pad to a multiple of LONG_PAD_MULTIPLE: up to
# 1024 tokens that is 28 lengths instead of 64 for warm-up to run, for at most 63 tokens of padding on a
# window that releases hundreds.
LONG_PAD_FROM = 256
LONG_PAD_MULTIPLE = 64
# Batch sizes a decode call runs at (a batch is padded up to the next one by repeating its first row);
# larger batches are split into calls of the largest.
BATCH_BUCKETS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def batch_bucket(n: int) -> int:
    return next((b for b in BATCH_BUCKETS if b >= n), BATCH_BUCKETS[-1])


def padded_length(n_tokens: int) -> int:
    m = PAD_MULTIPLE if n_tokens <= LONG_PAD_FROM else LONG_PAD_MULTIPLE
    return -(-n_tokens // m) * m


def window_lengths(longest: int) -> list[int]:
    """Every padded window length up to `padded_length(longest)`, shortest first."""
    out, n = [], PAD_MULTIPLE
    while n <= padded_length(longest):
        out.append(n)
        n = padded_length(n + 1)
    return out


@functools.lru_cache(maxsize=256)
def longest_fitting(budget: int, n_windows: int) -> int:
    """The longest padded window length at which `n_windows` windows (batch-bucketed) hold at most
    `budget` tokens; 0 if none does. Cached: a vocoder step asks for every window it takes."""
    b = batch_bucket(n_windows)
    return max((n for n in window_lengths(budget // b) if b * n <= budget), default=0)


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

    def next_window(self, n_tokens: int, ended: bool, max_len: int = 0) -> Window | None:
        """The next window that can be released with `n_tokens` written, or None.

        max_len: when the next chunk is ready and later ones are too, release them together in one
        window whose padded length is at most this (0: one chunk a window). The first chunk is never
        merged: it is what a caller waits for, and a longer window would only delay it."""
        a = self.emitted
        if a >= n_tokens:
            return None
        start = max(0, a - self.radius)
        # Regular chunks first, also once the utterance ended: the last window then spans less than
        # one chunk plus its context, so window lengths stay bounded (and warmed up) however far the
        # LM ran ahead of the vocoder.
        b = a + (self.first if a == 0 else self.chunk)
        if n_tokens < b + self.radius:
            return Window(start, a, n_tokens, n_tokens, True) if ended else None
        if a > 0 and max_len:
            if ended and padded_length(n_tokens - start) <= max_len:
                return Window(start, a, n_tokens, n_tokens, True)  # the rest, in one window
            while b + self.chunk + self.radius <= n_tokens and \
                    padded_length(b + self.chunk + self.radius - start) <= max_len:
                b += self.chunk
        return Window(start, a, b, b + self.radius, False)

    def windows(self, n_tokens: int, ended: bool, max_len: int = 0) -> list[Window]:
        """Every window that can be released now, in order (several when the LM ran ahead, fewer
        and longer with `max_len`: see `next_window`)."""
        out = []
        while (w := self.next_window(n_tokens, ended, max_len)) is not None:
            out.append(w)
            self.emitted = w.keep_to
        return out


@dataclass
class DecodeJob:
    # All semantic ids of the utterance so far, on the host (a list, an array or a CPU tensor): a call's
    # windows are cut and padded there and reach the device in one copy.
    tokens: Sequence[int] | np.ndarray | torch.Tensor
    speaker: torch.Tensor  # [C] speaker vector
    window: Window


@torch.no_grad()
def decode_jobs(codec: BiCodec, jobs: list[DecodeJob]) -> list[np.ndarray]:
    """Decode windows of (possibly) many requests in as few batched calls as possible; returns the
    kept audio of each job (float32, 320 samples per kept token). Two groups, the windows that end an
    utterance and the others; in each, every window is padded on the right to one length (the longest,
    rounded up to PAD_MULTIPLE), a window that ends at its utterance's true end is masked past that end
    (see the module docstring), and the batch is padded to a bucket."""
    return launch_jobs(codec, jobs).collect()


@dataclass
class LaunchedDecode:
    """`decode_jobs` queued on the device and not yet read: `collect` waits for it. Between the two the
    engine thread can launch other work to run beside it (the recognizer's step, with engines.overlap)."""

    jobs: list[DecodeJob]
    calls: list[tuple[list[int], torch.Tensor]]  # each call's jobs and its audio [b, length * HOP] on the host
    done: torch.cuda.Event | None  # recorded after the last copy to the host (None: on the CPU, done)

    def collect(self) -> list[np.ndarray]:
        """The kept audio of each job, copied out of the (pinned) read-back buffers."""
        if self.done is not None:
            self.done.synchronize()
        results: list[np.ndarray | None] = [None] * len(self.jobs)
        for idxs, wav in self.calls:
            host = wav.numpy()
            for row, i in enumerate(idxs):
                w = self.jobs[i].window
                results[i] = host[row, (w.keep_from - w.start) * HOP : (w.keep_to - w.start) * HOP].copy()
        return results  # type: ignore[return-value]


@torch.no_grad()
def launch_jobs(codec: BiCodec, jobs: list[DecodeJob]) -> LaunchedDecode:
    """`decode_jobs`' calls queued on the current stream, each followed by a non-blocking copy of its
    audio to pinned host memory: a graph's output is a shared buffer the next call overwrites, and the
    stream runs each copy before the next call (vocoder_graphs)."""
    calls = [(idxs, _decode_group(codec, jobs, idxs, length)) for idxs, length in decode_calls([j.window for j in jobs])]
    done = None
    if jobs and jobs[0].speaker.is_cuda:
        done = torch.cuda.Event()
        done.record()
    return LaunchedDecode(jobs, calls, done)


def decode_calls(windows: list[Window]) -> list[tuple[list[int], int]]:
    """How `decode_jobs` splits these windows into calls: (indices, padded length) of each call; a
    call decodes `batch_bucket(len(indices))` rows of that length."""
    top = BATCH_BUCKETS[-1]
    calls = []
    # Utterance ends apart from the rest: the last window of a request alone is then decoded the same
    # way whatever chunks of it (or of others) are ready at the same time, so its audio does not
    # depend on how the steps fell (CPU and GPU kernels are not batch-invariant to the last bit).
    for final in (False, True):
        group = [i for i, w in enumerate(windows) if w.final == final]
        if group:
            length = padded_length(max(windows[i].end - windows[i].start for i in group))
            calls += [(group[lo : lo + top], length) for lo in range(0, len(group), top)]
    return calls


def decoded_tokens(windows: list[Window]) -> int:
    """Window tokens the vocoder computes for these windows, padding and repeated rows included."""
    return sum(batch_bucket(len(idxs)) * length for idxs, length in decode_calls(windows))


def _decode_group(codec: BiCodec, jobs: list[DecodeJob], idxs: list[int], length: int) -> torch.Tensor:
    """Queue the decode of jobs `idxs` as one call of bucketed batch, every window padded to `length` with
    zeros and the batch with copies of its first row, and the copy of its audio `[b, length * HOP]` to the
    host (pinned and not yet complete, on a GPU). The ids are laid out on the host and sent in one copy
    (per window on the device, a slice and a pad would be a few torch calls each and a synchronous copy
    per request)."""
    b = batch_bucket(len(idxs))
    ids = np.zeros((b, length), dtype=np.int64)
    valid = []
    for row, i in enumerate(idxs):
        w = jobs[i].window
        ids[row, : w.end - w.start] = jobs[i].tokens[w.start : w.end]
        valid.append(w.end - w.start if w.final else length)
    ids[len(idxs):] = ids[0]
    valid += valid[:1] * (b - len(idxs))
    spk = torch.stack([jobs[i].speaker for i in idxs] + [jobs[idxs[0]].speaker] * (b - len(idxs)))
    wav = decode_windows(codec, to_device(ids, spk.device), spk, valid).float()
    # non_blocking to the host allocates the destination pinned (no sync); on the CPU a decode's output is
    # its own tensor already.
    return wav.to("cpu", non_blocking=True) if wav.is_cuda else wav


def decode_windows(codec: BiCodec, ids: torch.Tensor, spk: torch.Tensor, valid: list[int]) -> torch.Tensor:
    """`codec.decode(ids [B, L], spk)`, where row b's utterance ends after `valid[b]` tokens: past that
    the input of every time-mixing convolution is zeroed, as the decode of the unpadded row pads it."""
    length = ids.shape[1]
    graphs = getattr(codec, "_graphs", None)  # voiced.engines.spark.vocoder_graphs, where the engine turned them on
    if graphs is not None:
        out = graphs.decode(ids, spk, valid)
        if out is not None:
            return out  # a view of the graphs' shared output: read it before the next vocoder call
    if min(valid) >= length:
        return codec.decode(ids, spk)
    _install_end_masks(codec)
    codec._window_valid = (to_device(valid, ids.device), length, {})
    try:
        return codec.decode(ids, spk)
    finally:
        codec._window_valid = None


def _end_mask_hook(codec: BiCodec):
    def hook(module, args):
        state = codec._window_valid
        if state is None:
            return None
        valid, length, masks = state
        x = args[0]
        t = x.shape[-1]  # t = length * (the layer's samples per token), exactly: every layer keeps that ratio
        keep = masks.get(t)
        if keep is None:  # made once per rate and call, not per convolution: ~30 of them share 5 rates
            keep = masks[t] = torch.arange(t, device=x.device)[None, None, :] < (valid * t // length)[:, None, None]
        return (torch.where(keep, x, 0.0), *args[1:])

    return hook


def _install_end_masks(codec: BiCodec) -> None:
    """Pre-hooks on the decode path's time-mixing convolutions (kernel > 1, transposed); no-ops unless
    `codec._window_valid` is set (by `decode_windows`: the valid lengths on the device, the padded
    length, and the masks made so far in this call, by time steps)."""
    if getattr(codec, "_end_masks_installed", False):
        return
    hook = _end_mask_hook(codec)
    for part in (codec.prenet, codec.decoder):
        for m in part.modules():
            if isinstance(m, torch.nn.ConvTranspose1d) or (isinstance(m, torch.nn.Conv1d) and m.kernel_size[0] > 1):
                if isinstance(m, torch.nn.Conv1d) and m.stride[0] > 1:
                    raise NotImplementedError("a strided convolution on the decode path cannot be end-masked")
                m.register_forward_pre_hook(hook)
    codec._window_valid = None
    codec._end_masks_installed = True


@torch.no_grad()
def stream_decode(codec: BiCodec, semantic_ids: torch.Tensor, global_ids: torch.Tensor,
                  first_chunk_tokens: int, chunk_tokens: int, radius: int | None = None,
                  step: int = 1, max_len: int = 0) -> list[np.ndarray]:
    """Feed `semantic_ids [n]` `step` tokens at a time, as the LM would, and return the chunks released
    (`max_len`: merge ready chunks into windows up to that length, see `ChunkPlanner.next_window`)."""
    radius = codec.receptive_radius() if radius is None else radius
    planner = ChunkPlanner(radius, first_chunk_tokens, chunk_tokens)
    spk = codec.speaker_vector(global_ids.view(1, -1))[0]
    semantic_ids = semantic_ids.cpu()  # DecodeJob cuts windows on the host (ids sampled on a GPU come from there)
    chunks = []
    n = semantic_ids.shape[0]
    for t in [*range(step, n, step), n]:
        for w in planner.windows(t, ended=t == n, max_len=max_len):
            chunks += decode_jobs(codec, [DecodeJob(semantic_ids, spk, w)])
    return chunks
