"""SparkTTSEngine: the stepped contract, continuous batching, voices, CLI."""

from __future__ import annotations

import json
import wave

import numpy as np
import pytest

from tests.spark_fixtures import cached_spark_checkpoint
from tests.speech import phrase
from voiced.engines.base import AudioChunk, EngineError, TTSEngine, TTSOptions, TTSRequest, finish
from voiced.engines.spark.engine import SparkTTSEngine
from voiced.engines.spark.prompt import join_transcript, split_text

REF_TEXT = "Hello, my name is Spark and I am testing voice cloning today."


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return cached_spark_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(ckpt, tmp_path_factory):
    return SparkTTSEngine.load(ckpt, device="cpu", max_batch=3, max_seq_len=1024,
                               voices_dir=tmp_path_factory.mktemp("voices"))


def run(engine, requests: dict[int, TTSRequest], cancel_at: dict[int, int] | None = None):
    """Submit all, step until done; return {id: [AudioChunk]} (a cancelled id keeps what it got)."""
    for rid, req in requests.items():
        engine.submit(rid, req)
    got: dict[int, list[AudioChunk]] = {rid: [] for rid in requests}
    finals = set()
    steps = 0
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            got[out.request_id].append(out.value)
            if out.final:
                assert out.request_id not in finals
                finals.add(out.request_id)
        steps += 1
        for rid, at in (cancel_at or {}).items():
            if steps == at:
                engine.cancel(rid)
    return got


def audio(chunks: list[AudioChunk]) -> np.ndarray:
    return np.concatenate([c.samples for c in chunks])


def test_satisfies_the_tts_engine_protocol(engine):
    assert isinstance(engine, TTSEngine)
    assert engine.backend == "torch" and engine.device == "cpu"


def test_chunks_are_ordered_and_capped(engine):
    opts = TTSOptions(seed=5, max_seconds=1.5, first_chunk_tokens=8, chunk_tokens=20)
    chunks = run(engine, {1: TTSRequest("Good morning, everyone.", opts)})[1]
    assert [c.sequence for c in chunks] == list(range(len(chunks)))
    offsets = np.cumsum([0] + [len(c.samples) for c in chunks[:-1]])
    assert [c.offset for c in chunks] == offsets.tolist()
    assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len(chunks[0].samples) == 8 * 320  # first chunk after first_chunk_tokens
    total = audio(chunks)
    assert len(total) <= 1.5 * 16000 and len(total) == chunks[-1].tokens * 320
    assert np.isfinite(total).all() and total.std() > 1e-3


@pytest.mark.slow
def test_batched_requests_give_the_same_audio_as_alone(engine):
    """Seeded requests are independent of their batch mates (joining and leaving between steps)."""
    a = TTSRequest("The weather is nice today.", TTSOptions(seed=11, max_seconds=1.2))
    b = TTSRequest("Let us go for a walk.", TTSOptions(seed=12, max_seconds=0.8, voice="male"))
    c = TTSRequest("See you later!", TTSOptions(seed=13, max_seconds=1.0, voice="female:high:low"))
    alone = {rid: audio(run(engine, {rid: r})[rid]) for rid, r in ((1, a), (2, b), (3, c))}
    d = TTSRequest("One more for the queue.", TTSOptions(seed=14, max_seconds=0.6))
    together = run(engine, {1: a, 2: b, 3: c, 4: d})  # max_batch 3: request 4 joins when one leaves
    for rid in (1, 2, 3):
        assert np.allclose(audio(together[rid]), alone[rid], atol=1e-4), rid
    assert not np.allclose(alone[1][:8000], alone[3][:8000])
    assert engine.active_requests() == 0


def test_a_vocoder_turn_yields_before_its_audio_is_read_back(engine):
    """Overlapped engine steps (engines.overlap) launch each engine's GPU work before either reads back,
    so recognition runs beside the TTS. A vocoder turn is such work too: its step yields once the
    windows are queued, and their audio comes out when the step is resumed."""
    engine.submit(1, TTSRequest("Good morning, everyone.", TTSOptions(seed=5, max_seconds=1.5, first_chunk_tokens=8,
                                                                      chunk_tokens=20)))
    turns = 0
    while engine.has_work():
        parts = engine.step_parts()
        try:
            next(parts)
        except StopIteration:
            assert not (engine.last_step.get("kind") == "vocode" and engine.last_step.get("windows")), \
                "a vocoder turn ran straight through to its read-back"
            continue
        launched = dict(engine.last_step)
        out = finish(parts)
        if launched["kind"] == "vocode" and launched.get("windows"):
            turns += 1
            assert out and all(o.value.samples.size for o in out if not o.value.last)
    assert turns >= 2 and engine.active_requests() == 0


