"""Token choice for the rows of a batch: the per-request rules of `decoding.py` applied to a step's
logits for many requests at once, then the choice (greedy arg-max, or each beam request's top
candidates) with one device->host copy. `greedy_choice` is the same rule run on the device inside the
fused greedy step (no host round trip; `fast.DecoderSteps`)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from .decoding import NEG_INF, RequestDecoder, Suppression
from .model import KVCache


class Rows(Protocol):
    """A request in the batch: its decoder and the rows (beams) it holds."""

    dec: RequestDecoder
    rows: list[int]


def greedy_choice(logits: Tensor, always: Tensor, eot: int, minleft: Tensor) -> tuple[Tensor, Tensor]:
    """On the device: the always-suppressed ids, no end-of-text while a row's minimum-length
    countdown is positive, then arg-max. Returns (tokens, their log-probabilities); `logits` is
    filtered in place."""
    logits.masked_fill_(always, NEG_INF)
    logits[:, eot] = torch.where(minleft > 0, NEG_INF, logits[:, eot])
    nxt = logits.argmax(dim=-1)
    return nxt, torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None])[:, 0]


def choose_tokens(logits: Tensor, reqs: list[Rows], base: int, suppress: Suppression, eot: int,
                  cache: KVCache) -> list[tuple[Rows, Exception]]:
    """Filter the logits of `reqs` (row r at logits[r - base]), pick tokens, advance them (a beam
    request's reordered beams move their self-attention caches); returns the requests whose tokens
    failed (the others have advanced)."""
    dev = logits.device
    logits.masked_fill_(suppress.always, NEG_INF)
    # The per-request rules, batched: one indexing op for all first steps (no blank / end-of-text
    # first) and one for all rows still under their minimum length; timestamp rules per request.
    first = [r - base for q in reqs if q.dec.n_sampled == 0 for r in q.rows]
    if first:
        logits[torch.tensor(first, device=dev)[:, None], torch.tensor(suppress.blank, device=dev)] = NEG_INF
    short = [r - base for q in reqs if q.dec.n_sampled < q.dec.plan.min_new_tokens for r in q.rows]
    if short:
        logits[torch.tensor(short, device=dev), eot] = NEG_INF
    for req in reqs:
        if req.dec.plan.timestamps:
            idx = torch.tensor(req.rows, device=dev) - base
            sub = logits[idx]
            req.dec.timestamp_rules(sub)
            logits[idx] = sub
    greedy = logits.argmax(dim=-1)
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen_lp = logprobs.gather(1, greedy[:, None])[:, 0]
    beam_tops: dict[int, tuple[list, list]] = {}
    for k in sorted({r.dec.plan.beam_size for r in reqs if r.dec.plan.beam_size > 1}):
        rows = [x for r in reqs if r.dec.plan.beam_size == k for x in r.rows]
        vals, ids = logprobs[torch.tensor(rows, device=dev) - base].topk(k + 1, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        for i, row in enumerate(rows):
            beam_tops[row] = (vals[i], ids[i])
    greedy_l, lp_l = greedy.tolist(), chosen_lp.tolist()
    failed = []
    for req in reqs:
        d = req.dec
        try:
            if d.plan.beam_size == 1:
                r = req.rows[0] - base
                d.update_greedy(greedy_l[r], lp_l[r])
            else:
                src = d.update_beam([beam_tops[r][0] for r in req.rows], [beam_tops[r][1] for r in req.rows])
                if not d.done and src != list(range(len(src))):
                    dst = torch.tensor(req.rows, device=dev)
                    cache.move(dst, dst[torch.tensor(src, device=dev)], self_only=True)
        except Exception as e:  # this request's tokens: its fault alone
            failed.append((req, e))
    return failed
