"""Word timings (`WordTimings`): a finished request's text forced through the decoder over its audio (its
cache rows still hold the audio's cross keys/values), the alignment heads' cross-attention warped against
the audio's frames (dtw_kernel on a GPU, timing.dtw_many on the host), and from the same pass the probability
of end-of-text after the text and of the sentence ending right after its last word."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from voiced.engines.base import SAMPLE_RATE, EngineOutput, StepParts, Transcript, fault_output, finish
from voiced.engines.rows import to_device

from . import dtw_kernel
from .align_graphs import ALIGN_GRAPH_ROWS, AlignmentPasses
from .audio import HOP_LENGTH
from .checkpoint import CheckpointError
from .memory import step_transient_bytes
from .model import KVCache, ModelDims, Whisper
from .timing import (
    SegmentSpan,
    attention_matrix,
    check_heads,
    default_alignment_heads,
    dtw_many,
    fit_to_pauses,
    last_word_end,
    official_alignment_heads,
    word_timings,
)
from .tokenizer import WhisperTokenizer

log = logging.getLogger(__name__)


@dataclass
class _Forced:
    """A finished request's text as the word-timing pass forces it through the decoder."""

    row: int  # the cache row holding its audio's cross keys/values
    language: str  # for splitting words ("en" where the plan had none: an English-only model)
    prefix: list[int]  # <|startoftranscript|> [<|lang|> <|task|>] <|notimestamps|>
    text: list[int]
    spans: list[SegmentSpan]
    audio: np.ndarray
    tokens: list[int]  # the whole forced sequence: prefix, text, <|endoftext|>

    @classmethod
    def of(cls, tok: WhisperTokenizer, row: int, language: str | None, task: str, text: list[int],
           spans: list[SegmentSpan], audio: np.ndarray) -> _Forced:
        prefix = [*tok.sot_sequence(language, task), tok.no_timestamps]
        return cls(row, language or "en", prefix, text, spans, audio, [*prefix, *text, tok.eot])


# Bytes one forced word-timing pass may hold at once (its logits, the heads' scores and a layer's cross
# keys/values gathered from the cache rows), at most: the requests finishing in one step go through in as
# few passes as fit, where each took a pass, a readback and a time warping of its own (at 64 smart-turn
# callers these, one after another, were the slowest recognition steps, 140-364 ms). On a GPU the budget is
# also held to the memory plan's room for a step's transients (`memory.step_transient_bytes`).
ALIGN_GROUP_BYTES = 128 << 20


def check_alignment_heads(heads: list[tuple[int, int]] | None, dims: ModelDims, where: str) -> list[tuple[int, int]]:
    """The (layer, head) pairs word timings read: `heads` (the checkpoint's or openai-whisper's), else the
    default for these dimensions, checked and sorted by layer (CheckpointError where they do not fit)."""
    try:
        return check_heads(heads or default_alignment_heads(dims), dims, where)
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def official_heads(name: str, dims: ModelDims) -> list[tuple[int, int]] | None:
    """openai-whisper's alignment heads when a checkpoint's name is an official model's
    (`tiny.en.pt`, a `faster-whisper-tiny.en` or `whisper-tiny.en` directory) and its table fits."""
    for prefix in ("faster-whisper-", "whisper-", ""):
        if name.startswith(prefix):
            heads = official_alignment_heads(name[len(prefix):], dims)
            if heads:
                return heads
    return None


