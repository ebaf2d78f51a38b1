"""A chunk of greedy steps read back and applied to its requests all at once (`token_choice.advance_greedy`,
`RequestDecoder.update_greedy_span`) against `update_greedy` token by token, the rule it replaces: the same
tokens, the same float32 log-probability sums to the bit, the same requests done, for requests that end on
end-of-text mid-chunk, fill their length limit or the text context mid-chunk, or start the chunk already near
either."""

from __future__ import annotations

import copy
import types

import numpy as np

from voiced.engines.whisper.decoding import RequestDecoder
from voiced.engines.whisper.token_choice import advance_greedy

EOT = 50257


def _request(rng: np.random.Generator, row: int) -> types.SimpleNamespace:
    d = RequestDecoder.__new__(RequestDecoder)
    d.tok = types.SimpleNamespace(eot=EOT)
    d.plan = types.SimpleNamespace(sample_len=int(rng.integers(1, 40)), beam_size=1)
    d.n_text_ctx = int(rng.integers(8, 60))
    d.initial = list(range(int(rng.integers(1, 6))))
    d.beams = [[int(t) for t in rng.integers(0, 50000, int(rng.integers(0, 20)))]]
    d.sum_logprobs = [np.float32(-rng.random() * 10)]
    d.done = False
    return types.SimpleNamespace(dec=d, rows=[row])


def _token_by_token(q, steps: list[tuple[float, float]]) -> None:
    for t, lp in steps:
        q.dec.update_greedy(int(t), lp)
        if q.dec.done:
            break


def test_a_chunk_applied_at_once_is_the_token_by_token_rule():
    rng = np.random.default_rng(0)
    for trial in range(300):
        n, k = int(rng.integers(1, 40)), int(rng.choice([1, 8, 32]))
        hist = np.empty((n, k, 2))
        hist[..., 0] = rng.integers(0, 50000, (n, k))
        hist[..., 1] = -rng.exponential(0.7, (n, k))
        for r in range(n):
            if rng.random() < 0.4:  # end-of-text somewhere in the chunk
                hist[r, rng.integers(0, k), 0] = EOT
        rows = rng.permutation(n)
        reqs = [_request(rng, int(rows[i])) for i in range(int(rng.integers(1, n + 1)))]
        want = copy.deepcopy(reqs)
        for q in want:
            _token_by_token(q, hist[q.rows[0]].tolist())
        assert advance_greedy(reqs, [q.rows[0] for q in reqs], hist) == []
        for got, exp in zip(reqs, want):
            assert got.dec.beams == exp.dec.beams, trial
            assert got.dec.done == exp.dec.done, trial
            s, e = got.dec.sum_logprobs[0], exp.dec.sum_logprobs[0]
            assert type(s) is np.float32 and s.tobytes() == e.tobytes(), (trial, s, e)
