"""Between the wire (voiced.v1 protobuf messages) and the core's plain types.

Only mapping lives here: defaults and validation are the core's (voiced.core.spec), so every door
refuses the same settings with the same message. What is protobuf-only (an enum value out of range,
a message sent twice, an empty oneof) is checked here.
"""

from __future__ import annotations

from voiced_client.proto import voiced_pb2 as pb

from voiced.audio.ingest import Format
from voiced.config import Config
from voiced.core import events as ev
from voiced.core.errors import invalid
from voiced.core.spec import SessionSpec, asr_options_for, check_format, segmentation_for, tts_options_for
from voiced.engines.base import ASROptions, Transcript, TTSOptions

_ENCODING_NAMES = {pb.LINEAR16: "LINEAR16", pb.MULAW: "MULAW", pb.ALAW: "ALAW"}
_ENCODING_VALUES = {v: k for k, v in _ENCODING_NAMES.items()}
_TASKS = {pb.TASK_UNSPECIFIED: "transcribe", pb.TRANSCRIBE: "transcribe", pb.TRANSLATE: "translate"}
_MODES = {pb.SEGMENTATION_MODE_UNSPECIFIED: "auto", pb.AUTO: "auto", pb.PUSH_TO_TALK: "push_to_talk"}
_TURN_DETECTION = {pb.TURN_DETECTION_UNSPECIFIED: None, pb.TURN_DETECTION_SMART: "smart",
                   pb.TURN_DETECTION_SILENCE: "silence"}
_TURN_DETECTION_VALUES = {v: k for k, v in _TURN_DETECTION.items() if v}
_EAGERNESS = {pb.EAGERNESS_UNSPECIFIED: None, pb.EAGERNESS_LOW: "low", pb.EAGERNESS_MEDIUM: "medium",
              pb.EAGERNESS_HIGH: "high"}
_EAGERNESS_VALUES = {v: k for k, v in _EAGERNESS.items() if v}


# ---------------------------------------------------------------------------- settings in


def audio_format(msg: pb.AudioFormat, what: str) -> Format:
    if msg.encoding not in _ENCODING_NAMES:
        name = pb.AudioEncoding.Name(msg.encoding) if msg.encoding in pb.AudioEncoding.values() else msg.encoding
        raise invalid(f"{what}.encoding {name} is not supported; set it to LINEAR16, MULAW or ALAW")
    return check_format(Format(_ENCODING_NAMES[msg.encoding], msg.sample_rate_hz), what)


def format_to_proto(fmt: Format) -> pb.AudioFormat:
    return pb.AudioFormat(encoding=_ENCODING_VALUES[fmt.encoding], sample_rate_hz=fmt.sample_rate)


def _opt(msg, name: str):
    """A proto3 `optional` field's value, or None when unset (the core then uses its default)."""
    return getattr(msg, name) if msg.HasField(name) else None


def asr_options(rec: pb.RecognitionConfig, config: Config, what: str = "recognition") -> ASROptions:
    task = _TASKS.get(rec.task)
    if task is None:
        raise invalid(f"{what}.task {rec.task} is unknown; use TRANSCRIBE or TRANSLATE")
    return asr_options_for(
        config, language=rec.language or None, task=task, beam_size=_opt(rec, "beam_size"),
        initial_prompt=rec.initial_prompt or None, no_speech_threshold=_opt(rec, "no_speech_threshold"),
        logprob_threshold=_opt(rec, "logprob_threshold"),
        compression_ratio_threshold=_opt(rec, "compression_ratio_threshold"),
        word_timestamps=rec.word_timestamps, what=what,
    )


def tts_options(speech: pb.SpeechConfig, config: Config) -> TTSOptions:
    return tts_options_for(
        config, voice=speech.voice or None, seed=_opt(speech, "seed"), temperature=_opt(speech, "temperature"),
        top_k=_opt(speech, "top_k"), top_p=_opt(speech, "top_p"), max_seconds=_opt(speech, "max_seconds"),
    )


