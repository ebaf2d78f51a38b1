"""Token choice for the rows of a batch: the per-request rules of `decoding.py` applied to a step's
logits for many requests at once, then the choice (greedy arg-max, or each beam request's top
candidates) with one device->host copy. `greedy_choice` is the same rule run on the device inside the
fused greedy step (no host round trip; `decoder_steps.DecoderSteps`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from voiced.engines.rows import to_device

from .decoding import NEG_INF, RequestDecoder, Suppression
from .model import KVCache


class Rows(Protocol):
    """A request in the batch: its decoder and the rows (beams) it holds."""

    dec: RequestDecoder
    rows: list[int]


def _span(rows: list[int]) -> slice | None:
    """`rows` as a slice where they are consecutive and ascending (an admission's rows usually are), so the
    rule indexes a view instead of sending an index list to the device: fewer PyTorch calls, each of which
    waits for the GIL under load, and the same elements set."""
    lo = rows[0]
    return slice(lo, lo + len(rows)) if rows == list(range(lo, lo + len(rows))) else None


def greedy_choice(logits: Tensor, always: Tensor, eot: int, minleft: Tensor) -> tuple[Tensor, Tensor]:
    """On the device: the always-suppressed ids, no end-of-text while a row's minimum-length
    countdown is positive, then arg-max. Returns (tokens, their log-probabilities); `logits` is
    filtered in place."""
    logits.masked_fill_(always, NEG_INF)
    logits[:, eot] = torch.where(minleft > 0, NEG_INF, logits[:, eot])
    nxt = logits.argmax(dim=-1)
    return nxt, torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None])[:, 0]


def greedy_advance(logits: Tensor, always: Tensor, eot: int, inputs: Tensor, lp: Tensor) -> None:
    """`greedy_choice` and the step's bookkeeping, in place: `inputs` [3, B] (tokens, positions, minimum-length
    countdowns) take the chosen tokens as the next step's, their positions advance and their countdowns tick;
    `lp` [B] takes the chosen tokens' log-probabilities. A row whose token is end-of-text keeps it (what it
    computes after its end is read by no one), so a step can tell that all of its rows have ended from its
    tokens alone (`FastDecoder.greedy_step`). One function so that it compiles into a few kernels
    on a GPU (`DecoderSteps`'s compiled tail) where eagerly it is ~12."""
    tok, pos, minleft = inputs.unbind(0)
    nxt, chosen = greedy_choice(logits, always, eot, minleft)
    lp.copy_(chosen)
    tok.copy_(torch.where(tok == eot, tok, nxt))
    pos.add_(1)
    minleft.sub_(1)


@dataclass
class Choice:
    """A step's token choice launched on the device (`launch_choice`), its results on their way to the host."""

    greedy: Tensor  # [rows] the arg-max tokens, on the device (what a greedy request takes)
    host: Tensor  # everything the host reads, in one float64 copy (see launch_choice)
    landed: torch.cuda.Event | None  # when `host` holds them (None: the CPU, where it already does)
    beams: list[tuple[int, list[int]]]  # (beam size, its rows), in the order of their parts in `host`
    no_speech: bool


def launch_choice(logits: Tensor, reqs: list[Rows], base: int, suppress: Suppression, eot: int,
                  no_speech: Tensor | None = None) -> Choice:
    """Filter the logits of `reqs` (row r at logits[r - base]) and pick their tokens on the device, then queue
    the copy of what the host reads (greedy tokens, their log-probabilities, the beams' candidates, the no-speech
    probabilities: float64 holds the ids and the float32 values exactly) without waiting for it: the caller can
    queue more work (the next chunk of steps) before `apply_choice` reads the choice. Row indices reach the device
    without a sync (`rows.to_device`), and -inf is written from the device (`Suppression.neg_inf`), never as a host
    scalar, whose copy would wait for the stream."""
    dev = logits.device
    logits.masked_fill_(suppress.always, NEG_INF)
    # The per-request rules, batched: one indexing op for all first steps (no blank / end-of-text
    # first) and one for all rows still under their minimum length; timestamp rules per request.
    first = [r - base for q in reqs if q.dec.n_sampled == 0 for r in q.rows]
    if first:
        at = _span(first)
        logits[at if at is not None else to_device([[r] for r in first], dev), suppress.blank] = suppress.neg_inf
    short = [r - base for q in reqs if q.dec.n_sampled < q.dec.plan.min_new_tokens for r in q.rows]
    if short:
        at = _span(short)
        logits[at if at is not None else to_device(short, dev), eot] = suppress.neg_inf
    for req in reqs:
        if req.dec.plan.timestamps:
            idx = to_device([r - base for r in req.rows], dev)
            sub = logits[idx]
            req.dec.timestamp_rules(sub)
            logits[idx] = sub
    greedy = logits.argmax(dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen_lp = logprobs.gather(1, greedy[:, None])[:, 0]
    parts = [greedy.double(), chosen_lp.double()]
    beams = []  # (beam size, its rows)
    for k in sorted({r.dec.plan.beam_size for r in reqs if r.dec.plan.beam_size > 1}):
        rows = [x for r in reqs if r.dec.plan.beam_size == k for x in r.rows]
        vals, ids = logprobs[to_device([x - base for x in rows], dev)].topk(k + 1, dim=-1)
        parts += [vals.double().flatten(), ids.double().flatten()]
        beams.append((k, rows))
    if no_speech is not None:
        parts.append(no_speech.double())
    host = torch.cat(parts).to("cpu", non_blocking=True)  # (pinned, from a CUDA device)
    landed = None
    if logits.is_cuda:
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(dev))
    return Choice(greedy, host, landed, beams, no_speech is not None)


def apply_choice(choice: Choice, reqs: list[Rows], base: int, cache: KVCache) -> list[tuple[Rows, Exception]]:
    """Read a launched choice back (the step's one sync) and advance `reqs` by it (a beam request's reordered beams
    move their self-attention caches); the no-speech probabilities, where the choice carried them (an
    admission's), are set on each request's decoder. Returns the requests whose tokens failed (the others have
    advanced)."""
    if choice.landed is not None:
        choice.landed.synchronize()
    host = choice.host.tolist()
    n = choice.greedy.shape[0]
    greedy_l, lp_l, at = [int(t) for t in host[:n]], host[n:2 * n], 2 * n
    beam_tops: dict[int, tuple[list, list]] = {}
    for k, rows in choice.beams:
        size = len(rows) * (k + 1)
        vals, ids = host[at:at + size], host[at + size:at + 2 * size]
        at += 2 * size
        for i, row in enumerate(rows):
            beam_tops[row] = (vals[i * (k + 1):(i + 1) * (k + 1)], [int(t) for t in ids[i * (k + 1):(i + 1) * (k + 1)]])
    if choice.no_speech:
        for req in reqs:
            req.dec.no_speech_prob = host[at + req.rows[0] - base]
    failed = []
    moves_to: list[int] = []
    moves_from: list[int] = []
    for req in reqs:
        d = req.dec
        try:
            if d.plan.beam_size == 1:
                r = req.rows[0] - base
                d.update_greedy(greedy_l[r], lp_l[r])
            else:
                src = d.update_beam([beam_tops[r][0] for r in req.rows], [beam_tops[r][1] for r in req.rows])
                if not d.done and src != list(range(len(src))):
                    moves_to += req.rows
                    moves_from += [req.rows[s] for s in src]
        except Exception as e:  # this request's tokens: its fault alone
            failed.append((req, e))
    if moves_to:  # every reordered request's beams in one move (their rows are disjoint)
        dev = choice.greedy.device
        cache.move(to_device(moves_to, dev), to_device(moves_from, dev), self_only=True)
    return failed


def choose_tokens(logits: Tensor, reqs: list[Rows], base: int, suppress: Suppression, eot: int,
                  cache: KVCache, no_speech: Tensor | None = None) -> list[tuple[Rows, Exception]]:
    """Filter the logits of `reqs` (row r at logits[r - base]), pick tokens and advance them: `launch_choice`, then
    `apply_choice` at once. Returns the requests whose tokens failed (the others have advanced)."""
    return apply_choice(launch_choice(logits, reqs, base, suppress, eot, no_speech), reqs, base, cache)


def advance_greedy(reqs: list[Rows], rows: list[int], hist: np.ndarray) -> list[tuple[Rows, Exception]]:
    """A chunk of greedy steps read back, applied to its requests as `RequestDecoder.update_greedy` token by
    token would (`update_greedy_span`): hist [rows, steps, (token, log-probability)] float64, reqs[i]'s at row
    rows[i] (where it was when the chunk ran: the engine may have moved it since). The log-probability sums of
    every row after each step are made at once in numpy, one float32 addition at a time as update_greedy adds
    them, so a request costs one call, not one per token (~5 ms of idle GPU per chunk at 256 rows). Returns the
    requests whose tokens failed; the others have advanced."""
    n = hist.shape[0]
    starts = np.zeros((n, 1), dtype=np.float32)
    for q, r in zip(reqs, rows):
        starts[r, 0] = q.dec.sum_logprobs[0]
    # sums[r, j]: row r's sum after j of its tokens (a cumulative sum along a row adds in order, in float32)
    sums = np.cumsum(np.concatenate([starts, hist[..., 1].astype(np.float32)], axis=1), axis=1, dtype=np.float32)
    tokens = hist[..., 0].astype(np.int64).tolist()
    failed = []
    for q, r in zip(reqs, rows):
        try:
            q.dec.update_greedy_span(tokens[r], sums[r])
        except Exception as e:  # this request's tokens: its fault alone
            failed.append((q, e))
    return failed
