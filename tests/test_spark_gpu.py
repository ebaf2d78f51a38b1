"""GPU-only checks of the Spark-TTS engine (skipped without CUDA), on a tiny random checkpoint in the
published layout: the compiled, graphed decode steps against ungraphed and eager steps; streamed audio
against the offline decode of the same tokens; a request's results alone against with batch mates;
cancellation.

The served engine runs bf16 (LM and BiCodec), compiled decode/prefill layers and CUDA graphs, warmed up
as `voiced serve` warms it. The project's bound for streamed against offline audio in bf16 is 2e-3
(docs/BENCHMARKS.md: "Streaming vs offline decode on the GPU in bf16 differs by at most 2e-3"); exactness
(< 1e-4) is for fp32 and checked on the CPU (tests/test_spark_codec.py).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.spark_fixtures import cached_spark_checkpoint
from voiced.engines.base import TTSOptions, TTSRequest
from voiced.engines.spark.engine import SparkTTSEngine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16_BOUND = 2e-3
MAX_BATCH = 4
MAX_SEQ = 512


@dataclass
class Result:
    tokens: list[int]  # semantic ids, in order
    global_ids: list[int]  # the speaker's 32 global ids
    audio: np.ndarray  # the streamed chunks joined
    chunks: int
    speaker: torch.Tensor | None


def requests(top_k: int = 50) -> dict[int, TTSRequest]:
    """Four replies of different lengths, voices and seeds (top_k=1: greedy)."""
    texts = ["The weather is nice today.", "Let us go for a walk in the park.", "See you later!",
             "One more reply for the queue."]
    voices = [None, "male", "female:high:low", None]
    seconds = [1.6, 1.2, 1.4, 1.0]  # 50-80 tokens: at least two chunks each (the tiny codec looks 38 tokens ahead)
    return {i + 1: TTSRequest(t, TTSOptions(voice=v, seed=20 + i, top_k=top_k, max_seconds=s))
            for i, (t, v, s) in enumerate(zip(texts, voices, seconds))}


def run(engine: SparkTTSEngine, reqs: dict[int, TTSRequest], submit_at: dict[int, int] | None = None,
        cancel_at: dict[int, int] | None = None, steps: list | None = None) -> dict[int, Result]:
    """Submit (request id -> at engine step), step until done; each request's tokens, speaker and audio.
    A cancelled request keeps what it had got; `steps` collects (active ids, queued ids) per step."""
    submit_at = {rid: (submit_at or {}).get(rid, 0) for rid in reqs}
    cancel_at = dict(cancel_at or {})
    cancelled: set[int] = set()
    live, audio = {}, {rid: [] for rid in reqs}
    n = 0
    while submit_at or engine.has_work():
        for rid, at in list(submit_at.items()):
            if n >= at:
                engine.submit(rid, reqs[rid])
                live[rid] = engine._queue[-1]  # the engine's record of it: tokens, speaker
                del submit_at[rid]
        for rid, at in list(cancel_at.items()):
            if n >= at:
                engine.cancel(rid)
                cancelled.add(rid)
                del cancel_at[rid]
        for out in engine.step():
            assert out.error is None, f"request {out.request_id}: {out.error}"
            assert out.request_id not in cancelled, f"request {out.request_id} got output after it was cancelled"
            audio[out.request_id].append(out.value.samples)
        if steps is not None:
            steps.append(([r.rid for r in engine._active], [r.rid for r in engine._queue]))
        n += 1
    return {rid: Result(list(r.semantic), list(r.global_ids), np.concatenate(audio[rid] or [np.zeros(0, np.float32)]),
                        len(audio[rid]), r.speaker) for rid, r in live.items()}


def token_difference(a: list[int], b: list[int]) -> str:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at token {i} of {len(a)} / {len(b)}: {a[max(0, i - 2) : i + 3]} vs {b[max(0, i - 2) : i + 3]}"


def audio_difference(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, f"audio lengths differ: {a.shape[0]} vs {b.shape[0]} samples"
    return float(np.abs(a - b).max()) if a.size else 0.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cached_spark_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def served(ckpt, tmp_path_factory):
    """The engine as the daemon serves it on a GPU, warmed up."""
    engine = SparkTTSEngine.load(ckpt, device="cuda", max_batch=MAX_BATCH, max_seq_len=MAX_SEQ,
                                 voices_dir=tmp_path_factory.mktemp("voices"))
    assert engine.lm.compiled and engine.use_cuda_graphs, "the served path is compiled and graphed on CUDA"
    assert next(engine.lm.parameters()).dtype == torch.bfloat16
    engine.warmup()
    return engine


@pytest.fixture(scope="module")
def alone(served):
    """Each request run alone through the served engine (seeded sampling)."""
    return {rid: run(served, {rid: r})[rid] for rid, r in requests().items()}


def greedy_differences(got: dict[int, Result], want: dict[int, Result]) -> list[str]:
    return [f"request {rid} {kind}: {token_difference(a, b)}"
            for rid in want for kind, a, b in (("global", got[rid].global_ids, want[rid].global_ids),
                                               ("semantic", got[rid].tokens, want[rid].tokens)) if a != b]


JOINS = {1: 0, 2: 0, 3: 3, 4: 9}  # requests join the running batch at these steps; they leave at 50-80 tokens


def test_cuda_graphs_equal_ungraphed_steps(ckpt, served, tmp_path):
    """Compares greedy global and semantic tokens of the served engine (bf16, compiled layers, CUDA
    graphs of 8 decode steps with sampling inside) with the same compiled step functions launched
    without graphs: four requests joining a running batch and leaving it at different lengths."""
    ungraphed = SparkTTSEngine.load(ckpt, device="cuda", max_batch=MAX_BATCH, max_seq_len=MAX_SEQ, voices_dir=tmp_path,
                                    use_cuda_graphs=False)
    assert ungraphed.lm.compiled and not ungraphed.use_cuda_graphs
    reqs = requests(top_k=1)
    got, want = run(served, reqs, JOINS), run(ungraphed, reqs, JOINS)
    problems = greedy_differences(got, want)
    assert not problems, "bf16, graphs vs no graphs (greedy):\n" + "\n".join(problems)
    assert len({tuple(r.tokens) for r in got.values()}) == len(reqs), "different requests must give different tokens"


def test_compiled_graphed_steps_equal_eager_steps_in_float32(ckpt, tmp_path):
    """Compares greedy global and semantic tokens of the served configuration (compiled layers, CUDA
    graphs) with the modules run eagerly one kernel at a time (no compile, no graphs), both in float32,
    where the two orders of arithmetic agree to ~1e-6 and a greedy choice cannot flip on rounding:
    four requests joining a running batch and leaving it at different lengths."""
    kw = dict(device="cuda", dtype="float32", max_batch=MAX_BATCH, max_seq_len=MAX_SEQ, voices_dir=tmp_path)
    fast = SparkTTSEngine.load(ckpt, **kw)
    eager = SparkTTSEngine.load(ckpt, compile_lm=False, use_cuda_graphs=False, **kw)
    assert fast.lm.compiled and fast.use_cuda_graphs and not eager.lm.compiled and not eager.use_cuda_graphs
    reqs = requests(top_k=1)
    got, want = run(fast, reqs, JOINS), run(eager, reqs, JOINS)
    problems = greedy_differences(got, want)
    assert not problems, "float32, compiled + graphed vs eager (greedy):\n" + "\n".join(problems)


def test_compiled_bf16_step_is_the_eager_step_up_to_rounding(ckpt, served, tmp_path):
    """In bf16 the compiled layers (fused projections, written-out attention, Inductor's fused
    elementwise kernels) round differently from the eager modules, so greedy tokens of a random LM
    part on near-ties; what must hold is that a prefill and a decode step give the same logits up to
    bf16 rounding (max |diff| within 2e-2 of the largest logit, as Whisper's fp16 step check)."""
    eager = SparkTTSEngine.load(ckpt, device="cuda", max_batch=MAX_BATCH, max_seq_len=MAX_SEQ, voices_dir=tmp_path,
                                compile_lm=False, use_cuda_graphs=False)
    prompt = torch.randint(0, 166000, (45,), generator=torch.Generator().manual_seed(3)).cuda()
    out = []
    with torch.no_grad():
        for lm, graph in ((served.lm, True), (eager.lm, False)):  # the served engine is idle: its row 0 is free
            first = lm.lm_head(lm.prefill_many([prompt], [0], pad_to=64)).float()
            step = lm.decode(torch.tensor([151700], device="cuda"), torch.tensor([45], device="cuda"), use_graph=graph,
                             max_pos=45)
            out.append((first, step.float()))
    for what, a, b in (("prefill", out[0][0], out[1][0]), ("decode step", out[0][1], out[1][1])):
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        assert err <= 2e-2 * scale, f"{what}, compiled vs eager (bf16): max |diff| {err:.3g} > 2e-2 x max |logit| {scale:.3g}"


def test_streamed_audio_equals_the_offline_decode_of_the_same_tokens(served, alone):
    """Compares each request's streamed chunks, joined, with BiCodec decoding all of its semantic tokens
    at once (same speaker, same bf16 codec): equal length, max |diff| within the bf16 bound."""
    worst = {}
    for rid, res in alone.items():
        assert res.chunks >= 2, f"request {rid} streamed in {res.chunks} chunk; the check needs a seam"
        ids = torch.tensor(res.tokens, dtype=torch.long, device="cuda")[None]
        with torch.no_grad():
            offline = served.codec.decode(ids, res.speaker[None])[0].float().cpu().numpy()
        worst[rid] = audio_difference(res.audio, offline)
    assert max(worst.values()) <= BF16_BOUND, (
        f"streamed vs offline, max |diff| per request {worst} > {BF16_BOUND} (bf16 bound); "
        f"audio peak {max(float(np.abs(r.audio).max()) for r in alone.values()):.3f}")


def assert_as_alone(together: dict[int, Result], alone: dict[int, Result], what: str) -> None:
    """Each request's tokens equal to its tokens alone, its audio within the bf16 bound (the vocoder batches
    windows differently)."""
    problems, worst = [], {}
    for rid, res in alone.items():
        if together[rid].tokens != res.tokens or together[rid].global_ids != res.global_ids:
            problems.append(f"request {rid}: semantic {token_difference(together[rid].tokens, res.tokens)}; "
                            f"globals equal: {together[rid].global_ids == res.global_ids}")
        else:
            worst[rid] = audio_difference(together[rid].audio, res.audio)
    assert not problems, f"{what} vs alone:\n" + "\n".join(problems)
    assert max(worst.values()) <= BF16_BOUND, f"{what} vs alone, max |audio diff| per request {worst}"


def test_batch_mates_change_nothing(served, alone):
    """Compares each request's tokens and audio alone with the same request sharing the batch with the
    others, joining at different steps (the engine holds 4 rows; they leave at different lengths):
    tokens equal, audio within the bf16 bound (the vocoder batches windows differently)."""
    assert_as_alone(run(served, requests(), submit_at={1: 0, 2: 1, 3: 5, 4: 12}), alone, "with batch mates")


def test_unset_rows_are_the_most_the_memory_share_holds(ckpt, tmp_path):
    """`max_batch` unset (the daemon's default, 0) on a GPU: 64 rows where the engine's share of the free
    memory holds them, else the most of 32, 16, ... that it does (the shares here made from the engine's own
    needs at 16 and 32 rows), and the engine holds that need."""
    free = torch.cuda.mem_get_info()[0]
    kw = dict(device="cuda", max_seq_len=MAX_SEQ, voices_dir=tmp_path, compile_lm=False)
    big = SparkTTSEngine.load(ckpt, memory_limit=(free, 0.35), **kw)
    assert big.max_batch == 64 and big.memory_need.total <= free * 0.35
    need = {rows: SparkTTSEngine.load(ckpt, max_batch=rows, **kw).memory_need.total for rows in (16, 32)}
    assert need[16] < need[32] < big.memory_need.total
    small = SparkTTSEngine.load(ckpt, memory_limit=(free, (need[16] + need[32]) / 2 / free), **kw)
    assert small.max_batch == 16 and small.memory_need.total == need[16]


def test_a_cancelled_request_frees_its_slot(served, alone):
    """Five requests for four rows: the fifth waits; cancelling a decoding request lets it in at the next
    step, the cancelled one gets nothing more (`run` checks), and the others (one of them moved into the freed row)
    still give exactly what they give alone."""
    reqs = requests()
    reqs[5] = TTSRequest("A fifth reply waits for a free row.", TTSOptions(seed=99, max_seconds=1.0))
    steps: list = []
    cancel_step = 6
    got = run(served, reqs, cancel_at={2: cancel_step}, steps=steps)
    active, queued = steps[cancel_step - 1]
    assert len(active) == MAX_BATCH and 2 in active and queued == [5], f"before the cancel: {steps[cancel_step - 1]}"
    active, queued = steps[cancel_step]
    assert 2 not in active and 5 in active and not queued, f"the step after the cancel: active {active}, queued {queued}"
    assert served.active_requests() == 0 and not served.has_work()
    for rid in (1, 3, 4):
        assert got[rid].tokens == alone[rid].tokens, f"request {rid}: {token_difference(got[rid].tokens, alone[rid].tokens)}"
    assert len(got[5].tokens) == 50, f"the request admitted into the freed row wrote {len(got[5].tokens)} of 50 tokens"


def test_vocoder_graphs_replay_the_eager_decode_exactly(served):
    """The served engine's vocoder CUDA graphs: every shape warm-up ran is captured, and a replay gives the
    eager window decode bit for bit, plain and end-masked (one graph serves both: an all-true mask keeps its
    input exactly; each graph copies its result into the graphs' shared output); the four replies, each alone
    and greedy, stream the same tokens and audio as with the vocoder run eagerly."""
    from voiced.engines.spark import streaming, vocoder_schedule

    assert served.vocoder_graphs
    graphs = served.codec._graphs
    opts = TTSOptions()
    shapes = vocoder_schedule.window_shapes(opts.first_chunk_tokens, opts.chunk_tokens, served.radius)
    assert set(graphs.graphs) == set(shapes)
    assert served.warmup_stats["vocoder_graphs"]["graphs"] == len(shapes)
    gen = torch.Generator(device="cuda").manual_seed(0)
    spk = served._speaker(torch.randint(0, 4096, (32,), generator=torch.Generator().manual_seed(1)).tolist())
    for b, length in (shapes[0], shapes[len(shapes) // 2], shapes[-1]):
        ids = torch.randint(0, 8192, (b, length), device="cuda", generator=gen)
        for valid in ([length] * b, [length - 5] + [length] * (b - 1)):
            replayed = streaming.decode_windows(served.codec, ids, spk[None].repeat(b, 1), valid).clone()
            served.codec._graphs = None
            try:
                eager = streaming.decode_windows(served.codec, ids, spk[None].repeat(b, 1), valid)
            finally:
                served.codec._graphs = graphs
            assert torch.equal(replayed, eager), (b, length, valid)
    reqs = requests(top_k=1)
    got = {rid: run(served, {rid: r})[rid] for rid, r in reqs.items()}
    served.codec._graphs = None
    try:
        want = {rid: run(served, {rid: r})[rid] for rid, r in reqs.items()}
    finally:
        served.codec._graphs = graphs
    for rid in reqs:
        assert got[rid].tokens == want[rid].tokens, rid
        assert got[rid].audio.shape == want[rid].audio.shape and np.array_equal(got[rid].audio, want[rid].audio), rid


MiB = 2**20
# The CUDA caching allocator's granularity, which a pool of a few MiB cannot avoid: requests of 1-10 MiB
# are served from 20 MiB segments, smaller ones from 2 MiB segments. At the test checkpoint's ~7 MiB of
# vocoder activations that rounding is most of the pool; at full size (below) it is lost in 305 MiB.
SMALL_POOL_SLACK = 20 * MiB + 4 * 2 * MiB
PLAN_TOLERANCE = 0.05  # the plan within 5 % of what was used


def _vocoder_graph_rows(engine: SparkTTSEngine) -> tuple[int, int, int]:
    """The plan's vocoder-graph rows: (graphs, shared inputs and output bytes, pool bytes)."""
    io = [n for n in engine.memory_need.items if n.what.startswith("vocoder graphs (")]
    pool = [n for n in engine.memory_need.items if n.what.startswith("vocoder graphs' pool")]
    assert len(io) == len(pool) == 1 and not io[0].transient and not pool[0].transient, engine.memory_need.items
    return int(io[0].what.split("(")[1].split(")")[0]), io[0].bytes, pool[0].bytes


def _capture_growth(capture) -> dict:
    """Run `capture()` (returns VocoderGraphs); what it added to the GPU's allocated and reserved memory
    once done, the allocated peak while it ran, and the graphs' pool."""
    # Engines of earlier tests in this process (their graphs' pools too)
    # go now, not when a collection happens to run during the captures and makes the growth negative.
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    graphs = capture()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"graphs": graphs, "allocated": torch.cuda.memory_allocated() - a0,
            "peak": torch.cuda.max_memory_allocated() - a0, "reserved": torch.cuda.memory_reserved() - r0,
            "pool": graphs.pool_bytes()}


def _say(got: dict, io_row: int, pool_row: int, workspace: int) -> str:
    return (f"captures added {got['allocated'] / MiB:.2f} MiB allocated (peak {got['peak'] / MiB:.2f} while "
            f"capturing), {got['reserved'] / MiB:.2f} MiB reserved, pool {got['pool'] / MiB:.2f} MiB; plan: shared "
            f"inputs and output {io_row / MiB:.2f} MiB, pool {pool_row / MiB:.2f} MiB; a cuBLAS workspace "
            f"{workspace / MiB:.2f} MiB; {len(got['graphs'].graphs)} graphs captured in "
            f"{got['graphs'].capture_s:.1f} s")


def test_vocoder_graphs_hold_what_the_plan_counts(ckpt, tmp_path):
    """The vocoder graphs of the test checkpoint, captured as warm-up captures them (after the rest of the
    warm-up, measured alone), hold what the plan's two rows say: allocated for good, their shared inputs and
    output and nothing per graph (no output each, no cuBLAS workspace per stream: the ~1 GiB the first
    version held); reserved, those and their pool, which holds the largest capture's activations (within
    the allocator's segment rounding, SMALL_POOL_SLACK, at this size)."""
    from voiced.engines.spark import vocoder_schedule, warmup
    from voiced.memory_plan import stream_workspace_bytes

    engine = SparkTTSEngine.load(ckpt, device="cuda", max_batch=MAX_BATCH, max_seq_len=MAX_SEQ, voices_dir=tmp_path)
    count, io_row, pool_row = _vocoder_graph_rows(engine)
    engine.vocoder_graphs = False  # the whole warm-up but the captures, so that these are measured alone
    engine.warmup()
    engine.vocoder_graphs = True
    opts = TTSOptions()
    shapes = vocoder_schedule.window_shapes(opts.first_chunk_tokens, opts.chunk_tokens, engine.radius)
    got = _capture_growth(lambda: warmup.capture_vocoder_graphs(engine, shapes))
    workspace = stream_workspace_bytes("cuda")  # probed at load: the plan's cuBLAS row holds one per stream
    msg = _say(got, io_row, pool_row, workspace)
    assert len(got["graphs"].graphs) == len(shapes) == count, msg
    assert got["graphs"].io_bytes() == io_row, msg
    # The LM's capture stream has its cuBLAS workspace already (the plan's row); at most a cuBLASLt one may come.
    assert io_row <= got["allocated"] <= io_row + workspace, msg
    assert pool_row * (1 - PLAN_TOLERANCE) <= got["pool"] <= pool_row + SMALL_POOL_SLACK, msg
    assert got["peak"] <= got["pool"] + io_row + workspace, msg  # every allocation of a capture is the pool's
    assert got["reserved"] <= got["pool"] + io_row + workspace + 2 * MiB, msg  # the inputs' own small segment
    engine.codec._graphs = None
    print(msg)


def test_full_size_vocoder_graphs_hold_their_planned_pool_and_replay_exactly():
    """The published BiCodec's size (random weights, bf16), the 91 default shapes on one stream: what the
    captures keep allocated is the plan's shared inputs and output, their pool is the plan's row within 5 %
    (one reserved segment: 304.5 MiB of activations + the measured allowance, vocoder_graphs.POOL_ALLOWANCE;
    and the small pool's segments), no capture after the first grows it, the allocated peak while capturing
    is at most their sum,
    and replays equal the eager decode bit for bit (the kernels here are the full model's)."""
    from voiced.engines.base import TTSOptions as Opts
    from voiced.engines.spark import streaming, vocoder_schedule
    from voiced.engines.spark import vocoder_graphs as vg
    from voiced.engines.spark.bicodec import BiCodec, BiCodecConfig
    from voiced.memory_plan import stream_workspace_bytes

    workspace = stream_workspace_bytes("cuda")  # (cached per process; probed here if this test runs first)
    cfg = BiCodecConfig()
    with torch.device("meta"):
        meta = BiCodec(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    opts = Opts()
    shapes = vocoder_schedule.window_shapes(opts.first_chunk_tokens, opts.chunk_tokens, meta.receptive_radius())
    io_row, pool_row = vg.held_bytes(shapes, cfg.speaker_out_dim, 2), vg.pool_bytes_planned(meta, shapes)
    reserve = vg.pool_reserve_bytes(meta, shapes)
    torch.manual_seed(0)
    with torch.device("cuda"):
        codec = BiCodec(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    stream = torch.cuda.Stream()
    gen = torch.Generator(device="cuda").manual_seed(0)
    spk = torch.randn(16, cfg.speaker_out_dim, device="cuda", generator=gen).to(torch.bfloat16)
    cases = []
    with torch.no_grad():
        for b, length in (shapes[0], shapes[len(shapes) // 2], max(shapes, key=lambda s: s[0] * s[1])):
            ids = torch.randint(0, 8192, (b, length), device="cuda", generator=gen)
            for valid in ([length] * b, [length - 5] + [length] * (b - 1)):
                cases.append((ids, valid, streaming.decode_windows(codec, ids, spk[:b], valid).clone()))
        # What the engine's warm-up has made before it captures: the capture stream's cuBLAS workspace,
        # cuDNN's plans, the Snakes' 1/alpha.
        with torch.cuda.stream(stream):
            b, length = max(shapes, key=lambda s: s[0] * s[1])
            streaming.decode_windows(codec, torch.zeros(b, length, dtype=torch.long, device="cuda"), spk[:b],
                                     [length - 1] * b)
        torch.cuda.current_stream().wait_stream(stream)
        got = _capture_growth(lambda: vg.VocoderGraphs(codec, shapes, stream, reserve_bytes=reserve))
        msg = _say(got, io_row, pool_row, workspace)
        assert io_row <= got["allocated"] <= io_row + workspace, msg
        assert abs(got["pool"] - pool_row) <= PLAN_TOLERANCE * pool_row, msg
        # The reserve is allocated (and freed) at the first capture's start: the allocated peak is it and
        # the shared buffers; the decodes' own peak (425 MiB at full size) stays inside it.
        assert got["peak"] <= io_row + pool_row, msg
        assert got["graphs"].pool_growth[1:] == [0] * (len(shapes) - 1), msg  # all fit in the first's segments
        codec._graphs = got["graphs"]
        try:
            for ids, valid, eager in cases:
                replayed = streaming.decode_windows(codec, ids, spk[: ids.shape[0]], valid)
                # the bits, so that a NaN of random weights compares equal to the same NaN
                assert torch.equal(replayed.view(torch.int16), eager.view(torch.int16)), (tuple(ids.shape), valid)
        finally:
            codec._graphs = None
    print(msg)
