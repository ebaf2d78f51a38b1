"""Decode-ahead (`WhisperRuntime.decode_ahead`, on a GPU): the next chunk of greedy steps is
launched from the inputs the last one left on the device before the host reads that one back. On the CPU with the
engine's own chunk loop (the steps run eagerly, the same code path as the GPU's apart from the graphs): callers get
the transcripts they get without it, whether their requests end at end-of-text or at their length limit mid-chunk,
others come and go while a chunk is in flight, or one is cancelled; the chunk launched ahead never runs a row past
its room and never waits for a queued request's admission."""

from __future__ import annotations

import numpy as np
import pytest

from tests.whisper_fixtures import make_openai_checkpoint
from voiced.engines.base import ASROptions, ASRRequest
from voiced.engines.whisper.engine import WhisperEngine


@pytest.fixture(scope="module")
def free_ckpt(tmp_path_factory):
    """A checkpoint whose texts end early at end-of-text (free lengths, well inside 40 tokens)."""
    return make_openai_checkpoint(tmp_path_factory.mktemp("free"), seed=5, eot_boost=8.0)


@pytest.fixture(scope="module")
def clips():
    rng = np.random.default_rng(1)
    return [(0.1 * rng.standard_normal(8000 * (1 + i % 4))).astype(np.float32) for i in range(7)]


def _engine(ckpt, ahead: bool, max_batch: int, chunk: int = 4) -> tuple[WhisperEngine, list]:
    """A CPU engine with chunks of `chunk` steps; with `ahead`, the chunks it launches before reading the last
    recorded as (kind, steps, the room each row has left for them, whether requests waited): "ahead" of another
    chunk, or "first" right after an admission's token choice, before it is read."""
    eng = WhisperEngine.load(ckpt, max_batch=max_batch, decode_chunk=chunk, decode_ahead=ahead)
    assert eng.runtime.decode_ahead is ahead
    launched: list[tuple[str, int, list[int], bool]] = []
    real_ahead, real_first = eng._launch_ahead, eng._launch_first_chunk

    def launch_ahead(chunk):
        rooms = [q.dec.room() - chunk.steps for q in chunk.reqs]
        nxt = real_ahead(chunk)
        if nxt is not None:
            launched.append(("ahead", nxt.steps, rooms, bool(eng._queue)))
        return nxt

    def launch_first(choice, base):
        rooms = [eng._owner[r][0].dec.room() - (r >= base) for r in range(eng._n)]
        nxt = real_first(choice, base)
        if nxt is not None:
            launched.append(("first", nxt.steps, rooms, False))
        return nxt

    eng._launch_ahead, eng._launch_first_chunk = launch_ahead, launch_first
    return eng, launched


