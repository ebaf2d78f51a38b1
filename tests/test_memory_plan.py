"""The GPU memory plan: validation, overrides, executor fractions, PyTorch cache sizing."""

from __future__ import annotations

import pytest

from voiced.memory_plan import KVShape, MemoryPlan, MemoryPlanError, kv_slots


def test_defaults_are_valid_and_leave_headroom():
    plan = MemoryPlan().validate()
    assert plan.whisper_kv_fraction + plan.tts_kv_fraction <= 1 - plan.headroom_fraction


def test_from_mapping_reads_the_toml_table_and_rejects_typos():
    plan = MemoryPlan.from_mapping({"whisper_kv_fraction": 0.3, "tts_kv_fraction": "0.4"})
    assert plan.whisper_kv_fraction == 0.3 and plan.tts_kv_fraction == 0.4
    assert MemoryPlan.from_mapping(None) == MemoryPlan()
    with pytest.raises(MemoryPlanError, match="unknown key.*whisper_kv_fracton.*valid keys"):
        MemoryPlan.from_mapping({"whisper_kv_fracton": 0.3})
    with pytest.raises(MemoryPlanError, match="tts_kv_fraction: expected a number"):
        MemoryPlan.from_mapping({"tts_kv_fraction": "lots"})
    with pytest.raises(MemoryPlanError, match="expected a number"):
        MemoryPlan.from_mapping({"tts_kv_fraction": True})


def test_the_environment_sets_a_share_by_its_key_and_a_short_name_is_refused_naming_it():
    """[memory] keys take the overlay every key takes (VOICED_MEMORY_<KEY>); no other name is read."""
    from voiced.config import ConfigError, load_config

    env = {"VOICED_MEMORY_WHISPER_KV_FRACTION": "0.2", "VOICED_MEMORY_TTS_KV_FRACTION": "0.5",
           "VOICED_MEMORY_WHISPER_CROSS_KV_FRACTION": "0.3", "VOICED_UNRELATED": "x"}
    plan = load_config(env=env).memory
    assert (plan.whisper_kv_fraction, plan.tts_kv_fraction, plan.whisper_cross_kv_fraction) == (0.2, 0.5, 0.3)
    with pytest.raises(ConfigError, match="VOICED_TTS_KV_FRACTION: .*use VOICED_MEMORY_TTS_KV_FRACTION"):
        load_config(env={"VOICED_TTS_KV_FRACTION": "0.3"})
    with pytest.raises(ConfigError, match=r"tts_kv_fraction = 30 must be in \[0.01, 1\)"):
        load_config(env={"VOICED_MEMORY_TTS_KV_FRACTION": "30"}).validate()
    with pytest.raises(MemoryPlanError, match="tts_kv_fraction = '30'.*0.3.*not a percentage"):
        MemoryPlan.from_mapping({"tts_kv_fraction": "30"})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"whisper_kv_fraction": 0.6, "tts_kv_fraction": 0.5}, r"sum to at most 0\.90"),
        ({"whisper_kv_fraction": 1.2}, r"whisper_kv_fraction = 1\.2 must be in"),
        ({"tts_kv_fraction": 0.0}, r"tts_kv_fraction = 0 must be in.*VOICED_MEMORY_TTS_KV_FRACTION"),
        ({"whisper_cross_kv_fraction": 1.0}, r"whisper_cross_kv_fraction = 1 must be in \(0, 1\)"),
        ({"headroom_fraction": 0.0}, r"headroom_fraction = 0 must be in"),
    ],
)
def test_validation_says_what_is_wrong(changes, message):
    with pytest.raises(MemoryPlanError, match=message):
        MemoryPlan(**changes).validate()


def test_validation_lists_every_problem():
    with pytest.raises(MemoryPlanError) as e:
        MemoryPlan(whisper_kv_fraction=2.0, whisper_cross_kv_fraction=0.0).validate()
    text = str(e.value)
    assert "whisper_kv_fraction" in text and "whisper_cross_kv_fraction" in text


def test_executor_fractions_compensate_for_what_the_first_executor_took():
    plan = MemoryPlan(whisper_kv_fraction=0.3, tts_kv_fraction=0.4)
    f = plan.executor_fractions(("whisper", "tts"))
    assert f["whisper"] == pytest.approx(0.3)
    assert f["tts"] == pytest.approx(0.4 / 0.7)  # of the 70 % still free: 40 % of the original
    free = 100.0
    after_whisper = free * (1 - f["whisper"])
    assert after_whisper * f["tts"] == pytest.approx(free * 0.4)
    g = plan.executor_fractions(("tts", "whisper"))
    assert g["tts"] == pytest.approx(0.4) and g["whisper"] == pytest.approx(0.5)
    assert plan.executor_fractions(("tts",)) == {"tts": pytest.approx(0.4)}
    with pytest.raises(ValueError, match="unknown model"):
        plan.executor_fractions(("llm",))