def test_a_vocoder_turn_closed_before_its_read_back_loses_no_audio(engine):
    """A step closed at its yield (the engine thread stopping mid-round) gives its vocoder turn's windows
    back: the reply, stepped on, still has the audio of every token it sampled."""
    engine.submit(1, TTSRequest("Good morning, everyone.", TTSOptions(seed=5, max_seconds=1.5, first_chunk_tokens=8,
                                                                      chunk_tokens=20)))
    chunks, closed = [], 0
    while engine.has_work():
        parts = engine.step_parts()
        try:
            next(parts)
        except StopIteration as done:
            chunks += [o.value for o in done.value]
            continue
        if engine.last_step.get("kind") == "vocode" and engine.last_step.get("windows") and closed < 2:
            parts.close()
            closed += 1
            continue
        chunks += [o.value for o in finish(parts)]
    assert closed == 2 and chunks[-1].last
    assert [c.sequence for c in chunks] == list(range(len(chunks)))
    assert sum(len(c.samples) for c in chunks) == chunks[-1].tokens * 320


def test_cancel_drops_a_request_and_frees_its_row(engine):
    reqs = {i: TTSRequest(f"Request number {i}.", TTSOptions(seed=i, max_seconds=1.0)) for i in (1, 2, 3)}
    got = run(engine, reqs, cancel_at={2: 5})
    assert not any(c.last for c in got[2])
    assert got[1][-1].last and got[3][-1].last
    assert engine.active_requests() == 0 and not engine.has_work()


def test_empty_text_and_unknown_voice_are_rejected(engine):
    with pytest.raises(EngineError, match="empty"):
        engine.submit(1, TTSRequest("   "))
    with pytest.raises(EngineError, match="unknown voice 'nobody'"):
        engine.submit(1, TTSRequest("hi", TTSOptions(voice="nobody")))
    assert not engine.has_work()


def test_long_text_is_split_into_sentences_spoken_back_to_back():
    parts = split_text("First sentence is here. Second one follows! And a third? " + "word " * 120)
    assert parts[:3] == ["First sentence is here.", "Second one follows!", "And a third?"]
    assert all(len(p) <= 300 for p in parts) and len(parts) >= 5
    assert join_transcript("...gospel.", "Actions speak.") == "...gospel. Actions speak."
    assert join_transcript("今天天气真不错。", "行动胜于雄辩。") == "今天天气真不错。行动胜于雄辩。"


# The cloned-voice prompt of DESIGN §6, pinned on the fixture's byte-level BPE (bytes, a few merges such as
# "Ġthe" and "Ġa") and the published special-token ids; each content id was checked by hand against
# tokenizer.json. Spark-TTS upstream concatenates the reference transcript and the text as they are; we put
# a space between them when the transcript ends in a letter or punctuation and the text does not start with
# a CJK character (`join_transcript` says why), so English prompts differ from upstream's by that one
# "Ġ" token, and Chinese prompts not at all.
GLOBALS = list(range(0, 3200, 100))
SEMANTIC = [5, 8191, 42]
PINNED_TAIL = [165152, 165150, *range(151665, 154766, 100), 165156, 165151, 155766, 163952, 155803]
PINNED = {
    ("Hi there.", "On the air."): [
        165137, 165146,  # <|task_tts|> <|start_content|>
        39, 72, 258, 81, 68, 13,  # H i Ġthe r e .
        220,  # Ġ: the space join_transcript adds (upstream: none)
        46, 77, 258, 261, 72, 81, 13,  # O n Ġthe Ġa i r .
        *PINNED_TAIL,  # <|end_content|> <|start_global_token|> 32 globals <|end_global_token|> <|start_semantic_token|> 3 semantics
    ],
    ("今天天气真不错。", "行动胜于雄辩。"): [
        165137, 165146,
        160, 119, 232, 161, 97, 102, 161, 97, 102, 162, 108, 242, 163, 250, 253, 160, 116, 235,  # 今天天气真不
        165, 242, 247, 159, 222, 224,  # 错。 (UTF-8 bytes: no merges apply)
        164, 94, 234, 161, 232, 101, 164, 225, 250, 160, 118, 236, 165, 249, 226, 164, 122, 102,  # 行动胜于雄辩
        159, 222, 224,  # 。
        *PINNED_TAIL,
    ],
}