def _results(eng: WhisperEngine, clips, opts: list[ASROptions], arrive_every: int = 0,
             cancel: tuple[int, int] | None = None) -> dict:
    """Serve request i (clip i, options i): all at once, or one more every `arrive_every` steps; `cancel`
    (request, step): that request is cancelled before that step. Each served request's (tokens, avg_logprob, the
    engine step that answered it)."""
    out, submitted, step = {}, 0, 0
    while submitted < len(opts) or eng.has_work():
        if cancel is not None and step == cancel[1]:
            eng.cancel(cancel[0])
        while submitted < len(opts) and (not arrive_every or submitted <= step // arrive_every):
            eng.submit(submitted, ASRRequest(clips[submitted], opts[submitted]))
            submitted += 1
        for o in eng.step():
            assert o.error is None, o.error
            out[o.request_id] = (o.value.tokens, o.value.avg_logprob, step)
        step += 1
    return out


def _same(got: dict, want: dict) -> bool:
    """The same requests served the same tokens; their average log-probabilities to float32 rounding (a chunk
    launched ahead can run a row beside other rows than the chunk the host launches after it, and a product over
    other rows may round its last bits otherwise, on a GPU as here)."""
    return got.keys() == want.keys() and all(
        got[i][0] == want[i][0] and got[i][1] == pytest.approx(want[i][1], rel=1e-5) for i in want)


def test_chunks_decoded_ahead_serve_the_same_transcripts_as_chunks_read_one_by_one(free_ckpt, clips):
    """Requests that end at end-of-text mid-chunk, more of them than rows (so rows are freed and taken while a
    chunk launched ahead is in flight), some arriving while others decode: the same tokens (and log-probabilities
    to rounding) as without decode-ahead, and chunks were launched ahead (never while requests waited)."""
    # (some at least a few tokens long: their end-of-text waits for a countdown the chunks carry on the device)
    opts = [ASROptions(language="en", max_new_tokens=40, min_new_tokens=(0, 3, 6)[i % 3]) for i in range(len(clips))]
    for arrive_every in (0, 2):
        want = _results(_engine(free_ckpt, False, 3)[0], clips, opts, arrive_every)
        assert len(want) == len(clips) and min(len(want[i][0]) for i in range(len(clips))) < 20  # ended at end-of-text
        eng, launched = _engine(free_ckpt, True, 3)
        got = _results(eng, clips, opts, arrive_every)
        assert _same(got, want), f"arriving every {arrive_every} steps"
        # and none later, counted in engine steps
        assert all(got[i][2] <= want[i][2] for i in want), (got, want)
        assert {kind for kind, _, _, _ in launched} == {"ahead", "first"}
        assert not any(waiting for kind, _, _, waiting in launched if kind == "ahead")


def test_a_chunk_launched_ahead_stops_at_the_rows_length_limit(tmp_path, clips):
    """Forced lengths (end-of-text suppressed until each request's max_new_tokens): the chunk launched ahead is
    cut to the room its rows have left, and the tokens are the ones served without decode-ahead."""
    ckpt = make_openai_checkpoint(tmp_path, seed=5)
    lengths = [13, 20, 9, 6, 2]  # after the admission's first token: 12, 19, 8, 5 and 1 to go in chunks of 4
    opts = [ASROptions(language="en", max_new_tokens=t, min_new_tokens=t) for t in lengths]
    want = _results(_engine(ckpt, False, 4)[0], clips, opts, arrive_every=3)
    assert [len(want[i][0]) for i in range(len(lengths))] == lengths
    eng, launched = _engine(ckpt, True, 4)
    assert _same(_results(eng, clips, opts, arrive_every=3), want)
    assert all(0 < steps <= min(rooms) for _, steps, rooms, _ in launched), launched
    assert any(steps < 4 for kind, steps, _, _ in launched if kind == "ahead"), "none cut to its rows' room"
    assert any(steps == 1 for kind, steps, _, _ in launched if kind == "first"), "none cut to a row's one token"


def test_a_request_cancelled_while_a_chunk_is_in_flight_leaves_the_others_as_they_were(free_ckpt, clips):
    """Cancelling a request while the chunk launched ahead still holds its row: the others are served what
    they are served when the same request is cancelled without decode-ahead, and the cancelled one never
    answers."""
    opts = [ASROptions(language="en", max_new_tokens=40, min_new_tokens=30) for _ in range(3)]
    cancel = (1, 3)  # after its admission and two chunks
    want = _results(_engine(free_ckpt, False, 3)[0], clips, opts, cancel=cancel)
    eng, launched = _engine(free_ckpt, True, 3)
    got = _results(eng, clips, opts, cancel=cancel)
    assert _same(got, want) and set(got) == {0, 2}
    assert launched


def test_a_cpu_engine_decodes_ahead_only_when_asked(free_ckpt):
    """A CPU engine never decodes ahead unless asked: its steps run on the host's own time, so a chunk ahead only
    adds steps nobody reads (a GPU engine does by default: tests/test_whisper_fast.py's runtime test)."""
    assert not WhisperEngine.load(free_ckpt, max_batch=2).runtime.decode_ahead
