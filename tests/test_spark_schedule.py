"""How SparkTTSEngine splits its work into steps (each one bounded, so recognition on the same thread gets
the GPU between them), and that warm-up runs every shape serving meets."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.spark_fixtures import cached_spark_checkpoint
from voiced.engines.base import TTSOptions, TTSRequest
from voiced.engines.spark import lm_steps, streaming, vocoder_schedule, warmup
from voiced.engines.spark.bicodec import HOP
from voiced.engines.spark.engine import SparkTTSEngine
from voiced.engines.spark.streaming import (
    ChunkPlanner,
    DecodeJob,
    decode_jobs,
    decode_windows,
    padded_length,
    stream_decode,
)

MERGED = vocoder_schedule.VOCODER_MERGE_TOKENS  # the engine's default: merging on


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cached_spark_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(ckpt, tmp_path_factory):
    return SparkTTSEngine.load(ckpt, device="cpu", max_batch=8, max_seq_len=512,
                               voices_dir=tmp_path_factory.mktemp("voices"))


def _request(i: int, seconds: float = 1.6) -> TTSRequest:
    return TTSRequest(f"Reply number {i} is streaming now.", TTSOptions(seed=100 + i, max_seconds=seconds,
                                                                       first_chunk_tokens=4, chunk_tokens=6))


def _run(engine, requests: dict[int, TTSRequest], submit_at: dict[int, int] | None = None):
    """Step until done; returns ({id: audio}, [engine.last_step per step])."""
    got = {rid: [] for rid in requests}
    steps = []
    pending = dict(submit_at or {})
    for rid, r in requests.items():
        if rid not in pending:
            engine.submit(rid, r)
    while engine.has_work() or pending:
        for rid, at in list(pending.items()):
            if len(steps) >= at:
                engine.submit(rid, requests[rid])
                del pending[rid]
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id].append(out.value.samples)
        steps.append(dict(engine.last_step))
    return {rid: np.concatenate(a) for rid, a in got.items()}, steps


def test_a_step_does_one_bounded_kind_of_work(engine, monkeypatch):
    """8 requests streaming, 2 more arriving mid-stream: no step prefills and vocodes, or decodes and
    vocodes; a vocoder step decodes at most VOCODER_STEP_WINDOWS windows; a prefill step packs at most
    PREFILL_STEP_TOKENS (or one prompt); and the audio is what each request gives alone."""
    monkeypatch.setattr(vocoder_schedule, "VOCODER_STEP_WINDOWS", 3)
    monkeypatch.setattr(lm_steps, "PREFILL_STEP_TOKENS", 100)
    reqs = {i: _request(i) for i in range(1, 11)}
    alone = {rid: _run(engine, {rid: reqs[rid]})[0][rid] for rid in (1, 9)}
    audio, steps = _run(engine, reqs, submit_at={9: 16, 10: 17})
    kinds = [s["kind"] for s in steps]
    assert set(kinds) == {"prefill", "decode", "vocode"}
    for s in steps:
        assert sum(k in s for k in ("prefilled", "decoded_rows", "windows")) <= 1, s
        assert s.get("windows", 0) <= 3
        if s.get("prefilled", 0) > 1:
            assert s["prefill_tokens"] <= 100
    # 8 prompts of ~50 tokens at most 100 per step: the first admissions took several prefill steps
    assert sum(1 for s in steps[:20] if s["kind"] == "prefill") >= 3
    # with many requests streaming, no step did windows for all of them
    assert max(s.get("window_rows", 0) for s in steps) <= 3
    for rid in (1, 9):
        assert np.allclose(audio[rid], alone[rid], atol=1e-4), rid
    assert all(len(a) == 80 * HOP for a in audio.values())
    assert not engine.has_work()


def test_vocoder_serves_first_chunks_then_the_requests_closest_to_running_dry(engine, monkeypatch):
    monkeypatch.setattr(vocoder_schedule, "VOCODER_STEP_WINDOWS", 1)
    engine.submit(1, _request(1, 3.0))
    engine.submit(2, _request(2, 3.0))
    order = []
    while engine.has_work():
        outs = engine.step()
        if len(order) < 4:
            order += [o.request_id for o in outs if o.value.samples.size]
        if engine.last_step["kind"] == "vocode":
            assert engine.last_step["windows"] == 1
    assert sorted(order[:2]) == [1, 2]  # both first chunks before any second chunk


def test_a_request_landing_a_step_after_another_is_prefilled_at_the_next_step(engine):
    """Two callers ask at the same moment and one lands a step later (its door's transport a millisecond
    slower): it is prefilled at the very next step, not after the first's decode turn, so its first audio
    comes a step later, not a decode round later; the turns then go on, and each request's audio is what
    it gives alone."""
    reqs = {1: _request(1), 2: _request(2)}
    alone = {rid: _run(engine, {rid: reqs[rid]})[0][rid] for rid in reqs}
    audio, steps = _run(engine, reqs, submit_at={2: 1})
    assert [s["kind"] for s in steps[:3]] == ["prefill", "prefill", "decode"], steps[:3]
    assert steps[0]["prefilled"] == steps[1]["prefilled"] == 1
    assert steps[1]["out_of_turn"] and not steps[2]["out_of_turn"]
    for rid in reqs:
        assert np.allclose(audio[rid], alone[rid], atol=1e-4), rid


def test_requests_arriving_at_every_step_leave_the_decoding_rows_every_other_step(engine):
    """A new request before every step: each is prefilled out of turn at most every other step, so the
    rows already speaking keep their decode and vocoder turns, and every request's audio is unchanged."""
    reqs = {i: _request(i, 0.6) for i in range(1, 9)}
    alone = {rid: _run(engine, {rid: reqs[rid]})[0][rid] for rid in (1, 8)}
    audio, steps = _run(engine, reqs, submit_at={i: i - 1 for i in reqs})
    jumps = [s.get("out_of_turn", False) for s in steps]
    assert sum(jumps) >= 2, [s["kind"] for s in steps[:12]]
    assert not any(a and b for a, b in zip(jumps, jumps[1:]))
    kinds = [s["kind"] for s in steps]
    assert "decode" in kinds[:4]  # the first rows spoke while the others were still arriving
    for rid in (1, 8):
        assert np.allclose(audio[rid], alone[rid], atol=1e-4), rid