@pytest.mark.parametrize("transcript,text", list(PINNED))
def test_cloned_voice_prompt_ids_are_pinned(ckpt, transcript, text):
    from voiced.engines.spark.checkpoint import TextTokenizer, load_special_tokens
    from voiced.engines.spark.prompt import build_prompt
    from voiced.engines.spark.voices import Voice

    tok = TextTokenizer(ckpt / "LLM")
    sp = load_special_tokens(ckpt / "LLM", tok)
    voice = Voice("v", "cloned", global_ids=GLOBALS, semantic_ids=SEMANTIC, transcript=transcript)
    prompt = build_prompt(sp, tok.encode, voice, text)
    assert prompt == PINNED[(transcript, text)]
    content = prompt[2 : prompt.index(sp.end_content)]
    assert tok.decode(content) == join_transcript(transcript, text)
    upstream = tok.encode(transcript + text)  # upstream's "".join([..., prompt_text, text, ...])
    if text[0].isascii():
        assert content == upstream[:6] + [220] + upstream[6:]
    else:
        assert content == upstream


def test_multi_sentence_request_keeps_one_speaker(engine, monkeypatch):
    # The random LM never ends a sentence (tests/spark_fixtures.py); a tight per-sentence cap ends each one.
    monkeypatch.setattr(engine, "segment_base_s", 0.2)
    monkeypatch.setattr(engine, "segment_s_per_char", 0.01)
    prompts = []
    real = engine._prompt
    monkeypatch.setattr(engine, "_prompt", lambda r, seg: prompts.append(real(r, seg)) or prompts[-1])
    text = "Hello there, my friend. How are you doing today? I am doing fine, thanks."
    engine.submit(9, TTSRequest(text, TTSOptions(seed=2, max_seconds=10.0)))
    req = engine._queue[-1]
    chunks = []
    while engine.has_work():
        for out in engine.step():
            chunks.append(out.value)
    assert len(req.segments) == 3 and chunks[-1].last and sum(c.last for c in chunks) == 1
    caps = [int((0.2 + 0.01 * len(s)) * 50) for s in req.segments]
    assert chunks[-1].tokens == sum(caps) and len(audio(chunks)) == sum(caps) * 320  # back to back
    sp = engine.special
    sent = [p for p in prompts if p[0] in (sp.task_tts, sp.task_controllable_tts)][-3:]
    assert sent[0][0] == sp.task_controllable_tts  # the first sentence invents the speaker...
    g = [sp.global_base + i for i in req.global_ids]
    for p in sent[1:]:  # ...the next ones are spoken with its 32 global tokens
        assert p[0] == sp.task_tts and p[-33:-1] == g


def test_a_sentence_the_lm_ends_gives_way_to_the_next(engine, monkeypatch):
    """The LM ends a sentence by saying <|end_semantic_token|> or <|im_end|> (the tests' random LM never
    does, see tests/spark_fixtures.py, so it says them here in its place): the sentence's audio stops
    there, the next sentence starts, and the request ends once with the audio of what was said."""
    from voiced.engines.spark.request import PHASE_SEMANTIC

    sp = engine.special
    says = {0: (12, sp.end_semantic), 1: (7, sp.eos)}  # sentence: (its n-th speech token, the end token)
    real = engine._advance

    def advance(r, t):
        if r.rid == 11 and r.phase == PHASE_SEMANTIC and r.seg in says and len(r.semantic) + 1 == says[r.seg][0]:
            t = says.pop(r.seg)[1]  # once: what the engine makes of it is the test
        real(r, t)

    monkeypatch.setattr(engine, "_advance", advance)
    got = run(engine, {11: TTSRequest("Hello there, my friend. How are you doing today?",
                                      TTSOptions(seed=3, max_seconds=10.0))})[11]
    assert not says and got[-1].last and sum(c.last for c in got) == 1
    assert got[-1].tokens == 11 + 6 and len(audio(got)) == (11 + 6) * 320