def session_spec(cfg: pb.SessionConfig, services, session_id: str, conversational: bool) -> SessionSpec:
    """The first message of a stream -> the session's spec (raises SessionError BAD_INPUT)."""
    if not cfg.HasField("input_format"):
        raise invalid("config.input_format is required: set encoding (LINEAR16, MULAW, ALAW) and sample_rate_hz")
    inp = audio_format(cfg.input_format, "input_format")
    out = audio_format(cfg.output_format, "output_format") if cfg.HasField("output_format") else None
    seg = cfg.segmentation
    mode = _MODES.get(seg.mode)
    if mode is None:
        raise invalid(f"segmentation.mode {seg.mode} is unknown; use AUTO or PUSH_TO_TALK")
    if seg.turn_detection not in _TURN_DETECTION:
        raise invalid(f"segmentation.turn_detection {seg.turn_detection} is unknown; use TURN_DETECTION_SMART or "
                      "TURN_DETECTION_SILENCE")
    if seg.eagerness not in _EAGERNESS:
        raise invalid(f"segmentation.eagerness {seg.eagerness} is unknown; use EAGERNESS_LOW, EAGERNESS_MEDIUM or "
                      "EAGERNESS_HIGH")
    segmentation = segmentation_for(
        services.config, mode=mode, vad_aggressiveness=_opt(seg, "vad_aggressiveness"),
        pre_roll_ms=_opt(seg, "pre_roll_ms"), hangover_ms=_opt(seg, "hangover_ms"),
        min_speech_ms=_opt(seg, "min_speech_ms"), max_utterance_ms=_opt(seg, "max_utterance_ms"),
        turn_detection=_TURN_DETECTION[seg.turn_detection], eagerness=_EAGERNESS[seg.eagerness],
    )
    rec = cfg.recognition
    if conversational and rec.disabled:
        raise invalid("recognition.disabled is only for StreamingRecognize; Converse needs transcripts")
    return services.spec(
        front="grpc", session_id=session_id, input=inp, output=out, segmentation=segmentation,
        agent=cfg.agent.name or None, system_prompt=cfg.agent.system_prompt or None,
        asr=asr_options(rec, services.config), tts=tts_options(cfg.speech, services.config),
        recognize=not rec.disabled, interim_results=rec.interim_results,
        keep_hallucinations=rec.keep_hallucinations,
        barge_in=_opt(cfg.barge_in, "enabled"), barge_in_min_speech_ms=_opt(cfg.barge_in, "min_speech_ms"),
    )


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
    eff.segmentation.turn_detection = _TURN_DETECTION_VALUES[s.turn_detection]
    eff.segmentation.eagerness = _EAGERNESS_VALUES[s.eagerness]
    eff.recognition.language = spec.asr.language or ""
    eff.recognition.beam_size = spec.asr.beam_size
    eff.recognition.task = pb.TRANSLATE if spec.asr.task == "translate" else pb.TRANSCRIBE
    eff.recognition.word_timestamps = spec.asr.word_timestamps
    eff.agent.name = spec.agent
    eff.barge_in.enabled = spec.barge_in
    eff.barge_in.min_speech_ms = spec.barge_in_min_speech_ms
    eff.speech.voice = spec.tts.voice or ""
    return eff


# ---------------------------------------------------------------------------- a stream in


def input_event(request: pb.SessionRequest) -> ev.InputEvent:
    """A request after the config -> the core's input event."""
    kind = request.WhichOneof("request")
    if kind == "audio":
        return ev.AudioIn(request.audio)
    if kind == "control":
        return control_event(request.control)
    if kind == "text":
        return ev.UserText(request.text)
    if kind == "config":
        raise invalid("config was already sent; send it once, as the first message of the stream")
    raise invalid("empty request: set one of config, audio, text or control")


