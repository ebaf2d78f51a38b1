"""The speech the GPU suite hears. The GPU machine has no espeak-ng, so `make gpu-data` renders these
here beforehand (`python -m tests.speech .devdata/speech`) and the device call carries `.devdata`.
(text, espeak voice, speed): `whisper_fixtures.speech` speaks at 175, `tests.speech.phrase` at espeak's default.
"""

from __future__ import annotations

# tests/test_whisper_gpu.py: graphs against eager
WHISPER = ("one utterance here", "and a second, longer utterance", "third")
BATCH = "sixteen utterances decoded in one batch"
# tests/test_whisper_gpu.py: the float32 GPU path against openai-whisper (voice, text)
REFERENCE = {
    "en": ("en", "Hello world. This is a test of the speech recognizer, reading numbers: one, two, three."),
    "de": ("de", "Guten Morgen. Wie geht es dir heute? Das Wetter ist schön."),
}
# tests/test_daemon_gpu.py: what the callers say
DAEMON = ("What time does the shop open tomorrow?",)

PHRASES: list[tuple[str, str, int | None]] = (
    [(t, "en", 175) for t in (*WHISPER, BATCH)]
    + [(t, v, 175) for v, t in REFERENCE.values()]
    + [(t, "en", None) for t in DAEMON]
)