def test_register_voice_once_and_survive_restart(ckpt, engine, tmp_path):
    ref = phrase(REF_TEXT)
    e1 = SparkTTSEngine.load(ckpt, device="cpu", max_batch=1, max_seq_len=1024, voices_dir=tmp_path)
    v = e1.voices.add("alice", ref, REF_TEXT)
    assert v.kind == "cloned" and e1.voices.tokenize_calls == 1
    e1.voices.add("alice-again", ref, "Hello.")  # same recording, another name: no recomputation
    assert e1.voices.tokenize_calls == 1
    out1 = e1.synthesize("Nice to meet you.", TTSOptions(voice="alice", seed=3, max_seconds=1.0))
    # a new engine (a restart) finds the voice and its cached tokens
    e2 = SparkTTSEngine.load(ckpt, device="cpu", max_batch=1, max_seq_len=1024, voices_dir=tmp_path)
    assert {"alice", "alice-again"} <= {x.name for x in e2.voices.list()}
    out2 = e2.synthesize("Nice to meet you.", TTSOptions(voice="alice", seed=3, max_seconds=1.0))
    assert e2.voices.tokenize_calls == 0
    assert np.allclose(out1.audio, out2.audio, atol=1e-5)
    # the cloned prompt carries the reference transcript and its semantic tokens
    voice = e2.voices.resolve("alice")
    assert len(voice.global_ids) == 32 and abs(len(voice.semantic_ids) - len(ref) / 320) <= 2
    assert out2.prompt_tokens > len(voice.semantic_ids) + 32
    assert e2.voices.delete("alice-again") and not e2.voices.delete("alice-again")
    with pytest.raises(EngineError, match="preset"):
        e2.voices.add("female", ref, "x")


def test_a_registered_voice_survives_a_restart_bit_for_bit(ckpt, engine, tmp_path):
    """The stored recording holds the user's PCM16 samples unchanged and reads back as the samples
    registered, so tokens computed again after a restart (the token cache gone: another checkpoint
    fingerprint) equal those of the registration, bit for bit."""
    from voiced.audio.wavfile import load_16k
    from voiced.engines.spark.voices import VoiceStore, audio_sha256

    speech = phrase(REF_TEXT)
    pcm = np.round(speech / np.abs(speech).max() * 0.95 * 32767).astype("<i2")  # loud: most of the range
    wav = tmp_path / "ref.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(pcm.tobytes())
    audio = load_16k(wav)  # what `voiced voices add --audio` reads
    store = VoiceStore(tmp_path / "voices", "checkpoint-a", engine._tokenize_reference)
    info = store.add("carol", audio, REF_TEXT)
    tokens = store.tokens(info.audio_sha256)
    assert tokens == engine._tokenize_reference(audio) and store.tokenize_calls == 1

    with wave.open(str(tmp_path / "voices" / "audio" / f"{info.audio_sha256}.wav")) as w:
        assert w.readframes(w.getnframes()) == pcm.tobytes()  # the user's samples, unchanged
    restarted = VoiceStore(tmp_path / "voices", "checkpoint-b", engine._tokenize_reference)
    assert restarted.tokens(info.audio_sha256) == tokens and restarted.tokenize_calls == 1
    assert restarted.resolve("carol").semantic_ids == tokens[1]
    assert audio_sha256(audio) == info.audio_sha256  # the same recording again is found, not re-stored


