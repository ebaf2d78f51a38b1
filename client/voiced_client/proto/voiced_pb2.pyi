from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AudioEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUDIO_ENCODING_UNSPECIFIED: _ClassVar[AudioEncoding]
    LINEAR16: _ClassVar[AudioEncoding]
    MULAW: _ClassVar[AudioEncoding]
    ALAW: _ClassVar[AudioEncoding]

class SegmentationMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SEGMENTATION_MODE_UNSPECIFIED: _ClassVar[SegmentationMode]
    AUTO: _ClassVar[SegmentationMode]
    PUSH_TO_TALK: _ClassVar[SegmentationMode]

class TurnDetection(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TURN_DETECTION_UNSPECIFIED: _ClassVar[TurnDetection]
    TURN_DETECTION_SMART: _ClassVar[TurnDetection]
    TURN_DETECTION_SILENCE: _ClassVar[TurnDetection]

class Eagerness(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EAGERNESS_UNSPECIFIED: _ClassVar[Eagerness]
    EAGERNESS_LOW: _ClassVar[Eagerness]
    EAGERNESS_MEDIUM: _ClassVar[Eagerness]
    EAGERNESS_HIGH: _ClassVar[Eagerness]

class Task(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TASK_UNSPECIFIED: _ClassVar[Task]
    TRANSCRIBE: _ClassVar[Task]
    TRANSLATE: _ClassVar[Task]
AUDIO_ENCODING_UNSPECIFIED: AudioEncoding
LINEAR16: AudioEncoding
MULAW: AudioEncoding
ALAW: AudioEncoding
SEGMENTATION_MODE_UNSPECIFIED: SegmentationMode
AUTO: SegmentationMode
PUSH_TO_TALK: SegmentationMode
TURN_DETECTION_UNSPECIFIED: TurnDetection
TURN_DETECTION_SMART: TurnDetection
TURN_DETECTION_SILENCE: TurnDetection
EAGERNESS_UNSPECIFIED: Eagerness
EAGERNESS_LOW: Eagerness
EAGERNESS_MEDIUM: Eagerness
EAGERNESS_HIGH: Eagerness
TASK_UNSPECIFIED: Task
TRANSCRIBE: Task
TRANSLATE: Task

class AudioFormat(_message.Message):
    __slots__ = ("encoding", "sample_rate_hz")
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    encoding: AudioEncoding
    sample_rate_hz: int
    def __init__(self, encoding: _Optional[_Union[AudioEncoding, str]] = ..., sample_rate_hz: _Optional[int] = ...) -> None: ...

class SegmentationConfig(_message.Message):
    __slots__ = ("mode", "vad_aggressiveness", "pre_roll_ms", "hangover_ms", "min_speech_ms", "max_utterance_ms", "turn_detection", "eagerness")
    MODE_FIELD_NUMBER: _ClassVar[int]
    VAD_AGGRESSIVENESS_FIELD_NUMBER: _ClassVar[int]
    PRE_ROLL_MS_FIELD_NUMBER: _ClassVar[int]
    HANGOVER_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_SPEECH_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_UTTERANCE_MS_FIELD_NUMBER: _ClassVar[int]
    TURN_DETECTION_FIELD_NUMBER: _ClassVar[int]
    EAGERNESS_FIELD_NUMBER: _ClassVar[int]
    mode: SegmentationMode
    vad_aggressiveness: int
    pre_roll_ms: int
    hangover_ms: int
    min_speech_ms: int
    max_utterance_ms: int
    turn_detection: TurnDetection
    eagerness: Eagerness
    def __init__(self, mode: _Optional[_Union[SegmentationMode, str]] = ..., vad_aggressiveness: _Optional[int] = ..., pre_roll_ms: _Optional[int] = ..., hangover_ms: _Optional[int] = ..., min_speech_ms: _Optional[int] = ..., max_utterance_ms: _Optional[int] = ..., turn_detection: _Optional[_Union[TurnDetection, str]] = ..., eagerness: _Optional[_Union[Eagerness, str]] = ...) -> None: ...

class RecognitionConfig(_message.Message):
    __slots__ = ("disabled", "language", "task", "interim_results", "beam_size", "initial_prompt", "no_speech_threshold", "logprob_threshold", "compression_ratio_threshold", "keep_hallucinations", "word_timestamps")
    DISABLED_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    INTERIM_RESULTS_FIELD_NUMBER: _ClassVar[int]
    BEAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    INITIAL_PROMPT_FIELD_NUMBER: _ClassVar[int]
    NO_SPEECH_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    KEEP_HALLUCINATIONS_FIELD_NUMBER: _ClassVar[int]
    WORD_TIMESTAMPS_FIELD_NUMBER: _ClassVar[int]
    disabled: bool
    language: str
    task: Task
    interim_results: bool
    beam_size: int
    initial_prompt: str
    no_speech_threshold: float
    logprob_threshold: float
    compression_ratio_threshold: float
    keep_hallucinations: bool
    word_timestamps: bool
    def __init__(self, disabled: _Optional[bool] = ..., language: _Optional[str] = ..., task: _Optional[_Union[Task, str]] = ..., interim_results: _Optional[bool] = ..., beam_size: _Optional[int] = ..., initial_prompt: _Optional[str] = ..., no_speech_threshold: _Optional[float] = ..., logprob_threshold: _Optional[float] = ..., compression_ratio_threshold: _Optional[float] = ..., keep_hallucinations: _Optional[bool] = ..., word_timestamps: _Optional[bool] = ...) -> None: ...

class SpeechConfig(_message.Message):
    __slots__ = ("voice", "seed", "temperature", "top_k", "top_p", "max_seconds")
    VOICE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MAX_SECONDS_FIELD_NUMBER: _ClassVar[int]
    voice: str
    seed: int
    temperature: float
    top_k: int
    top_p: float
    max_seconds: float
    def __init__(self, voice: _Optional[str] = ..., seed: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., max_seconds: _Optional[float] = ...) -> None: ...

class AgentConfig(_message.Message):
    __slots__ = ("name", "system_prompt")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    system_prompt: str
    def __init__(self, name: _Optional[str] = ..., system_prompt: _Optional[str] = ...) -> None: ...

class BargeInConfig(_message.Message):
    __slots__ = ("enabled", "min_speech_ms")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MIN_SPEECH_MS_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    min_speech_ms: int
    def __init__(self, enabled: _Optional[bool] = ..., min_speech_ms: _Optional[int] = ...) -> None: ...

class SessionConfig(_message.Message):
    __slots__ = ("input_format", "output_format", "segmentation", "recognition", "speech", "agent", "barge_in", "session_id")
    INPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    SEGMENTATION_FIELD_NUMBER: _ClassVar[int]
    RECOGNITION_FIELD_NUMBER: _ClassVar[int]
    SPEECH_FIELD_NUMBER: _ClassVar[int]
    AGENT_FIELD_NUMBER: _ClassVar[int]
    BARGE_IN_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    input_format: AudioFormat
    output_format: AudioFormat
    segmentation: SegmentationConfig
    recognition: RecognitionConfig
    speech: SpeechConfig
    agent: AgentConfig
    barge_in: BargeInConfig
    session_id: str
    def __init__(self, input_format: _Optional[_Union[AudioFormat, _Mapping]] = ..., output_format: _Optional[_Union[AudioFormat, _Mapping]] = ..., segmentation: _Optional[_Union[SegmentationConfig, _Mapping]] = ..., recognition: _Optional[_Union[RecognitionConfig, _Mapping]] = ..., speech: _Optional[_Union[SpeechConfig, _Mapping]] = ..., agent: _Optional[_Union[AgentConfig, _Mapping]] = ..., barge_in: _Optional[_Union[BargeInConfig, _Mapping]] = ..., session_id: _Optional[str] = ...) -> None: ...

class TalkStart(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TalkEnd(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Speak(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class StopSpeaking(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Control(_message.Message):
    __slots__ = ("talk_start", "talk_end", "speak", "stop_speaking")
    TALK_START_FIELD_NUMBER: _ClassVar[int]
    TALK_END_FIELD_NUMBER: _ClassVar[int]
    SPEAK_FIELD_NUMBER: _ClassVar[int]
    STOP_SPEAKING_FIELD_NUMBER: _ClassVar[int]
    talk_start: TalkStart
    talk_end: TalkEnd
    speak: Speak
    stop_speaking: StopSpeaking
    def __init__(self, talk_start: _Optional[_Union[TalkStart, _Mapping]] = ..., talk_end: _Optional[_Union[TalkEnd, _Mapping]] = ..., speak: _Optional[_Union[Speak, _Mapping]] = ..., stop_speaking: _Optional[_Union[StopSpeaking, _Mapping]] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("config", "audio", "control", "text")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    config: SessionConfig
    audio: bytes
    control: Control
    text: str
    def __init__(self, config: _Optional[_Union[SessionConfig, _Mapping]] = ..., audio: _Optional[bytes] = ..., control: _Optional[_Union[Control, _Mapping]] = ..., text: _Optional[str] = ...) -> None: ...

class SessionStarted(_message.Message):
    __slots__ = ("session_id", "effective_config")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EFFECTIVE_CONFIG_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    effective_config: SessionConfig
    def __init__(self, session_id: _Optional[str] = ..., effective_config: _Optional[_Union[SessionConfig, _Mapping]] = ...) -> None: ...

class SpeechActivity(_message.Message):
    __slots__ = ("type", "offset_ms")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[SpeechActivity.Type]
        SPEECH_STARTED: _ClassVar[SpeechActivity.Type]
        SPEECH_ENDED: _ClassVar[SpeechActivity.Type]
    TYPE_UNSPECIFIED: SpeechActivity.Type
    SPEECH_STARTED: SpeechActivity.Type
    SPEECH_ENDED: SpeechActivity.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_MS_FIELD_NUMBER: _ClassVar[int]
    type: SpeechActivity.Type
    offset_ms: int
    def __init__(self, type: _Optional[_Union[SpeechActivity.Type, str]] = ..., offset_ms: _Optional[int] = ...) -> None: ...

class Transcript(_message.Message):
    __slots__ = ("text", "is_final", "language", "start_ms", "end_ms", "avg_logprob", "no_speech_prob", "compression_ratio", "tokens", "latency_ms", "is_hallucination", "words")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IS_FINAL_FIELD_NUMBER: _ClassVar[int]
    LANGUAGE_FIELD_NUMBER: _ClassVar[int]
    START_MS_FIELD_NUMBER: _ClassVar[int]
    END_MS_FIELD_NUMBER: _ClassVar[int]
    AVG_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NO_SPEECH_PROB_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_RATIO_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    IS_HALLUCINATION_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    is_final: bool
    language: str
    start_ms: int
    end_ms: int
    avg_logprob: float
    no_speech_prob: float
    compression_ratio: float
    tokens: _containers.RepeatedScalarFieldContainer[int]
    latency_ms: float
    is_hallucination: bool
    words: _containers.RepeatedCompositeFieldContainer[WordInfo]
    def __init__(self, text: _Optional[str] = ..., is_final: _Optional[bool] = ..., language: _Optional[str] = ..., start_ms: _Optional[int] = ..., end_ms: _Optional[int] = ..., avg_logprob: _Optional[float] = ..., no_speech_prob: _Optional[float] = ..., compression_ratio: _Optional[float] = ..., tokens: _Optional[_Iterable[int]] = ..., latency_ms: _Optional[float] = ..., is_hallucination: _Optional[bool] = ..., words: _Optional[_Iterable[_Union[WordInfo, _Mapping]]] = ...) -> None: ...

class WordInfo(_message.Message):
    __slots__ = ("word", "start_ms", "end_ms", "probability")
    WORD_FIELD_NUMBER: _ClassVar[int]
    START_MS_FIELD_NUMBER: _ClassVar[int]
    END_MS_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    word: str
    start_ms: int
    end_ms: int
    probability: float
    def __init__(self, word: _Optional[str] = ..., start_ms: _Optional[int] = ..., end_ms: _Optional[int] = ..., probability: _Optional[float] = ...) -> None: ...

class AgentText(_message.Message):
    __slots__ = ("text", "last", "latency_ms")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    text: str
    last: bool
    latency_ms: float
    def __init__(self, text: _Optional[str] = ..., last: _Optional[bool] = ..., latency_ms: _Optional[float] = ...) -> None: ...

class ReplyEvent(_message.Message):
    __slots__ = ("type", "reply_id", "text", "audio_sent_ms", "caller_offset_ms")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        TYPE_UNSPECIFIED: _ClassVar[ReplyEvent.Type]
        REPLY_STARTED: _ClassVar[ReplyEvent.Type]
        REPLY_FINISHED: _ClassVar[ReplyEvent.Type]
        REPLY_INTERRUPTED: _ClassVar[ReplyEvent.Type]
    TYPE_UNSPECIFIED: ReplyEvent.Type
    REPLY_STARTED: ReplyEvent.Type
    REPLY_FINISHED: ReplyEvent.Type
    REPLY_INTERRUPTED: ReplyEvent.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_SENT_MS_FIELD_NUMBER: _ClassVar[int]
    CALLER_OFFSET_MS_FIELD_NUMBER: _ClassVar[int]
    type: ReplyEvent.Type
    reply_id: int
    text: str
    audio_sent_ms: int
    caller_offset_ms: int
    def __init__(self, type: _Optional[_Union[ReplyEvent.Type, str]] = ..., reply_id: _Optional[int] = ..., text: _Optional[str] = ..., audio_sent_ms: _Optional[int] = ..., caller_offset_ms: _Optional[int] = ...) -> None: ...

class AudioChunk(_message.Message):
    __slots__ = ("reply_id", "sequence", "offset_ms", "last", "audio", "latency_ms")
    REPLY_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    reply_id: int
    sequence: int
    offset_ms: int
    last: bool
    audio: bytes
    latency_ms: float
    def __init__(self, reply_id: _Optional[int] = ..., sequence: _Optional[int] = ..., offset_ms: _Optional[int] = ..., last: _Optional[bool] = ..., audio: _Optional[bytes] = ..., latency_ms: _Optional[float] = ...) -> None: ...

class Notice(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class TranscriptDropped(_message.Message):
    __slots__ = ("text", "reason", "start_ms", "end_ms")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    START_MS_FIELD_NUMBER: _ClassVar[int]
    END_MS_FIELD_NUMBER: _ClassVar[int]
    text: str
    reason: str
    start_ms: int
    end_ms: int
    def __init__(self, text: _Optional[str] = ..., reason: _Optional[str] = ..., start_ms: _Optional[int] = ..., end_ms: _Optional[int] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("session_id", "turn_id", "started", "speech", "transcript", "agent_text", "reply", "audio", "notice", "dropped")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    SPEECH_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    AGENT_TEXT_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    turn_id: int
    started: SessionStarted
    speech: SpeechActivity
    transcript: Transcript
    agent_text: AgentText
    reply: ReplyEvent
    audio: AudioChunk
    notice: Notice
    dropped: TranscriptDropped
    def __init__(self, session_id: _Optional[str] = ..., turn_id: _Optional[int] = ..., started: _Optional[_Union[SessionStarted, _Mapping]] = ..., speech: _Optional[_Union[SpeechActivity, _Mapping]] = ..., transcript: _Optional[_Union[Transcript, _Mapping]] = ..., agent_text: _Optional[_Union[AgentText, _Mapping]] = ..., reply: _Optional[_Union[ReplyEvent, _Mapping]] = ..., audio: _Optional[_Union[AudioChunk, _Mapping]] = ..., notice: _Optional[_Union[Notice, _Mapping]] = ..., dropped: _Optional[_Union[TranscriptDropped, _Mapping]] = ...) -> None: ...

class RecognizeRequest(_message.Message):
    __slots__ = ("format", "audio", "recognition")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    RECOGNITION_FIELD_NUMBER: _ClassVar[int]
    format: AudioFormat
    audio: bytes
    recognition: RecognitionConfig
    def __init__(self, format: _Optional[_Union[AudioFormat, _Mapping]] = ..., audio: _Optional[bytes] = ..., recognition: _Optional[_Union[RecognitionConfig, _Mapping]] = ...) -> None: ...

class RecognizeResponse(_message.Message):
    __slots__ = ("results", "duration_s")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[Transcript]
    duration_s: float
    def __init__(self, results: _Optional[_Iterable[_Union[Transcript, _Mapping]]] = ..., duration_s: _Optional[float] = ...) -> None: ...

class SynthesizeRequest(_message.Message):
    __slots__ = ("text", "speech", "output_format")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    SPEECH_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    text: str
    speech: SpeechConfig
    output_format: AudioFormat
    def __init__(self, text: _Optional[str] = ..., speech: _Optional[_Union[SpeechConfig, _Mapping]] = ..., output_format: _Optional[_Union[AudioFormat, _Mapping]] = ...) -> None: ...

class SynthesizeResponse(_message.Message):
    __slots__ = ("audio",)
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    audio: AudioChunk
    def __init__(self, audio: _Optional[_Union[AudioChunk, _Mapping]] = ...) -> None: ...

class ListVoicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Voice(_message.Message):
    __slots__ = ("name", "kind", "description")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    description: str
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., description: _Optional[str] = ...) -> None: ...

class ListVoicesResponse(_message.Message):
    __slots__ = ("voices",)
    VOICES_FIELD_NUMBER: _ClassVar[int]
    voices: _containers.RepeatedCompositeFieldContainer[Voice]
    def __init__(self, voices: _Optional[_Iterable[_Union[Voice, _Mapping]]] = ...) -> None: ...

class AddVoiceRequest(_message.Message):
    __slots__ = ("name", "audio", "format", "transcript")
    NAME_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TRANSCRIPT_FIELD_NUMBER: _ClassVar[int]
    name: str
    audio: bytes
    format: AudioFormat
    transcript: str
    def __init__(self, name: _Optional[str] = ..., audio: _Optional[bytes] = ..., format: _Optional[_Union[AudioFormat, _Mapping]] = ..., transcript: _Optional[str] = ...) -> None: ...

class GetServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "backend", "device")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    name: str
    backend: str
    device: str
    def __init__(self, name: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ...) -> None: ...

class ServerInfo(_message.Message):
    __slots__ = ("version", "asr", "tts", "max_sessions", "active_sessions", "max_message_bytes", "agents", "min_sample_rate_hz", "max_sample_rate_hz", "doors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ASR_FIELD_NUMBER: _ClassVar[int]
    TTS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    MIN_SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    MAX_SAMPLE_RATE_HZ_FIELD_NUMBER: _ClassVar[int]
    DOORS_FIELD_NUMBER: _ClassVar[int]
    version: str
    asr: ModelInfo
    tts: ModelInfo
    max_sessions: int
    active_sessions: int
    max_message_bytes: int
    agents: _containers.RepeatedScalarFieldContainer[str]
    min_sample_rate_hz: int
    max_sample_rate_hz: int
    doors: _containers.RepeatedCompositeFieldContainer[Door]
    def __init__(self, version: _Optional[str] = ..., asr: _Optional[_Union[ModelInfo, _Mapping]] = ..., tts: _Optional[_Union[ModelInfo, _Mapping]] = ..., max_sessions: _Optional[int] = ..., active_sessions: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., agents: _Optional[_Iterable[str]] = ..., min_sample_rate_hz: _Optional[int] = ..., max_sample_rate_hz: _Optional[int] = ..., doors: _Optional[_Iterable[_Union[Door, _Mapping]]] = ...) -> None: ...

class Door(_message.Message):
    __slots__ = ("name", "address")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...
