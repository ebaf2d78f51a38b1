"""Word timings from the decoder's cross-attention, computed as openai-whisper computes them.

After a request is decoded, its text tokens are run once more through the decoder behind
`<|startoftranscript|> [<|lang|> <|task|>] <|notimestamps|>` and in front of `<|endoftext|>`,
against the audio already in its cache slot (`TextDecoder.alignment_hidden`). The cross-attention of a
few "alignment heads", whose attention follows the audio, gives a token x audio-frame matrix:

1. scores of the heads over the audio's own frames (not the window's padding), softmax per token;
2. each head standardised per frame over the tokens, a width-7 median filter along time;
3. the mean over heads; dynamic time warping of the text tokens against the 20 ms frames (cost:
   minus the matrix) gives, for every token, the frame where it starts;
4. tokens grouped into words (at spaces and punctuation; at whole characters for Chinese, Japanese,
   Thai, Lao, Burmese and Cantonese), a word lasting from its first token's frame to the next word's;
5. openai-whisper's clean-ups: words at sentence ends no longer than twice the median word, opening
   punctuation joined to the next word and closing punctuation to the previous one, first/last words
   of a segment held to the segment's own timestamps when they run long after a pause;
6. the words fitted to the audio's pauses (`fit_to_pauses`), which openai-whisper does not do.

Steps 1-5 give openai-whisper's times (tests hold them to its `add_word_timestamps` within a frame).
Against speech whose word boundaries are known (tests/word_truth.py) those times run late: the
path tiles the audio, so a word lasts until the next one starts, through any pause after it, and
the first word starts at 0 s however much silence leads; and a word's tokens draw the heads'
attention most ~60 % into the word, so the path crosses from one word to the next ~60 ms after the
next one's onset. Step 6 moves each boundary between two words into the pause between them when
the audio has one near it, and trims silence off every word's ends.

Each word's probability is the mean over its tokens of the token's probability among text tokens.

Which heads: the checkpoint says (CTranslate2's config.json and Hugging Face's generation_config.json
carry `alignment_heads`); OpenAI's `.pt` files do not, so openai-whisper's table by official model
name ships here; anything else uses every head of the upper half of the decoder, as openai-whisper
does by default (it works, less sharply).
"""

from __future__ import annotations

import base64
import gzip
import string
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from voiced.engines.base import Word

from .audio import HOP_LENGTH, SAMPLE_RATE
from .model import ModelDims
from .tokenizer import WhisperTokenizer

SECONDS_PER_FRAME = 0.02  # one encoder position: 2 mel frames of 10 ms
LOUDNESS_HOP = HOP_LENGTH  # 10 ms: the mel frame
# Silence (fit_to_pauses): a 10 ms frame this far below the utterance's loud frames (its 99th
# percentile: a click does not set it) or, in noise, no more than this far above its quiet frames
# (5th percentile) counts as silent.
SILENCE_BELOW_PEAK_DB = 40.0
SILENCE_ABOVE_FLOOR_DB = 10.0
# A pause: at least this much silence in a row (shorter silences are stop closures inside words),
# at most this far from where the attention put the boundary (its typical error, ~2x the lag).
PAUSE_MIN_S = 0.04
PAUSE_REACH_S = 0.2
MEDIAN_FILTER_WIDTH = 7
PREPEND_PUNCTUATION = "\"'“¿([{-"
APPEND_PUNCTUATION = "\"'.。,，!！?？:：”)]}、"
SENTENCE_END = ".。!！?？"
# Written without spaces between words: split at whole characters instead.
NO_SPACE_LANGUAGES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})