def test_cli_speak_and_voices(ckpt, tmp_path, capsys):
    from voiced.cli import main

    ref = tmp_path / "ref.wav"
    pcm = (phrase(REF_TEXT) * 32767).astype("<i2")
    with wave.open(str(ref), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000), w.writeframes(pcm.tobytes())
    vd = str(tmp_path / "voices")
    assert main(["voices", "add", "bob", "--audio", str(ref), "--text", REF_TEXT, "--model", str(ckpt),
                 "--device", "cpu", "--voices-dir", vd]) == 0
    assert main(["voices", "list", "--json", "--voices-dir", vd]) == 0
    listed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert {"name": "bob", "kind": "cloned"}.items() <= next(v for v in listed if v["name"] == "bob").items()
    out = tmp_path / "o.wav"
    assert main(["speak", "Testing the command line.", "--model", str(ckpt), "--voice", "bob", "--device", "cpu",
                 "--seed", "1", "--out", str(out), "--json", "--max-seconds", "1", "--voices-dir", vd]) == 0
    stats = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert stats["semantic_tokens"] > 0 and stats["first_chunk_ms"] > 0 and stats["audio_seconds"] <= 1.0
    with wave.open(str(out)) as w:
        assert w.getframerate() == 16000 and w.getnframes() == stats["semantic_tokens"] * 320
    assert main(["speak", " ", "--model", str(ckpt), "--device", "cpu", "--out", str(out)]) == 2
    assert main(["voices", "delete", "bob", "--voices-dir", vd]) == 0


def test_warm_up_keeps_no_activations_for_backward(engine, monkeypatch):
    """The engine is inference only: running the vocoder at warm-up's shapes (which ran outside no_grad)
    saves nothing for backward. Saved activations were a 5.8 GiB transient at full size on a GPU."""
    import torch

    from voiced.engines.spark import vocoder_schedule, warmup

    monkeypatch.setattr(vocoder_schedule, "VOCODER_MERGE_TOKENS", 0)  # merged windows (up to 1024 tokens) take minutes on a CPU

    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    assert not any(p.requires_grad for p in (*engine.lm.parameters(), *engine.codec.parameters()))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        shapes = warmup.warm_vocoder(engine, engine.radius // 2, 4)
    assert shapes > 0 and sum(saved) == 0, f"{len(saved)} tensors ({sum(saved)} bytes) saved for backward"


def test_speaker_vectors_are_computed_once_per_speaker(engine, monkeypatch):
    """A registered voice's speaker vector is computed for its first request and reused after (the same
    values the codec gives); the cache keeps the most recently used SPEAKER_CACHE speakers."""
    import torch

    from voiced.engines.spark import engine as spark_engine

    calls = []
    real = engine.codec.speaker_vector
    monkeypatch.setattr(engine.codec, "speaker_vector", lambda g: calls.append(g.tolist()) or real(g))
    monkeypatch.setattr(spark_engine, "SPEAKER_CACHE", 3)
    engine._speakers.clear()
    ids = [[i] * 32 for i in range(5)]
    first = engine._speaker(ids[0])
    with torch.no_grad():
        assert torch.equal(first, real(torch.tensor([ids[0]]))[0])
    assert engine._speaker(ids[0]) is first and len(calls) == 1
    for g in ids[1:4]:  # three more: the oldest (ids[0]) goes
        engine._speaker(g)
    assert len(engine._speakers) == 3 and len(calls) == 4
    engine._speaker(ids[2])  # kept, and now the most recent
    assert len(calls) == 4
    engine._speaker(ids[0])
    assert len(calls) == 5 and tuple(ids[1]) not in engine._speakers and tuple(ids[2]) in engine._speakers


def test_benchmarks_can_force_every_reply_to_its_duration_cap_in_one_random_voice(ckpt, tmp_path):
    """What the benchmarks run on random weights: `use_random_voice` makes every voice name (a
    preset, a name nobody registered) one drawn speaker, and `force_reply_lengths` makes each reply
    speak until its max_seconds, over one sentence or several."""
    engine = SparkTTSEngine.load(ckpt, device="cpu", max_batch=2, max_seq_len=1024, voices_dir=tmp_path)
    speaker = engine.use_random_voice(seed=3)
    assert len(speaker) == 32 and all(0 <= g < 4096 for g in speaker)
    assert engine.voices.resolve("nobody-registered-this").global_ids == speaker
    engine.force_reply_lengths()
    got = run(engine, {1: TTSRequest("Hi.", TTSOptions(seed=1, max_seconds=0.5)),
                       2: TTSRequest("Yes. No. Maybe.", TTSOptions(voice="male", seed=2, max_seconds=0.3))})
    for rid, seconds in ((1, 0.5), (2, 0.3)):
        assert got[rid][-1].last and got[rid][-1].tokens == int(seconds * 50)
        assert audio(got[rid]).shape[0] == int(seconds * 50) * 320  # 320 samples (20 ms) a token