def test_table_shows_every_pool_and_gib_when_free_memory_is_known():
    plan = MemoryPlan(whisper_kv_fraction=0.2, whisper_cross_kv_fraction=0.5, tts_kv_fraction=0.3)
    text = plan.table(free_bytes=100 * 2**30)
    for needle in ("Whisper self-attention KV", "Whisper cross-attention KV", "Spark-TTS LM KV", "headroom",
                   "kv_cache_free_gpu_memory_fraction=0.2", "cross_kv_cache_fraction=0.5", "10.0", "30.0"):
        assert needle in text
    assert "GiB" not in plan.table()


def test_pytorch_sizing_from_the_plan():
    plan = MemoryPlan(whisper_kv_fraction=0.2, whisper_cross_kv_fraction=0.25, tts_kv_fraction=0.3)
    b = plan.budget_bytes(80 * 2**30)
    assert b["whisper_self"] + b["whisper_cross"] == int(80 * 2**30 * 0.2)
    assert b["whisper_cross"] == int(int(80 * 2**30 * 0.2) * 0.25)
    # Spark's Qwen2.5-0.5B: 24 layers, 2 KV heads of 64, bf16 -> 12 KiB per token.
    qwen = KVShape(n_layers=24, n_kv_heads=2, head_dim=64, dtype_bytes=2)
    assert qwen.bytes_per_token == 12288
    slots = kv_slots(b["tts"], qwen, tokens_per_slot=2560)
    assert slots == b["tts"] // (12288 * 2560)
    assert kv_slots(10, qwen, 2560) == 0
    with pytest.raises(ValueError):
        kv_slots(10, qwen, 0)


def test_peak_live_bytes_counts_what_is_alive_at_once():
    """Tensors alive together count together; freed ones stop counting; views add nothing."""
    import torch

    from voiced.memory_plan import peak_live_bytes

    def step():
        a = torch.ones(1000, device="meta")  # 4000 bytes
        b = (a + 1).view(10, 100)  # + 4000 (the view adds nothing)
        c = b * 2  # + 4000: 12000 at once
        del a, b
        d = c + 1  # c and d: 8000
        return d.sum()

    assert peak_live_bytes(step) == 12_000


def test_the_vocoder_transient_measured_on_meta_is_what_the_step_allocates(monkeypatch):
    """The plan's vocoder-step transient, taken on the meta device, equals what running the same step
    (the largest window batch a vocoder step decodes) allocates in PyTorch tensors on the CPU. Through the
    modules: the CPU runs no GPU kernels (the kernels' path is checked on a GPU, test_spark_gpu.py)."""
    from voiced.engines.spark import vocoder_kernels

    monkeypatch.setattr(vocoder_kernels, "enabled", lambda: False)
    import tempfile
    from pathlib import Path

    import torch

    from tests.spark_fixtures import BICODEC_YAML, ROOT_YAML
    from voiced.engines.spark.bicodec import BiCodec, BiCodecConfig
    from voiced.engines.spark.memory_plan import vocoder_step_bytes
    from voiced.engines.spark.streaming import decode_windows
    from voiced.engines.spark.vocoder_schedule import VOCODER_STEP_TOKENS, VOCODER_STEP_WINDOWS
    from voiced.memory_plan import peak_live_bytes

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "c.yaml").write_text(BICODEC_YAML.format(w2v=64, latent=32))
        (Path(tmp) / "r.yaml").write_text(ROOT_YAML)
        cfg = BiCodecConfig.from_yaml(Path(tmp) / "c.yaml", Path(tmp) / "r.yaml")
    planned = vocoder_step_bytes(cfg, torch.float32)
    codec = BiCodec(cfg).eval().requires_grad_(False)
    b, length = VOCODER_STEP_WINDOWS, VOCODER_STEP_TOKENS // VOCODER_STEP_WINDOWS
    ids, spk = torch.randint(0, 8192, (b, length)), torch.randn(b, cfg.speaker_out_dim)
    with torch.no_grad():
        measured = peak_live_bytes(lambda: decode_windows(codec, ids, spk, [length] * b))
    # the samples of the largest step's output alone, at the last layer: 1024 tokens x 320 x 4 bytes
    assert planned == measured > VOCODER_STEP_TOKENS * 320 * 4


def _tiny_codec_config():
    import tempfile
    from pathlib import Path

    from tests.spark_fixtures import BICODEC_YAML, ROOT_YAML
    from voiced.engines.spark.bicodec import BiCodecConfig

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "c.yaml").write_text(BICODEC_YAML.format(w2v=64, latent=32))
        (Path(tmp) / "r.yaml").write_text(ROOT_YAML)
        return BiCodecConfig.from_yaml(Path(tmp) / "c.yaml", Path(tmp) / "r.yaml")


