"""Between the wire (voiced.v1 protobuf messages) and the daemon's plain dataclasses.

Validation lives here: every way a caller's config can be wrong gets an INVALID_ARGUMENT with a
message that names the field and what to set.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from voiced_client.proto import voiced_pb2 as pb

from voiced.audio.ingest import MAX_RATE, MIN_RATE, AudioFormatError, Format
from voiced.config import Config
from voiced.engines.base import ASROptions, Transcript, TTSOptions
from voiced.core.segmenter import SegmenterConfig

MAX_BEAM = 4


class SessionError(Exception):
    """Ends a call with a gRPC status; the message is for the caller."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(message: str) -> SessionError:
    return SessionError(grpc.StatusCode.INVALID_ARGUMENT, message)


@dataclass
class SessionSpec:
    session_id: str
    input: Format
    output: Format
    segmentation: SegmenterConfig
    recognize: bool  # False: speech events only
    asr: ASROptions
    interim_results: bool
    keep_hallucinations: bool
    agent: str
    system_prompt: str
    tts: TTSOptions
    barge_in: bool
    barge_in_min_speech_ms: int
    effective: pb.SessionConfig = field(repr=False, default_factory=pb.SessionConfig)


_ENCODING_NAMES = {pb.LINEAR16: "LINEAR16", pb.MULAW: "MULAW", pb.ALAW: "ALAW"}
_ENCODING_VALUES = {v: k for k, v in _ENCODING_NAMES.items()}


def audio_format(msg: pb.AudioFormat, what: str) -> Format:
    if msg.encoding not in _ENCODING_NAMES:
        raise invalid(
            f"{what}.encoding {pb.AudioEncoding.Name(msg.encoding) if msg.encoding in pb.AudioEncoding.values() else msg.encoding}"
            f" is not supported; set it to LINEAR16, MULAW or ALAW"
        )
    fmt = Format(_ENCODING_NAMES[msg.encoding], msg.sample_rate_hz)
    try:
        fmt.validate(what)
    except AudioFormatError as e:
        raise invalid(str(e)) from None
    return fmt


def format_to_proto(fmt: Format) -> pb.AudioFormat:
    return pb.AudioFormat(encoding=_ENCODING_VALUES[fmt.encoding], sample_rate_hz=fmt.sample_rate)


def _opt(msg, name: str, default):
    return getattr(msg, name) if msg.HasField(name) else default


def asr_options(rec: pb.RecognitionConfig, config: Config, what: str = "recognition") -> ASROptions:
    a = config.asr
    beam = _opt(rec, "beam_size", a.beam_size)
    if not 1 <= beam <= MAX_BEAM:
        raise invalid(f"{what}.beam_size {beam} is outside 1..{MAX_BEAM}")
    task = {pb.TASK_UNSPECIFIED: "transcribe", pb.TRANSCRIBE: "transcribe", pb.TRANSLATE: "translate"}.get(rec.task)
    if task is None:
        raise invalid(f"{what}.task {rec.task} is unknown; use TRANSCRIBE or TRANSLATE")
    return ASROptions(
        language=(rec.language or a.language or None),
        task=task,
        beam_size=beam,
        initial_prompt=rec.initial_prompt or None,
        max_new_tokens=a.max_new_tokens or None,
        no_speech_threshold=_opt(rec, "no_speech_threshold", a.no_speech_threshold),
        logprob_threshold=_opt(rec, "logprob_threshold", a.logprob_threshold),
        compression_ratio_threshold=_opt(rec, "compression_ratio_threshold", a.compression_ratio_threshold),
    )


def tts_options(speech: pb.SpeechConfig, config: Config) -> TTSOptions:
    t = config.tts
    opts = TTSOptions(
        voice=speech.voice or t.voice or None,
        seed=_opt(speech, "seed", None),
        temperature=_opt(speech, "temperature", t.temperature),
        top_k=_opt(speech, "top_k", t.top_k),
        top_p=_opt(speech, "top_p", t.top_p),
        max_seconds=min(_opt(speech, "max_seconds", t.max_seconds), t.max_seconds),
        first_chunk_tokens=t.first_chunk_tokens,
        chunk_tokens=t.chunk_tokens,
    )
    if not 0.0 <= opts.temperature <= 2.0:
        raise invalid(f"speech.temperature {opts.temperature} is outside 0..2")
    if opts.max_seconds <= 0:
        raise invalid(f"speech.max_seconds {opts.max_seconds} must be positive")
    if opts.top_k < 0:
        raise invalid(f"speech.top_k {opts.top_k} must be 0 (off) or positive")
    if not 0.0 < opts.top_p <= 1.0:
        raise invalid(f"speech.top_p {opts.top_p} is outside (0, 1]")
    return opts