class WordTimings:
    """The forced passes of finished requests' texts, all of a step's together (`with_words`), in as few passes
    as ALIGN_GROUP_BYTES allows, from CUDA graphs where `passes` (an `AlignmentPasses`) has the bucket."""

    def __init__(self, model: Whisper, cache: KVCache, tok: WhisperTokenizer, heads: list[tuple[int, int]],
                 passes: AlignmentPasses | None, max_encoder_batch: int) -> None:
        self.model, self.cache, self.tok, self.dims = model, cache, tok, model.dims
        self.alignment_heads, self.passes = heads, passes
        self.budget = ALIGN_GROUP_BYTES
        if model.device.type == "cuda":
            self.budget = min(self.budget, step_transient_bytes(self.dims, model.dtype.itemsize, max_encoder_batch))

    def with_words(self, timed: list[tuple[Any, Transcript]]) -> StepParts:
        """The outputs of finished requests that asked for word timings, all of a step's together."""
        if not timed:
            return []
        try:
            found = yield from self._words(timed)
        except Exception as e:
            if len(timed) > 1:  # one request's fault must not fail the others: each again on its own
                outputs = []
                for item in timed:
                    outputs += yield from self.with_words([item])
                return outputs
            log.error("whisper: request %s failed", timed[0][0].rid, exc_info=e)
            return [fault_output(timed[0][0].rid, "speech recognition", e)]
        return [EngineOutput(req.rid, result, True) for req, result in found]

    def _words(self, timed: list[tuple[Any, Transcript]]) -> StepParts:
        """Each finished request's result with its word timings (its rows still hold its audio's cross
        keys/values), the probability of end-of-text after its text and that of the sentence ending
        right after its last word (the same forced pass has the logits for all three)."""
        forced = []
        for req, result in timed:
            plan = req.dec.plan
            text = [t for t in result.tokens if t < self.tok.eot]
            audio = req.request.audio
            if plan.timestamps and result.segments:
                spans = [SegmentSpan(s.start, s.end, s.tokens) for s in result.segments]
            else:
                spans = [SegmentSpan(0.0, audio.shape[0] // HOP_LENGTH * HOP_LENGTH / SAMPLE_RATE, text)]
            forced.append(_Forced.of(self.tok, req.rows[0], plan.language, plan.task, text, spans, audio))
        for (req, result), aligned in zip(timed, (yield from self._align(forced))):
            if aligned is None:
                result.words, result.end_prob, result.stop_prob = [], None, None
                continue
            per_segment, result.words, result.end_prob, result.stop_prob = aligned
            if req.dec.plan.timestamps and result.segments:
                # As openai-whisper's transcribe() does with word timestamps on: a segment runs from its
                # first word's start to its last word's end (what srt/vtt subtitles show).
                k = 0
                for seg, seg_words in zip(result.segments, per_segment):
                    if seg_words:
                        seg.start, seg.end = result.words[k].start_s, result.words[k + len(seg_words) - 1].end_s
                    k += len(seg_words)
        return timed

    def _align(self, forced: list[_Forced]) -> StepParts:
        """The forced passes of each request's text over its audio: (each span's words, all words fitted
        to the audio's pauses, end-of-text probability after the text, probability of a sentence end
        right after the last word), or None where the text does not fit the decoder. As few passes as
        ALIGN_GROUP_BYTES allows, one readback each; the time warping on the GPU (dtw_kernel) or, on the
        host, all requests' at once. Yields while each pass runs (returns a list: None or the above)."""
        fits = []
        for k, f in enumerate(forced):
            if len(f.tokens) > self.dims.n_text_ctx:  # only with max_new_tokens near the whole context
                log.warning("no word timings: %d text tokens do not fit the decoder's %d positions with the prompt",
                            len(f.text), self.dims.n_text_ctx)
            else:
                fits.append(k)
        a, d = self.cache.cross_k.shape[2:]
        per_position = self.dims.n_vocab * 4 * 2 + len(self.alignment_heads) * a * 4 * 3  # logits, scores
        per_request = a * d * (2 * self.cache.cross_k.element_size() + 4)  # a layer's gathered cross k/v
        most = ALIGN_GRAPH_ROWS[-1] if self.passes is not None else len(fits)  # (a graph's rows at most)
        budget = self.budget
        groups, size = [], 0
        for k in fits:
            need = per_request + per_position * len(forced[k].tokens)
            if not groups or size + need > budget or len(groups[-1]) == most:
                groups.append([])
                size = 0
            groups[-1].append(k)
            size += need
        passes = []
        for group in groups:
            passes.append((group, (yield from self._forced_pass([forced[k] for k in group]))))
        on_host = iter(dtw_many([-w for _, (_, _, warps) in passes for w in warps if isinstance(w, np.ndarray)]))
        out: list[tuple | None] = [None] * len(forced)
        for group, (token_probs, probs, warps) in passes:
            for k, tp, (end_prob, stop_prob), w in zip(group, token_probs, probs, warps):
                f = forced[k]
                path = next(on_host) if isinstance(w, np.ndarray) else w  # (the kernel's path; None: no text)
                per_segment = word_timings(self.tok, f.language, f.spans, path, tp)
                words = fit_to_pauses([w for seg in per_segment for w in seg], f.audio)
                out[k] = per_segment, words, end_prob, stop_prob
        return out

    def _forced_pass(self, group: list[_Forced]) -> StepParts:
        """One decoder pass over `group`'s forced sequences: per request its text tokens' probabilities,
        (end-of-text probability, sentence-end probability) and its time warping: the path, where the GPU
        warps (dtw_kernel), else the attention matrix for the host to warp (None without text); all read
        back in one copy, after a yield (the shared engine thread launches the other engine's work while
        the pass runs)."""
        tok, dev = self.tok, self.model.device
        seqs = [f.tokens for f in group]
        t = max(len(x) for x in seqs)
        graphed = self.passes.bucket(len(group), t) if self.passes is not None else None
        if graphed is not None:
            t = graphed[1]  # the rows padded to the graph's tokens
        # The logits read: each position that predicts a text token or end-of-text (the last of a
        # request's rows); where the last word's letters end is one of them.
        at, base = [], []
        for r, f in enumerate(group):
            base.append(len(at))
            at.extend(r * t + len(f.prefix) - 1 + j for j in range(len(f.text) + 1))
        # Every index the pass reads, in one copy to the device: the padded token rows, the cache rows, the
        # positions read, each one's text token (0 at the end rows: not read), where each request's text
        # ends, and where its last word's letters end.
        ends = [b + len(f.text) for b, f in zip(base, group)]
        after = [b + last_word_end(tok, f.text) for b, f in zip(base, group)]
        parts = ([y for x in seqs for y in x + [tok.eot] * (t - len(x))], [f.row for f in group], at,
                 [y for f in group for y in (*f.text, 0)], ends, after, [*tok.sentence_end_tokens, tok.eot])
        tokens, rows, at_d, targets, ends_d, after_d, stops = to_device(np.concatenate(parts), dev).split(
            [len(p) for p in parts])
        if graphed is not None:
            x, scores = self.passes.run(tokens.view(len(group), t), rows, graphed)
        else:
            x, scores = self.model.decoder.alignment_hidden(tokens.view(len(group), t), rows, self.cache,
                                                            self.alignment_heads)
        logits = self.model.decoder.alignment_logits(x, at_d)
        token_probs = logits[:, :tok.eot].softmax(dim=-1).gather(1, targets[:, None])[:, 0]
        # Over the text tokens and end-of-text (timestamps and other specials cannot follow here).
        end = logits[ends_d, :tok.eot + 1].softmax(dim=-1)[:, tok.eot]
        # Right after the last word's letters (where Whisper chose its final punctuation): the text stopping
        # (a full stop, question or exclamation mark, ellipsis, end-of-text) against more words or a comma.
        stop = logits[after_d, :tok.eot + 1].softmax(dim=-1)[:, stops].sum(-1)
        mats = [attention_matrix(scores[r, :, :len(seqs[r])], len(f.prefix), f.audio.shape[0] // HOP_LENGTH)
                if f.text else None for r, f in enumerate(group)]
        with_text = [m for m in mats if m is not None]
        warp = dtw_kernel.launch(with_text) if with_text and dtw_kernel.supported(dev) else None
        flat = torch.cat([token_probs.double(), end.double(), stop.double(),
                          *([warp.double().flatten()] if warp is not None else [m.double().flatten() for m in with_text])])
        yield  # the pass is launched
        flat = flat.cpu().numpy()  # its one readback
        n = len(at)
        probs, end_stop = flat[:n], list(zip(flat[n:n + len(group)].tolist(), flat[n + len(group):n + 2 * len(group)].tolist()))
        offset = n + 2 * len(group)
        if warp is not None:
            found = iter(dtw_kernel.paths(flat[offset:].reshape(warp.shape).astype(np.int64)))
            warps = [None if m is None else next(found) for m in mats]
        else:
            warps = []
            for m in mats:
                warps.append(None if m is None else flat[offset:offset + m.numel()].reshape(m.shape))
                offset += 0 if m is None else m.numel()
        token_probs = [probs[b:b + len(f.text)].tolist() for b, f in zip(base, group)]
        return token_probs, end_stop, warps

    def warm(self) -> None:
        """One forced word-timing pass on row 0 (warm-up's audio): a smart-turn caller's first pause asks
        for word timings, and on a GPU that first pass pays ~1 s of first-time kernel loading and set-up
        (later ones 100-160 ms under load). On a GPU the time warping's kernel is compiled for every block size
        here too, and the forced pass's graphs captured."""
        audio = np.zeros(SAMPLE_RATE, dtype=np.float32)
        text = self.tok.encode(" One, two, three.")
        if self.passes is not None:
            self.passes.capture()
        finish(self._align([_Forced.of(self.tok, 0, "en", "transcribe", text, [SegmentSpan(0.0, 1.0, text)], audio)]))
        dtw_kernel.warm(self.model.device)