# openai-whisper's alignment heads of the official checkpoints (whisper/__init__.py, MIT): a
# (decoder layers x heads) boolean array per model, gzip'ed and base85-encoded.
OFFICIAL_ALIGNMENT_HEADS: dict[str, bytes] = {
    "tiny.en": b"ABzY8J1N>@0{>%R00Bk>$p{7v037`oCl~+#00",
    "tiny": b"ABzY8bu8Lr0{>%RKn9Fp%m@SkK7Kt=7ytkO",
    "base.en": b"ABzY8;40c<0{>%RzzG;p*o+Vo09|#PsxSZm00",
    "base": b"ABzY8KQ!870{>%RzyTQH3`Q^yNP!>##QT-<FaQ7m",
    "small.en": b"ABzY8>?_)10{>%RpeA61k&I|OI3I$65C{;;pbCHh0B{qLQ;+}v00",
    "small": b"ABzY8DmU6=0{>%Rpa?J`kvJ6qF(V^F86#Xh7JUGMK}P<N0000",
    "medium.en": b"ABzY8usPae0{>%R7<zz_OvQ{)4kMa0BMw6u5rT}kRKX;$NfYBv00*Hl@qhsU00",
    "medium": b"ABzY8B0Jh+0{>%R7}kK1fFL7w6%<-Pf*t^=N)Qr&0RR9",
    "large-v1": b"ABzY8r9j$a0{>%R7#4sLmoOs{s)o3~84-RPdcFk!JR<kSfC2yj",
    "large-v2": b"ABzY8zd+h!0{>%R7=D0pU<_bnWW*tkYAhobTNnu$jnkEkXqp)j;w1Tzk)UH3X%SZd&fFZ2fC2yj",
    "large-v3": b"ABzY8gWO1E0{>%R7(9S+Kn!D~%ngiGaR?*L!iJG9p-nab0JQ=-{D1-g00",
    "large-v3-turbo": b"ABzY8j^C+e0{>%RARaKHP%t(lGR*)0g!tONPyhe`",
}
_OFFICIAL_ALIASES = {"large": "large-v3", "turbo": "large-v3-turbo"}

Heads = list[tuple[int, int]]


# ------------------------------------------------------------------------------ which heads
def decode_heads(blob: bytes, n_layer: int, n_head: int) -> Heads:
    """An openai-whisper bitmap -> sorted (layer, head) pairs; ValueError if it is not layers x heads."""
    bits = np.frombuffer(gzip.decompress(base64.b85decode(blob)), dtype=bool)
    if bits.size != n_layer * n_head:
        raise ValueError(f"alignment-head bitmap has {bits.size} entries, not {n_layer} x {n_head}")
    layers, heads = np.nonzero(bits.reshape(n_layer, n_head))
    return [(int(a), int(b)) for a, b in zip(layers, heads)]


def official_alignment_heads(name: str, dims: ModelDims) -> Heads | None:
    """openai-whisper's heads for an official model name (e.g. the stem of `tiny.en.pt`), or None when
    the name is not official or its table does not fit these dimensions (a renamed other model)."""
    name = _OFFICIAL_ALIASES.get(name, name)
    blob = OFFICIAL_ALIGNMENT_HEADS.get(name)
    if blob is None or name.endswith(".en") == dims.multilingual:
        return None
    try:
        return decode_heads(blob, dims.n_text_layer, dims.n_text_head)
    except ValueError:
        return None