def test_prefill_padding_changes_nothing(ckpt):
    from voiced.engines.spark.served_lm import load_served_lm

    lm = load_served_lm(ckpt / "LLM", "cpu", torch.float32)
    torch.manual_seed(0)
    prompts = [torch.randint(0, 166000, (n,)) for n in (17, 5, 30)]
    lm.setup_cache(max_batch=4, max_seq=64)
    h = lm.prefill_many(prompts, [2, 0, 3])
    caches = [k.clone() for k in lm.k_caches]
    lm.setup_cache(max_batch=4, max_seq=64)
    hp = lm.prefill_many(prompts, [2, 0, 3], pad_to=64)  # 52 -> 64 tokens, past the end clamped
    assert torch.allclose(h, hp, atol=1e-5)
    for slot, p in zip((2, 0, 3), prompts):
        for a, b in zip(caches, lm.k_caches):
            assert torch.allclose(a[slot, :, : len(p)], b[slot, :, : len(p)], atol=1e-5)


@pytest.fixture(scope="module")
def codec(engine):
    return engine.codec


@torch.no_grad()
def test_end_masked_padded_window_equals_the_unpadded_decode(codec):
    torch.manual_seed(4)
    spk = codec.speaker_vector(torch.randint(0, 4096, (2, 32)))
    ids = torch.randint(0, 8192, (2, 48))
    exact = [codec.decode(ids[i : i + 1, :n], spk[i : i + 1])[0] for i, n in enumerate((37, 48))]
    padded = decode_windows(codec, ids, spk, [37, 48])
    assert torch.allclose(padded[0, : 37 * HOP], exact[0], atol=1e-4)
    assert torch.allclose(padded[1], exact[1], atol=1e-4)
    # without the mask the padding leaks into the end
    assert not torch.allclose(codec.decode(ids[:1], spk[:1])[0, : 37 * HOP], exact[0], atol=1e-3)


@torch.no_grad()
def test_last_window_stays_short_however_far_the_lm_ran_ahead(codec):
    r = codec.receptive_radius()
    planner = ChunkPlanner(r, 10, 25)
    windows = planner.windows(400, ended=True)
    assert max(w.end - w.start for w in windows) <= 25 + 2 * r
    assert windows[-1].final and windows[-1].keep_to == 400
    assert [w.keep_from for w in windows[1:]] == [w.keep_to for w in windows[:-1]]
    torch.manual_seed(5)
    ids = torch.randint(0, 8192, (400,))
    spk = codec.speaker_vector(torch.randint(0, 4096, (1, 32)))[0]
    joined = np.concatenate(decode_jobs(codec, [DecodeJob(ids, spk, w) for w in windows]))
    offline = codec.decode(ids[None], spk[None])[0].numpy()
    assert np.abs(joined - offline).max() < 1e-4


