"""The performance targets for one GPU, and where a benchmark's numbers stand against them: met, or
missed by how much. Each GPU benchmark judges the numbers it measured and
puts the verdicts in its JSON (`targets`) and its log."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("voiced.bench.targets")


@dataclass(frozen=True)
class Target:
    text: str
    limit: float
    unit: str
    higher_is_better: bool = False
    issue: int = 6


TARGETS = {
    "whisper_latency_ms": Target("Whisper large-v3-turbo dims, one utterance (30 s window, 32 tokens)", 25, "ms"),
    "whisper_utt_per_s": Target("Whisper large-v3-turbo dims, saturated", 200, "utt/s", higher_is_better=True),
    "spark_decode_step_ms": Target("Spark LM decode step, batch 1, sampled", 2, "ms"),
    "spark_audio_s_per_s_64": Target("Spark engine, 64 requests", 300, "audio-s/s", higher_is_better=True),
    "first_chunk_p50_ms_1": Target("first audio chunk p50, 1 request in flight", 100, "ms"),
    "first_chunk_p50_ms_16": Target("first audio chunk p50, 16 requests in flight", 150, "ms"),
    "voice_to_voice_p50_ms_16": Target("voice-to-voice p50, 16 conversations", 150, "ms"),
    "voice_to_voice_p99_ms_16": Target("voice-to-voice p99, 16 conversations", 300, "ms"),
    # a front door's voice-to-voice (as its callers hear it) over gRPC's, 16 conversations
    "door_overhead_p50_ms_audiosocket_16": Target("AudioSocket door over gRPC, voice-to-voice p50", 5, "ms"),
    "door_overhead_p50_ms_media_ws_16": Target("media WebSocket door over gRPC, voice-to-voice p50", 5, "ms"),
    # the printed memory plan against the serving peak, and the warm-up's peak over serving's
    "memory_plan_error_pct": Target("GPU memory plan against the serving peak, absolute error", 5, "%", issue=15),
    "memory_warmup_over_serving_gib": Target("GPU memory: warm-up peak over the serving peak", 0.5, "GiB", issue=15),
    # end to end, voice-to-voice as the callers hear it (the e2e bench's v2v_client_ms)
    "issue15_v2v_p50_ms_16": Target("voice-to-voice as heard p50, 16 callers", 130, "ms", issue=15),
    "issue15_v2v_p99_ms_16": Target("voice-to-voice as heard p99, 16 callers", 250, "ms", issue=15),
    "issue15_v2v_p50_ms_64": Target("voice-to-voice as heard p50, 64 callers", 200, "ms", issue=15),
    "issue15_v2v_p99_ms_64": Target("voice-to-voice as heard p99, 64 callers", 400, "ms", issue=15),
    "issue15_first_chunk_p50_ms_1": Target("first audio chunk p50, 1 caller", 70, "ms", issue=15),
    "issue15_first_chunk_p50_ms_16": Target("first audio chunk p50, 16 callers", 110, "ms", issue=15),
    # end of turn on `voiced bench turns`' set, and voice-to-voice from the caller's real end of speech (the e2e bench's v2v_real_end_ms)
    "issue25_paused_cut_off_pct": Target("pausing callers cut off", 5, "%", issue=25),
    "issue25_eot_p50_ms": Target("end of turn after the real end of speech p50", 250, "ms", issue=25),
    "issue25_eot_p90_ms": Target("end of turn after the real end of speech p90", 700, "ms", issue=25),
    "issue25_v2v_real_end_p50_ms_16": Target("voice-to-voice from the real end of speech p50, 16 callers", 350, "ms",
                                             issue=25),
    "issue25_v2v_real_end_p99_ms_16": Target("voice-to-voice from the real end of speech p99, 16 callers", 600, "ms",
                                             issue=25),
}

# The end-to-end targets, each read from one level of `voiced bench e2e`: (figure, quantile, callers).
E2E_LEVEL_TARGETS = {
    "first_chunk_p50_ms_1": ("tts_first_chunk_ms", "p50", 1),
    "first_chunk_p50_ms_16": ("tts_first_chunk_ms", "p50", 16),
    "voice_to_voice_p50_ms_16": ("first_audio_ms", "p50", 16),
    "voice_to_voice_p99_ms_16": ("first_audio_ms", "p99", 16),
    "issue15_v2v_p50_ms_16": ("v2v_client_ms", "p50", 16),
    "issue15_v2v_p99_ms_16": ("v2v_client_ms", "p99", 16),
    "issue15_v2v_p50_ms_64": ("v2v_client_ms", "p50", 64),
    "issue15_v2v_p99_ms_64": ("v2v_client_ms", "p99", 64),
    "issue15_first_chunk_p50_ms_1": ("tts_first_chunk_ms", "p50", 1),
    "issue15_first_chunk_p50_ms_16": ("tts_first_chunk_ms", "p50", 16),
    "issue25_v2v_real_end_p50_ms_16": ("v2v_real_end_ms", "p50", 16),
    "issue25_v2v_real_end_p99_ms_16": ("v2v_real_end_ms", "p99", 16),
}


def judge(measured: dict[str, float | None]) -> dict[str, dict]:
    """`{target key: measured value}` (None: not measured in this run) -> a verdict per target."""
    out = {}
    for key, value in measured.items():
        if value is None:
            continue
        t = TARGETS[key]
        gap = t.limit - value if t.higher_is_better else value - t.limit
        met = gap <= 0
        out[key] = {"target": f"{'>=' if t.higher_is_better else '<='} {t.limit:g} {t.unit}",
                    "value": round(value, 2), "met": met, "missed_by": 0.0 if met else round(gap, 2)}
        verdict = "met" if met else f"missed by {gap:.1f} {t.unit} ({gap / t.limit:.0%})"
        log.info("target: %s %s: %.1f %s, %s", t.text, out[key]["target"], value, t.unit, verdict)
    return out