def control_event(control: pb.Control) -> ev.InputEvent:
    kind = control.WhichOneof("event")
    if kind == "talk_start":
        return ev.TalkStart()
    if kind == "talk_end":
        return ev.TalkEnd()
    if kind == "speak":
        return ev.Speak(control.speak.text)
    if kind == "stop_speaking":
        return ev.StopSpeaking()
    raise invalid("empty control: set talk_start, talk_end, speak or stop_speaking")


# ---------------------------------------------------------------------------- events out


def transcript_to_proto(t: Transcript, *, is_final: bool, start_ms: int, end_ms: int,
                        latency_ms: float = 0.0) -> pb.Transcript:
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
        words=[pb.WordInfo(word=w.word, start_ms=round(w.start_s * 1000), end_ms=round(w.end_s * 1000),
                           probability=w.probability) for w in t.words],  # (the core put them in caller time)
    )


def _reply(kind, e) -> pb.ReplyEvent:
    return pb.ReplyEvent(type=kind, reply_id=e.reply_id, audio_sent_ms=e.audio_sent_ms,
                         caller_offset_ms=e.caller_offset_ms)


def event_to_proto(e, config: pb.SessionConfig) -> pb.SessionEvent | None:
    """A core output event -> the SessionEvent a gRPC caller gets (`config`: its first message, for
    the effective config in SessionStarted); None for an event voiced.v1 does not send."""
    t = type(e)
    out = pb.SessionEvent(session_id=e.session_id, turn_id=e.turn_id)
    if t is ev.TurnWithoutWords:
        out.dropped.CopyFrom(pb.TranscriptDropped(text=e.text, reason=e.reason, start_ms=e.start_ms, end_ms=e.end_ms))
    elif t is ev.AudioOut:
        out.audio.CopyFrom(pb.AudioChunk(reply_id=e.reply_id, sequence=e.sequence, offset_ms=e.offset_ms,
                                         last=e.last, audio=e.audio, latency_ms=e.latency_ms))
    elif t is ev.TranscriptOut:
        out.transcript.CopyFrom(transcript_to_proto(e.transcript, is_final=e.is_final, start_ms=e.start_ms,
                                                    end_ms=e.end_ms, latency_ms=e.latency_ms))
    elif t is ev.SpeechStarted:
        out.speech.CopyFrom(pb.SpeechActivity(type=pb.SpeechActivity.SPEECH_STARTED, offset_ms=e.offset_ms))
    elif t is ev.SpeechEnded:
        out.speech.CopyFrom(pb.SpeechActivity(type=pb.SpeechActivity.SPEECH_ENDED, offset_ms=e.offset_ms))
    elif t is ev.AgentTextOut:
        out.agent_text.CopyFrom(pb.AgentText(text=e.text, last=e.last, latency_ms=e.latency_ms))
    elif t is ev.ReplyStarted:
        out.reply.CopyFrom(pb.ReplyEvent(type=pb.ReplyEvent.REPLY_STARTED, reply_id=e.reply_id, text=e.text))
    elif t is ev.ReplyFinished:
        out.reply.CopyFrom(_reply(pb.ReplyEvent.REPLY_FINISHED, e))
    elif t is ev.ReplyInterrupted:
        out.reply.CopyFrom(_reply(pb.ReplyEvent.REPLY_INTERRUPTED, e))
    elif t is ev.NoticeOut:
        out.notice.CopyFrom(pb.Notice(code=e.code, message=e.message))
    elif t is ev.HangupOut:
        # voiced.v1 has no hangup event: a notice says why, then the stream ends with OK.
        out.notice.CopyFrom(pb.Notice(code="HANGUP", message=e.reason or "the agent ended the call"))
    elif t is ev.Started:
        out.started.CopyFrom(pb.SessionStarted(session_id=e.session_id,
                                               effective_config=effective_config(config, e.spec)))
    else:
        raise TypeError(f"no voiced.v1 event for {t.__name__}")
    return out


def voice_to_proto(v) -> pb.Voice:
    return pb.Voice(name=v.name, kind=v.kind, description=v.description)
