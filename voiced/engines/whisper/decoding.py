"""Decoding rules for one request, independent of how requests are batched.

The engine runs the network for many requests at once; everything that is *per request* lives
here, as small pieces in openai-whisper's spirit (logit filters, a greedy and a beam token
decoder), and follows its rules to the token:

* initial tokens: [<|startofprev|> prompt...] <|startoftranscript|> [<|lang|> <|task|>]
  [<|notimestamps|>];
* suppression: the non-speech symbols plus the task/control tokens and <|nospeech|> at every step,
  a blank or end-of-text as the very first token, and the timestamp pairing rules;
* greedy takes the arg-max of the filtered logits; beam search ranks prefixes by summed float32
  log-probabilities, keeps `beam` live hypotheses and collects finished ones until it has `beam`;
* the result is the finished sequence with the best length-normalised score; avg_logprob is
  sum / (tokens + 1) (the end token counts), compression_ratio is zlib's on the text's UTF-8.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from voiced.engines.base import ASROptions, EngineError, Segment, Transcript

from .tokenizer import TIMESTAMP_SECONDS, WhisperTokenizer, normalize_language

MAX_BEAM = 8
NEG_INF = float("-inf")


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


@dataclass
class Suppression:
    """Per-model suppression: the always-suppressed ids as a vocabulary mask, and the blank ids."""

    always: Tensor  # bool [vocab]
    blank: Tensor  # long: " " and <|endoftext|>, never the first sampled token (on the device, made once)
    # -inf as a float32 scalar on the device, the value suppressed logits are set to by indexing: a Python float
    # there is copied from the host with a wait for everything queued on the stream (index_put_'s scalar copy)
    neg_inf: Tensor

    @classmethod
    def build(cls, tok: WhisperTokenizer, n_vocab: int, device: torch.device | str) -> Suppression:
        ids = set(tok.non_speech_tokens)
        # Control tokens are chosen by the prompt, never sampled; <|nospeech|> is read off the
        # distribution at <|startoftranscript|> instead.
        ids |= {tok.transcribe, tok.translate, tok.sot, tok.sot_prev, tok.sot_lm, tok.no_speech}
        mask = torch.zeros(n_vocab, dtype=torch.bool)
        mask[sorted(ids)] = True
        return cls(mask.to(device), torch.tensor(tok.encode(" ") + [tok.eot], dtype=torch.long, device=device),
                   torch.tensor(NEG_INF, device=device))


@dataclass
class DecodePlan:
    """What one request asks for, checked and turned into token terms."""

    language: str | None  # None until detected
    task: str
    beam_size: int
    timestamps: bool
    prompt_tokens: list[int]
    sample_len: int
    min_new_tokens: int
    options: ASROptions

    @classmethod
    def from_options(cls, opts: ASROptions, tok: WhisperTokenizer, n_text_ctx: int) -> DecodePlan:
        if opts.task not in ("transcribe", "translate"):
            raise EngineError(f"task must be 'transcribe' or 'translate', not {opts.task!r}")
        if not 1 <= opts.beam_size <= MAX_BEAM:
            raise EngineError(f"beam_size must be between 1 and {MAX_BEAM}, not {opts.beam_size}")
        language = None
        if opts.language:
            try:
                language = normalize_language(opts.language)
            except ValueError as e:
                raise EngineError(str(e)) from None
        if not tok.multilingual:
            if language not in (None, "en"):
                raise EngineError(f"this model is English-only; it cannot take language {opts.language!r}")
            if opts.task == "translate":
                raise EngineError("this model is English-only; it cannot translate")
            language = "en"
        elif language is not None and language not in tok.language_codes:
            raise EngineError(f"language {language!r} is not supported by this model")
        prompt = tok.encode(" " + opts.initial_prompt.strip()) if opts.initial_prompt else []
        # The prompt may fill at most half the context (minus <|startofprev|>): its latest tokens.
        prompt = prompt[-(n_text_ctx // 2 - 1):]
        sample_len = opts.max_new_tokens if opts.max_new_tokens is not None else n_text_ctx // 2
        if sample_len < 1:
            raise EngineError(f"max_new_tokens must be at least 1, not {sample_len}")
        min_new = max(0, int(opts.min_new_tokens or 0))
        return cls(language, opts.task, opts.beam_size, opts.timestamps, prompt, sample_len, min_new, opts)

    def initial_tokens(self, tok: WhisperTokenizer) -> list[int]:
        seq = tok.sot_sequence(self.language, self.task)
        if not self.timestamps:
            seq = seq + [tok.no_timestamps]
        if self.prompt_tokens:
            seq = [tok.sot_prev, *self.prompt_tokens, *seq]
        return seq


@dataclass
class RequestDecoder:
    """Token selection for one request over its `beam_size` rows."""

    tok: WhisperTokenizer
    plan: DecodePlan
    n_text_ctx: int
    n_audio_ctx: int
    initial: list[int] = field(default_factory=list)
    sot_index: int = 0
    beams: list[list[int]] = field(default_factory=list)  # sampled tokens per live row
    sum_logprobs: list[np.float32] = field(default_factory=list)
    finished: dict[tuple[int, ...], float] = field(default_factory=dict)  # beam search only
    done: bool = False
    no_speech_prob: float = float("nan")
    language_probs: dict[str, float] | None = None

    def start(self, language: str) -> list[int]:
        self.plan.language = language
        self.initial = self.plan.initial_tokens(self.tok)
        self.sot_index = self.initial.index(self.tok.sot)
        self.beams = [[] for _ in range(self.plan.beam_size)]
        self.sum_logprobs = [np.float32(0.0) for _ in range(self.plan.beam_size)]
        return self.initial

    # ---------------------------------------------------------------- per-step state the engine asks for
    @property
    def n_sampled(self) -> int:
        return len(self.beams[0])

    def last_tokens(self) -> list[int]:
        return [b[-1] for b in self.beams]

    def position(self) -> int:
        """Position of the token fed at the next decoder step (all rows of a request share it)."""
        return len(self.initial) + self.n_sampled - 1

    # ---------------------------------------------------------------------------------- logit filters
    # The engine applies the suppression set, the first-token blank rule and the minimum-length rule
    # batched over all rows (Suppression, min_new_tokens); the timestamp rules depend on each row's
    # history and run here, per request.
    def timestamp_rules(self, logits: Tensor) -> None:
        """openai-whisper's timestamp rules for this request's rows [rows, vocab], in place."""
        tok, tb = self.tok, self.tok.timestamp_begin
        first = self.n_sampled == 0
        logits[:, tok.no_timestamps] = NEG_INF
        for r, seq in enumerate(self.beams):
            last_ts = len(seq) >= 1 and seq[-1] >= tb
            penult_ts = len(seq) < 2 or seq[-2] >= tb
            # Timestamps come in pairs (segment end, next start), except right before the end token.
            if last_ts:
                if penult_ts:
                    logits[r, tb:] = NEG_INF  # a pair just closed: text (or end) must follow
                else:
                    logits[r, : tok.eot] = NEG_INF  # an opened pair: no plain text now
            stamps = [t for t in seq if t >= tb]
            if stamps:
                # Time never runs backwards, and a segment must have nonzero length.
                upto = stamps[-1] if (last_ts and not penult_ts) else stamps[-1] + 1
                logits[r, tb:upto] = NEG_INF
        if first:
            logits[:, :tb] = NEG_INF  # the first token is a timestamp...
            max_initial = round(1.0 / (30.0 / self.n_audio_ctx))  # ...no later than 1 s
            logits[:, tb + max_initial + 1:] = NEG_INF
        # When the timestamps together outweigh the likeliest text token, take a timestamp.
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        ts_mass = logprobs[:, tb:].logsumexp(dim=-1)
        best_text = logprobs[:, :tb].max(dim=-1).values
        logits[:, :tb].masked_fill_((ts_mass > best_text)[:, None], NEG_INF)

    # ------------------------------------------------------------------------------ token decoders
    def update_greedy(self, token: int, logprob: float) -> None:
        seq = self.beams[0]
        seq.append(token)
        self.sum_logprobs[0] = np.float32(self.sum_logprobs[0] + np.float32(logprob))
        if token == self.tok.eot or self._out_of_room():
            self.done = True

    def update_greedy_span(self, tokens: list[int], sums: np.ndarray) -> None:
        """`update_greedy` for each of `tokens` in turn, up to where it would stop (end-of-text, or the token that
        fills the room); sums[j] is the float32 log-probability sum after the first j of them (sums[0] the
        current one), as update_greedy's additions make it (`token_choice.advance_greedy`)."""
        if not tokens:
            return
        room = self.room()
        t = min(len(tokens), max(1, room))
        eot = self.tok.eot
        if eot in tokens[:t]:
            t = tokens.index(eot) + 1
        self.beams[0].extend(tokens[:t])
        self.sum_logprobs[0] = np.float32(sums[t])
        if tokens[t - 1] == eot or t >= room:
            self.done = True

    def update_beam(self, top_logprobs: list[list[float]], top_tokens: list[list[int]]) -> list[int]:
        """One beam-search step from each row's top (beam + 1) candidates.

        Returns, per new row, the index of the old row it continues (for reordering KV caches).
        """
        k, eot = self.plan.beam_size, self.tok.eot
        scores: dict[tuple[int, ...], np.float32] = {}
        sources: dict[tuple[int, ...], int] = {}
        for j, prefix in enumerate(self.beams):
            for lp, t in zip(top_logprobs[j], top_tokens[j]):
                seq = (*prefix, t)
                scores[seq] = np.float32(self.sum_logprobs[j] + np.float32(lp))
                sources[seq] = j
        new_beams: list[list[int]] = []
        new_sums: list[np.float32] = []
        src: list[int] = []
        newly_finished: dict[tuple[int, ...], float] = {}
        for seq in sorted(scores, key=scores.get, reverse=True):  # stable: ties keep row order
            if seq[-1] == eot:
                newly_finished[seq] = float(scores[seq])
            else:
                new_beams.append(list(seq))
                new_sums.append(scores[seq])
                src.append(sources[seq])
                if len(new_beams) == k:
                    break
        for seq in sorted(newly_finished, key=newly_finished.get, reverse=True):
            if len(self.finished) >= k:
                break
            self.finished[seq] = newly_finished[seq]
        self.beams, self.sum_logprobs = new_beams, new_sums
        if len(self.finished) >= k or self._out_of_room():
            self.done = True
        return src

    def room(self) -> int:
        """Tokens this request may still sample: the one that leaves none (its sample_len, or the text context
        full) is its last."""
        n = self.n_sampled
        return min(self.plan.sample_len - n, self.n_text_ctx + 1 - len(self.initial) - n)

    def _out_of_room(self) -> bool:
        return self.room() <= 0

    # ------------------------------------------------------------------------------------- results
    def result(self, audio_seconds: float) -> Transcript:
        tok, eot = self.tok, self.tok.eot
        if self.plan.beam_size == 1:
            candidates = {tuple(self.beams[0]): float(self.sum_logprobs[0])}
        else:
            candidates = dict(self.finished)
            if len(candidates) < self.plan.beam_size:
                # Not enough finished: top up with the live hypotheses, best first.
                order = np.argsort(np.array(self.sum_logprobs, dtype=np.float32))[::-1]
                for j in order:
                    candidates[(*self.beams[j], eot)] = float(self.sum_logprobs[j])
                    if len(candidates) >= self.plan.beam_size:
                        break
        seqs = [list(s[: s.index(eot)]) if eot in s else list(s) for s in candidates]
        sums = list(candidates.values())
        # Rank by log-probability per token (the end token not counted), first best on ties.
        best = int(np.argmax([lp / max(len(s), 1) for s, lp in zip(seqs, sums)]))
        tokens, sum_lp = seqs[best], sums[best]
        text = tok.decode(tokens).strip()
        avg = sum_lp / (len(tokens) + 1)
        cr = compression_ratio(text)
        o = self.plan.options
        halluc = (o.compression_ratio_threshold is not None and cr > o.compression_ratio_threshold) or (
            o.no_speech_threshold is not None and o.logprob_threshold is not None
            and self.no_speech_prob > o.no_speech_threshold and avg < o.logprob_threshold)
        segments = self._segments(tokens, audio_seconds) if self.plan.timestamps else []
        return Transcript(text=text, language=self.plan.language or "en", tokens=tokens, avg_logprob=avg,
                          no_speech_prob=self.no_speech_prob, compression_ratio=cr, is_hallucination=bool(halluc),
                          segments=segments, language_probs=self.language_probs)

    def _segments(self, tokens: list[int], audio_seconds: float) -> list[Segment]:
        """Cut at timestamp tokens: <|t0|> text <|t1|><|t1|> text <|t2|> ..."""
        tb = self.tok.timestamp_begin
        out: list[Segment] = []
        start: float | None = None
        text_tokens: list[int] = []
        for t in tokens:
            if t >= tb:
                time = (t - tb) * TIMESTAMP_SECONDS
                if start is not None and text_tokens:
                    out.append(Segment(start, time, self.tok.decode(text_tokens).strip(), text_tokens))
                    start, text_tokens = None, []
                else:
                    start = time
            else:
                if start is None:
                    start = out[-1].end if out else 0.0
                text_tokens.append(t)
        if text_tokens:
            out.append(Segment(start or 0.0, max(audio_seconds, start or 0.0), self.tok.decode(text_tokens).strip(),
                               text_tokens))
        return out