def _vocoder_graph_shapes(radius: int) -> list[tuple[int, int]]:
    from voiced.engines.base import TTSOptions
    from voiced.engines.spark.vocoder_schedule import window_shapes

    opts = TTSOptions()
    return window_shapes(opts.first_chunk_tokens, opts.chunk_tokens, radius)


def test_the_vocoder_graphs_pool_row_is_what_the_largest_capture_allocates(monkeypatch):
    """The plan's row for the vocoder graphs' pool (`activation_bytes`, on the meta device) equals what the
    captured decode (end-masked, as every graph runs it) allocates in PyTorch tensors on the CPU at the
    largest captured shape, and no smaller shape (a sample of them, on meta) peaks higher. Through the
    modules, as above."""
    import torch

    from voiced.engines.spark import vocoder_kernels
    from voiced.engines.spark.bicodec import BiCodec
    from voiced.engines.spark.streaming import _install_end_masks
    from voiced.engines.spark.vocoder_graphs import activation_bytes, graphed_decode
    from voiced.memory_plan import peak_live_bytes

    monkeypatch.setattr(vocoder_kernels, "enabled", lambda: False)

    cfg = _tiny_codec_config()
    with torch.device("meta"):
        meta = BiCodec(cfg).eval().requires_grad_(False)
    shapes = _vocoder_graph_shapes(meta.receptive_radius())
    planned = activation_bytes(meta, shapes)
    assert planned == max(activation_bytes(meta, [s]) for s in shapes[::9] + shapes[-3:])

    codec = BiCodec(cfg).eval().requires_grad_(False)
    _install_end_masks(codec)
    b, length = max(shapes, key=lambda s: (s[0] * s[1], -s[0]))  # the most tokens, in one row
    ids, spk = torch.randint(0, 8192, (b, length)), torch.randn(b, cfg.speaker_out_dim)
    valid = torch.tensor([length - 3] + [length] * (b - 1))
    with torch.no_grad():
        graphed_decode(codec, ids, spk, valid)  # what the eager warm-up made before any capture (Snake's 1/alpha)
        measured = peak_live_bytes(lambda: graphed_decode(codec, ids, spk, valid))
    assert planned == measured > length * b * 320 * 4


def test_the_vocoder_graphs_shared_buffers_are_what_the_plan_counts():
    """Every graph reads and writes contiguous prefix views of one set of flat buffers, sized for the
    shape with the most rows and the one with the most tokens; `held_bytes` is their size as the CUDA
    allocator rounds it (512-byte blocks)."""
    import torch

    from voiced.engines.spark.bicodec import HOP, BiCodec
    from voiced.engines.spark.vocoder_graphs import _SharedIO, held_bytes

    cfg = _tiny_codec_config()
    codec = BiCodec(cfg).to(torch.bfloat16).eval().requires_grad_(False)
    shapes = _vocoder_graph_shapes(codec.receptive_radius())
    io = _SharedIO(codec, shapes)
    device_bufs = (io.ids, io.spk, io.valid, io.out)
    assert held_bytes(shapes, cfg.speaker_out_dim, 2) == sum(-(-t.nbytes // 512) * 512 for t in device_bufs)
    assert io.out.numel() == max(b * n for b, n in shapes) * HOP and io.valid.numel() == max(b for b, _ in shapes)
    for b, length in shapes:
        views = io.views(b, length)
        assert [tuple(v.shape) for v in views] == [(b, length), (b, cfg.speaker_out_dim), (b,), (b, length * HOP)]
        assert all(v.is_contiguous() for v in views)
        flat = (io.ids, io.spk, io.valid, io.out)
        assert all(v.data_ptr() == t.data_ptr() for v, t in zip(views, flat))


def test_with_vocoder_graphs_the_plan_holds_their_buffers_and_pool_instead_of_the_eager_transient():
    import torch

    from voiced.engines.spark.memory_plan import memory_need
    from voiced.engines.spark.qwen2 import Qwen2Config

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    kw = dict(cuda=True, workspace_bytes=1 << 20, vocoder_bytes=300 << 20)
    eager = memory_need(cfg, torch.bfloat16, 1000, 1000, 4, 512, **kw)
    graphed = memory_need(cfg, torch.bfloat16, 1000, 1000, 4, 512, **{**kw, "vocoder_bytes": 0},
                          vocoder_graph_count=91, vocoder_graph_bytes=700_000, vocoder_graph_pool_bytes=305 << 20)
    rows = {n.what: n for n in graphed.items}
    io = rows["vocoder graphs (91): shared inputs and output"]
    pool = next(n for w, n in rows.items() if w.startswith("vocoder graphs' pool"))
    assert (io.bytes, io.transient, pool.bytes, pool.transient) == (700_000, False, 305 << 20, False)
    assert not any("vocoder" in n.what for n in graphed.items if n.transient)
    assert any("vocoder" in n.what and n.transient for n in eager.items)