def default_alignment_heads(dims: ModelDims) -> Heads:
    """Every head of the upper half of the decoder layers (openai-whisper's default)."""
    return [(layer, h) for layer in range(dims.n_text_layer // 2, dims.n_text_layer) for h in range(dims.n_text_head)]


def check_heads(heads: Heads, dims: ModelDims, where: str) -> Heads:
    bad = [(a, b) for a, b in heads if not (0 <= a < dims.n_text_layer and 0 <= b < dims.n_text_head)]
    if bad:
        raise ValueError(f"{where}: alignment heads {bad[:3]} are outside the decoder's "
                         f"{dims.n_text_layer} layers x {dims.n_text_head} heads")
    return sorted(set(heads))


# -------------------------------------------------------------------------- the arithmetic
def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a sliding window of odd `width` along the last dimension of x [..., T] (3-D or
    4-D), with reflected edges; x unchanged when T is too short to reflect."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    x = F.pad(x, (pad, pad, 0, 0), mode="reflect")
    # sort() then the middle element: torch.median is slower here and sorts ties the same way.
    return x.unfold(-1, width, 1).sort()[0][..., pad]


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through cost [N, M] from (0, 0) to (N-1, M-1), moving by
    (1, 1), (1, 0) or (0, 1): (row indices, column indices) along it (`dtw_many` of one matrix)."""
    return dtw_many([cost])[0]


# Padded cells one `dtw_many` table may hold (~13 bytes each): more matrices go to further tables.
DTW_CELLS = 1 << 22


def dtw_many(costs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """`dtw` of each matrix, the matrices of a step's finished requests swept together.

    Accumulated costs are float32 as in openai-whisper (each cell: float64 cost + float32 best
    predecessor, stored as float32), ties going to the right-hand move, then down, so paths match
    its to the frame. Cells on one anti-diagonal depend only on the two before it, so each
    diagonal is one vectorised update (N + M numpy steps instead of N x M Python ones). The tables
    are kept skewed, row d holding anti-diagonal d (cell (i, j) at [i + j, i]), so that the three
    predecessors of a diagonal's cells are plain slices of the two rows before it.

    Several matrices share one table padded to the largest N and M: a cell of matrix r's own
    rectangle depends only on cells above and left of it, inside that rectangle or on its borders,
    so the padding never reaches its path and each path is the one it has alone; the numpy steps
    of a diagonal (what costs, at a few microseconds each) serve every matrix at once.
    """
    out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(costs)
    order = sorted(range(len(costs)), key=lambda r: costs[r].shape)
    while order:
        group = [order.pop(0)]
        while order:  # the next (larger) matrix joins while the padded table stays in budget
            n, m = (max(costs[r].shape[k] for r in (*group, order[0])) for k in (0, 1))
            if (len(group) + 1) * (n + m + 1) * (n + 1) > DTW_CELLS:
                break
            group.append(order.pop(0))
        for r, path in zip(group, _dtw_table([costs[r] for r in group])):
            out[r] = path
    return out


def _dtw_table(costs: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    g = len(costs)
    n, m = max(c.shape[0] for c in costs), max(c.shape[1] for c in costs)
    acc = np.full((g, n + m + 1, n + 1), np.inf, dtype=np.float32)  # acc[r, i + j, i]: path cost to (i, j)
    acc[:, 0, 0] = 0.0
    trace = np.full((g, n + m + 1, n + 1), -1, dtype=np.int8)
    skewed = np.zeros((g, n + m + 1, n + 1))
    for r, c in enumerate(costs):
        ii, jj = np.meshgrid(np.arange(1, c.shape[0] + 1), np.arange(1, c.shape[1] + 1), indexing="ij")
        skewed[r, ii + jj, ii] = c
    for d in range(2, n + m + 1):
        lo, hi = max(1, d - m), min(n, d - 1) + 1  # rows i of the cells on this diagonal
        c0 = acc[:, d - 2, lo - 1:hi - 1]  # (i-1, j-1)
        c1 = acc[:, d - 1, lo - 1:hi - 1]  # (i-1, j)
        c2 = acc[:, d - 1, lo:hi]  # (i, j-1)
        diag = (c0 < c1) & (c0 < c2)
        down = ~diag & (c1 < c0) & (c1 < c2)
        acc[:, d, lo:hi] = skewed[:, d, lo:hi] + np.where(diag, c0, np.where(down, c1, c2))
        trace[:, d, lo:hi] = np.where(diag, 0, np.where(down, 1, 2))
    return [_walk_back(trace[r], *c.shape) for r, c in enumerate(costs)]


def _walk_back(trace: np.ndarray, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """From the corner (n, m) of a skewed trace table home; the borders lead straight there."""
    i, j = n, m
    path = []
    while i > 0 and j > 0:
        path.append((i - 1, j - 1))
        t = trace[i + j, i]
        if t == 0:
            i, j = i - 1, j - 1
        elif t == 1:
            i -= 1
        else:
            j -= 1
    path += [(i - 1 - k, -1) for k in range(i)] + [(-1, j - 1 - k) for k in range(j)]
    rows, cols = np.array(path[::-1]).T
    return rows, cols


# ------------------------------------------------------------------------------- words
def split_words(tok: WhisperTokenizer, tokens: list[int], language: str) -> tuple[list[str], list[list[int]]]:
    """Tokens -> (words, their tokens). A word starts at a token beginning with a space, at
    punctuation and at special tokens; a token that ends inside a UTF-8 character stays with the next."""
    pieces, piece_tokens = _split_characters(tok, tokens)
    if language in NO_SPACE_LANGUAGES:
        return pieces, piece_tokens
    words: list[str] = []
    word_tokens: list[list[int]] = []
    for piece, ids in zip(pieces, piece_tokens):
        if ids[0] >= tok.eot or piece.startswith(" ") or piece.strip() in string.punctuation or not words:
            words.append(piece)
            word_tokens.append(list(ids))
        else:
            words[-1] += piece
            word_tokens[-1].extend(ids)
    return words, word_tokens


def last_word_end(tok: WhisperTokenizer, tokens: list[int]) -> int:
    """The index in `tokens` just after the last token that writes a letter or a digit (what follows
    it is the punctuation Whisper put after the last word, if any); 0 where none does."""
    k = len(tokens)
    while k > 0 and not any(ch.isalnum() for ch in tok.decode(tokens[k - 1:k])):
        k -= 1
    return k


def _split_characters(tok: WhisperTokenizer, tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    """Cut wherever the tokens so far decode to whole characters (U+FFFD only where the text has one)."""
    decode = tok.encoding.decode  # special tokens included, as their text
    full = decode(tokens)
    out, out_tokens, current, offset = [], [], [], 0
    for t in tokens:
        current.append(t)
        text = decode(current)
        if "\ufffd" not in text or full[offset + text.index("\ufffd")] == "\ufffd":
            out.append(text)
            out_tokens.append(current)
            current = []
            offset += len(text)
    return out, out_tokens


@dataclass
class _Timing:
    word: str
    tokens: list[int]
    start: float
    end: float
    probability: float


def attention_matrix(scores: torch.Tensor, n_prefix: int, num_frames: int) -> torch.Tensor:
    """The token x frame matrix the time warping follows, on the scores' device.

    scores: the alignment heads' cross-attention scores [heads, T, audio positions] for the whole
    forced sequence (n_prefix tokens up to <|notimestamps|>, the text, <|endoftext|>); num_frames:
    the audio's length in 10 ms mel frames. Rows: the positions that predict each text token and
    <|endoftext|>; columns: the audio's own 20 ms positions.
    """
    w = scores[:, :, : max(num_frames // 2, 1)].float().softmax(dim=-1)
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    # (A flat row, std 0, only happens on audio of a frame or two: count it as no information.)
    w = median_filter(torch.nan_to_num((w - mean) / std), MEDIAN_FILTER_WIDTH)
    return w.mean(dim=0)[n_prefix - 1: -1]


def align(tok: WhisperTokenizer, language: str, text_tokens: list[int], path: tuple[np.ndarray, np.ndarray],
          token_probs: list[float]) -> list[_Timing]:
    """Words of `text_tokens` with their times (s) and probabilities.

    path: the time warping's path through the tokens' `attention_matrix` (`dtw` of minus it);
    token_probs: each text token's probability.
    """
    if not text_tokens:
        return []
    text_idx, time_idx = path
    words, word_tokens = split_words(tok, text_tokens + [tok.eot], language)
    if len(word_tokens) <= 1:
        return []
    bounds = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_idx), (1, 0), constant_values=1).astype(bool)
    jump_times = time_idx[jumps] * SECONDS_PER_FRAME
    starts, ends = jump_times[bounds[:-1]], jump_times[bounds[1:]]
    probs = [float(np.mean(token_probs[i:j])) for i, j in zip(bounds[:-1], bounds[1:])]
    return [_Timing(wd, ids, float(s), float(e), p)
            for wd, ids, s, e, p in zip(words, word_tokens, starts, ends, probs)]


def merge_punctuation(words: list[_Timing], prepended: str = PREPEND_PUNCTUATION,
                      appended: str = APPEND_PUNCTUATION) -> None:
    """Opening punctuation joins the word after it, closing punctuation the word before it (in
    place; the emptied entries stay, with no text and no tokens)."""
    i, j = len(words) - 2, len(words) - 1
    while i >= 0:
        prev, nxt = words[i], words[j]
        if prev.word.startswith(" ") and prev.word.strip() in prepended:
            nxt.word, nxt.tokens = prev.word + nxt.word, prev.tokens + nxt.tokens
            prev.word, prev.tokens = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(words):
        prev, nxt = words[i], words[j]
        if not prev.word.endswith(" ") and nxt.word in appended:
            prev.word, prev.tokens = prev.word + nxt.word, prev.tokens + nxt.tokens
            nxt.word, nxt.tokens = "", []
        else:
            i = j
        j += 1


@dataclass
class SegmentSpan:
    """A decoded segment as the word timings see it: its timestamps (s) and its tokens."""

    start: float
    end: float
    tokens: list[int]


def word_timings(tok: WhisperTokenizer, language: str, segments: list[SegmentSpan],
                 path: tuple[np.ndarray, np.ndarray] | None, token_probs: list[float],
                 last_speech: float = 0.0) -> list[list[Word]]:
    """Per segment, its words with times in seconds (2 decimals) from the start of the audio.

    `segments` hold the request's tokens in order (timestamp tokens are skipped); one forced pass
    over all their text gave the time warping's `path` (None when there is no text) and `token_probs`
    (see `align`). `last_speech`: where speech last ended before this audio (the first word may not
    start a long pause by running long).
    """
    per_segment = [[t for t in s.tokens if t < tok.eot] for s in segments]
    text = [t for ids in per_segment for t in ids]
    timings = align(tok, language, text, path, token_probs) if path is not None else []
    durations = np.array([t.end - t.start for t in timings])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations))) if len(durations) else 0.0
    longest = median * 2
    # Words at sentence boundaries get no more than twice the median word's duration.
    if len(durations):
        for i in range(1, len(timings)):
            if timings[i].end - timings[i].start > longest:
                if timings[i].word in SENTENCE_END:
                    timings[i].end = timings[i].start + longest
                elif timings[i - 1].word in SENTENCE_END:
                    timings[i].start = timings[i].end - longest
    merge_punctuation(timings)

    out: list[list[Word]] = []
    k = 0
    for seg, ids in zip(segments, per_segment):
        seg_start, seg_end = seg.start, seg.end
        taken, words = 0, []
        while k < len(timings) and taken < len(ids):
            t = timings[k]
            if t.word:
                words.append([t.word, round(t.start, 2), round(t.end, 2), t.probability])
            taken += len(t.tokens)
            k += 1
        if words:
            first, last = words[0], words[-1]
            # After a pause, the first (and second) word may not stretch over it.
            if first[2] - last_speech > median * 4 and (
                    first[2] - first[1] > longest or (len(words) > 1 and words[1][2] - first[1] > longest * 2)):
                if len(words) > 1 and words[1][2] - words[1][1] > longest:
                    boundary = max(words[1][2] / 2, words[1][2] - longest)
                    first[2] = words[1][1] = boundary
                first[1] = max(0.0, first[2] - longest)
            # The segment's own timestamps win over a first or last word that runs far past them.
            if seg_start < first[2] and seg_start - 0.5 > first[1]:
                first[1] = max(0.0, min(first[2] - median, seg_start))
            else:
                seg_start = first[1]
            if seg_end > last[1] and seg_end + 0.5 < last[2]:
                last[2] = max(last[1] + median, seg_end)
            else:
                seg_end = last[2]
            last_speech = seg_end
        # Milliseconds are plenty (frames are 20 ms) and keep sums like 1.4799999999999995 out of results.
        out.append([Word(w.strip(), round(s, 3), round(e, 3), p) for w, s, e, p in words])
    return out


# ------------------------------------------------------------------------- the audio's pauses
def silent_frames(audio: np.ndarray) -> np.ndarray:
    """Per 10 ms frame of 16 kHz audio: whether it is silent (see SILENCE_BELOW_PEAK_DB)."""
    n = len(audio) // LOUDNESS_HOP
    if n == 0:
        return np.zeros(0, dtype=bool)
    x = np.asarray(audio[: n * LOUDNESS_HOP], dtype=np.float64).reshape(n, LOUDNESS_HOP)
    db = 10 * np.log10(np.mean(x * x, axis=1) + 1e-10)
    peak, floor = np.percentile(db, 99), np.percentile(db, 5)
    return db < max(peak - SILENCE_BELOW_PEAK_DB, floor + SILENCE_ABOVE_FLOOR_DB)


def _pauses(silent: np.ndarray) -> list[tuple[float, float]]:
    """(start, end) in seconds of each run of silent frames at least PAUSE_MIN_S long."""
    edges = np.diff(np.concatenate([[0], silent.astype(np.int8), [0]]))
    starts, ends = np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]
    step = LOUDNESS_HOP / SAMPLE_RATE
    return [(a * step, b * step) for a, b in zip(starts, ends) if (b - a) * step >= PAUSE_MIN_S - 1e-9]


def fit_to_pauses(words: list[Word], audio: np.ndarray) -> list[Word]:
    """`words` (times in seconds from the start of `audio`, in order) fitted to the audio's pauses:

    - a boundary between two words moves into the pause nearest to it, when one lies within
      PAUSE_REACH_S: the first word then ends where the pause starts and the second starts where
      it ends (unless that would leave either word no time);
    - then each word's ends are trimmed to its first and last audible frame (when it has one):
      silence before the first word and after the last, and pauses too short to count, are
      nobody's word.

    Speech without pauses keeps its times (only the ends of the utterance are trimmed).
    """
    if not words:
        return words
    silent = silent_frames(audio)
    pauses = _pauses(silent)
    spans = [[w.start_s, w.end_s] for w in words]
    for k in range(len(spans) - 1):
        lo, hi = spans[k][1], spans[k + 1][0]  # the boundary (an interval when the clean-ups left a gap)
        near = [(max(0.0, a - hi, lo - b), a, b) for a, b in pauses]
        near = [x for x in near if x[0] <= PAUSE_REACH_S]
        if not near:
            continue
        _, a, b = min(near)
        if a > spans[k][0] and b < spans[k + 1][1]:
            spans[k][1], spans[k + 1][0] = a, b
    step = LOUDNESS_HOP / SAMPLE_RATE
    for span in spans:
        i, j = int(round(span[0] / step)), int(round(span[1] / step))
        audible = np.nonzero(~silent[i:j])[0]
        if len(audible):
            span[0], span[1] = (i + audible[0]) * step, (i + audible[-1] + 1) * step
    return [Word(w.word, round(a, 3), round(b, 3), w.probability) for w, (a, b) in zip(words, spans)]