def session_spec(cfg: pb.SessionConfig, config: Config, session_id: str, agents: list[str]) -> SessionSpec:
    if not cfg.HasField("input_format"):
        raise invalid("config.input_format is required: set encoding (LINEAR16, MULAW, ALAW) and sample_rate_hz")
    inp = audio_format(cfg.input_format, "input_format")
    out = audio_format(cfg.output_format, "output_format") if cfg.HasField("output_format") else inp

    seg_msg, d = cfg.segmentation, config.segmentation
    mode = {pb.SEGMENTATION_MODE_UNSPECIFIED: "auto", pb.AUTO: "auto", pb.PUSH_TO_TALK: "push_to_talk"}.get(
        seg_msg.mode
    )
    if mode is None:
        raise invalid(f"segmentation.mode {seg_msg.mode} is unknown; use AUTO or PUSH_TO_TALK")
    seg = SegmenterConfig(
        mode=mode,
        vad_aggressiveness=_opt(seg_msg, "vad_aggressiveness", d.vad_aggressiveness),
        pre_roll_ms=_opt(seg_msg, "pre_roll_ms", d.pre_roll_ms),
        hangover_ms=_opt(seg_msg, "hangover_ms", d.hangover_ms),
        min_speech_ms=_opt(seg_msg, "min_speech_ms", d.min_speech_ms),
        max_utterance_ms=_opt(seg_msg, "max_utterance_ms", d.max_utterance_ms),
    )
    try:
        seg.validate()
    except ValueError as e:
        raise invalid(f"segmentation: {e}") from None

    rec = cfg.recognition
    agent = cfg.agent.name or config.agent.default
    if agent not in agents:
        raise invalid(f"agent.name {agent!r} is not available; this server has: {', '.join(agents)}")
    barge = cfg.barge_in
    barge_min = _opt(barge, "min_speech_ms", config.barge_in.min_speech_ms)
    if not 20 <= barge_min <= 5000:
        raise invalid(f"barge_in.min_speech_ms {barge_min} is outside 20..5000")

    spec = SessionSpec(
        session_id=session_id,
        input=inp,
        output=out,
        segmentation=seg,
        recognize=not rec.disabled,
        asr=asr_options(rec, config),
        interim_results=rec.interim_results,
        keep_hallucinations=rec.keep_hallucinations,
        agent=agent,
        system_prompt=cfg.agent.system_prompt or config.agent.system_prompt,
        tts=tts_options(cfg.speech, config),
        barge_in=_opt(barge, "enabled", config.barge_in.enabled),
        barge_in_min_speech_ms=barge_min,
    )
    spec.effective = effective_config(cfg, spec)
    return spec


def effective_config(cfg: pb.SessionConfig, spec: SessionSpec) -> pb.SessionConfig:
    """The caller's config with every default filled in, echoed back in SessionStarted."""
    eff = pb.SessionConfig()
    eff.CopyFrom(cfg)
    eff.session_id = spec.session_id
    eff.input_format.CopyFrom(format_to_proto(spec.input))
    eff.output_format.CopyFrom(format_to_proto(spec.output))
    s = spec.segmentation
    eff.segmentation.mode = pb.PUSH_TO_TALK if s.mode == "push_to_talk" else pb.AUTO
    for name in ("vad_aggressiveness", "pre_roll_ms", "hangover_ms", "min_speech_ms", "max_utterance_ms"):
        setattr(eff.segmentation, name, getattr(s, name))
    eff.recognition.language = spec.asr.language or ""
    eff.recognition.beam_size = spec.asr.beam_size
    eff.recognition.task = pb.TRANSLATE if spec.asr.task == "translate" else pb.TRANSCRIBE
    eff.agent.name = spec.agent
    eff.barge_in.enabled = spec.barge_in
    eff.barge_in.min_speech_ms = spec.barge_in_min_speech_ms
    eff.speech.voice = spec.tts.voice or ""
    return eff


def transcript_to_proto(
    t: Transcript, *, is_final: bool, start_ms: int, end_ms: int, latency_ms: float = 0.0
) -> pb.Transcript:
    return pb.Transcript(
        text=t.text,
        is_final=is_final,
        language=t.language,
        start_ms=start_ms,
        end_ms=end_ms,
        avg_logprob=t.avg_logprob,
        no_speech_prob=t.no_speech_prob,
        compression_ratio=t.compression_ratio,
        tokens=t.tokens,
        latency_ms=latency_ms,
        is_hallucination=t.is_hallucination,
    )


__all__ = ["MIN_RATE", "MAX_RATE", "SessionError", "SessionSpec", "session_spec", "audio_format"]