@pytest.mark.slow
def test_serving_meets_only_shapes_the_warmup_ran(engine, monkeypatch):
    """The CPU has no first-time costs, so warm-up skips it there; run its pieces here and check that a
    mixed workload (joins, ends, cancels, several chunk positions) decodes and prefills nothing else."""
    vocoder, prefill = set(), set()
    real_decode, real_prefill = streaming.decode_windows, engine.lm.prefill_many

    def rec_decode(codec, ids, spk, valid):
        vocoder.add(tuple(ids.shape))
        return real_decode(codec, ids, spk, valid)

    def rec_prefill(prompts, slots, pad_to=1, **kw):
        prefill.add(-(-sum(len(p) for p in prompts) // pad_to) * pad_to)
        return real_prefill(prompts, slots, pad_to, **kw)

    monkeypatch.setattr(streaming, "decode_windows", rec_decode)
    monkeypatch.setattr(engine.lm, "prefill_many", rec_prefill)
    # Merged windows up to 256 tokens, the long padding from 128 (1024 and 256 on a GPU: the CPU takes
    # minutes to warm those), and every reply may wait to merge (as if far ahead of real time), so that
    # long windows do come.
    monkeypatch.setattr(vocoder_schedule, "VOCODER_MERGE_TOKENS", 256)
    monkeypatch.setattr(streaming, "LONG_PAD_FROM", 128)
    monkeypatch.setattr(vocoder_schedule, "VOCODER_SLACK_S", -1e9)
    pick = engine._sampler([TTSOptions().top_k])
    assert warmup.warm_prefill(engine, pick) == len(prefill) == 512 // 64
    assert warmup.warm_vocoder(engine, 4, 6) == len(vocoder)
    warm_v, warm_p = set(vocoder), set(prefill)
    vocoder.clear(), prefill.clear()
    reqs = {i: _request(i, 0.5 + 0.3 * i) for i in range(1, 11)}
    _run(engine, reqs, submit_at={7: 5, 8: 20, 9: 21, 10: 40})
    assert vocoder and prefill
    assert vocoder <= warm_v, vocoder - warm_v
    assert prefill <= warm_p, prefill - warm_p
    assert max(length for _, length in vocoder) > 128  # merged windows, in the long padding's lengths


@pytest.mark.parametrize("radius, first, chunk", [(38, 4, 6), (5, 10, 25), (68, 10, 25)])
def test_planned_windows_release_every_token_once_within_their_length_cap(radius, first, chunk):
    """However the tokens arrive (one at a time, 8 per decode step, all at once) and whatever the merge
    cap, the released ranges tile the utterance in order, each window carries its full context (or
    stops at the utterance's edges), the first chunk is never merged, and no window is longer than the
    cap allows (a lone regular chunk always may be)."""
    n = 400
    regular = padded_length(max(first + radius, chunk + 2 * radius))
    for step in (1, 8, n):
        counts = {}
        for cap in (0, 128, 256, 1024):
            planner = ChunkPlanner(radius, first, chunk)
            windows = []
            for t in [*range(step, n, step), n]:
                for w in planner.windows(t, ended=t == n, max_len=cap):
                    assert w.start == max(0, w.keep_from - radius)
                    assert w.end == (t if w.final else w.keep_to + radius) and w.end <= t
                    assert padded_length(w.end - w.start) <= max(cap, regular)
                    windows.append(w)
            assert windows[0].keep_from == 0 and windows[0].keep_to == first
            assert [w.keep_from for w in windows[1:]] == [w.keep_to for w in windows[:-1]]
            assert windows[-1].keep_to == n and windows[-1].final
            counts[cap] = len(windows)
        if step > chunk:  # chunks come ready together: merging makes fewer windows
            assert counts[1024] <= counts[256] <= counts[128] < counts[0], counts
        if step == n:  # all ready at once: the cap decides
            assert counts[1024] < counts[256] < counts[128], counts


@torch.no_grad()
def test_merged_windows_give_the_offline_decode(codec):
    """Chunks released together in one window (the LM ran ahead) are the same audio, sample for sample
    within float32 rounding, as chunk-by-chunk streaming and as the whole-utterance decode."""
    torch.manual_seed(6)
    ids = torch.randint(0, 8192, (300,))
    g = torch.randint(0, 4096, (32,))
    offline = codec.detokenize(ids[None], g[None])[0].numpy()
    one_by_one = np.concatenate(stream_decode(codec, ids, g, 4, 6))
    assert np.abs(one_by_one - offline).max() < 1e-4
    for step, cap in ((8, 256), (40, 1024), (300, 256), (300, 1024)):
        chunks = stream_decode(codec, ids, g, 4, 6, step=step, max_len=cap)
        joined = np.concatenate(chunks)
        assert joined.shape == offline.shape
        assert np.abs(joined - offline).max() < 1e-4, (step, cap)
        assert np.abs(joined - one_by_one).max() < 1e-4, (step, cap)
        assert chunks[0].shape[0] == 4 * HOP and max(c.shape[0] for c in chunks) > 6 * HOP


def _stream(engine, reqs: dict[int, TTSRequest], submit_at: dict[int, int] | None = None):
    """Step `reqs` to the end (each submitted before step `submit_at[id]`, default the first); returns
    ({id: [chunk samples]}, {id: step of its first audio}, step kinds, the vocoder's work meanwhile)."""
    before = dataclasses.replace(engine.vocoder_work)
    got: dict[int, list[np.ndarray]] = {rid: [] for rid in reqs}
    first_at: dict[int, int] = {}
    kinds = []
    pending = {rid: (submit_at or {}).get(rid, 0) for rid in reqs}
    while engine.has_work() or pending:
        for rid, at in list(pending.items()):
            if len(kinds) >= at:
                engine.submit(rid, reqs[rid])
                del pending[rid]
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id].append(out.value.samples)
            if out.value.samples.size:
                first_at.setdefault(out.request_id, len(kinds))
        kinds.append(engine.last_step["kind"])
    work = {f.name: getattr(engine.vocoder_work, f.name) - getattr(before, f.name)
            for f in dataclasses.fields(before)}
    return got, first_at, kinds, work


@pytest.mark.slow
def test_merging_ready_chunks_cuts_vocoder_work_not_audio_or_first_audio(engine, monkeypatch):
    """Six replies streaming at once, the LM writing 8 tokens a step for each (more than a chunk) and the
    vocoder behind it (3 windows a step, as 64 replies on a GPU). With the ready chunks of a request
    merged into one window, the vocoder decodes far fewer tokens for each token of audio it releases, in
    fewer steps, and the replies finish sooner; when the replies are far ahead of real time their chunks
    also wait to grow into longer windows, and the LM's steps go back to back: fewer still. Every
    reply's audio is the same, and every first chunk leaves at the same step."""
    monkeypatch.setattr(vocoder_schedule, "VOCODER_STEP_WINDOWS", 3)
    reqs = {i: _request(i, 2.0) for i in range(1, 7)}
    runs = {}
    # (merge cap, slack): nobody counts as far ahead of real time (1e9), or everybody does (-1e9)
    for name, cap, slack in (("plain", 0, 1e9), ("merged", MERGED, 1e9),
                             ("waiting", MERGED, -1e9)):
        monkeypatch.setattr(vocoder_schedule, "VOCODER_MERGE_TOKENS", cap)
        monkeypatch.setattr(vocoder_schedule, "VOCODER_SLACK_S", slack)
        runs[name] = _stream(engine, reqs)
    plain = runs["plain"]
    for name, (got, first_at, kinds, work) in runs.items():
        for rid in reqs:
            a = np.concatenate(got[rid])
            assert a.shape == (100 * HOP,) and got[rid][0].shape == (4 * HOP,)
            assert np.allclose(a, np.concatenate(plain[0][rid]), atol=1e-4), (name, rid)
        assert first_at == plain[1], name
        assert work["audio_tokens"] == 600
    per_token = {name: run[3]["decoded_tokens"] / run[3]["audio_tokens"] for name, run in runs.items()}
    assert per_token["waiting"] < per_token["merged"] < 0.6 * per_token["plain"], per_token
    vocoder_steps = [run[3]["steps"] for run in runs.values()]
    all_steps = [len(run[2]) for run in runs.values()]
    assert vocoder_steps == sorted(set(vocoder_steps), reverse=True), vocoder_steps
    assert all_steps == sorted(set(all_steps), reverse=True), all_steps


def test_a_request_alone_is_stepped_the_same_whatever_the_clock(engine, monkeypatch):
    """Alone, a reply's steps and chunks do not depend on how far ahead of real time it is: the daemon
    and `voiced speak` give the same audio, chunk for chunk."""
    req = {1: _request(1, 2.0)}
    runs = []
    for slack in (1e9, -1e9):
        monkeypatch.setattr(vocoder_schedule, "VOCODER_SLACK_S", slack)
        runs.append(_stream(engine, req))
    (a, _, kinds_a, _), (b, _, kinds_b, _) = runs
    assert kinds_a == kinds_b
    assert [c.tobytes() for c in a[1]] == [c.tobytes() for c in b[1]]
