"""`voiced bench turns --overtalk`: short words said over a playing reply, judged as the session judges them.

Each word of STOPS (a request to stop or wait) and ACKS (an acknowledgement) is spoken by the bench's voice
family (`--family`: espeak-ng voices, or Piper's neural voice at two pitches), clean and through a telephone
line, and replayed against the session's over-talk schedule (voiced.core.conversation, voiced.core.overtalk):
a decode of the burst at `overtalk.FIRST_MS` of talk and every `EVERY_MS` after, at the barge-in minimum,
and once the voice has paused `GAP_MS`, one at a time, each landing `--decode-ms` after it starts (30 ms: a
GPU's decode of a short clip); its words are the real ASR's (`--asr-model`). The voice's span is the trimmed
clip's (the session's VAD adds a frame or two). Reported per family and line: stop requests that stopped the
reply and how long after the word's end; acknowledgements that stopped it (none should).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from voiced.audio.ingest import FRAME_MS
from voiced.core import overtalk
from voiced.engines.base import ASROptions, ASRRequest

log = logging.getLogger(__name__)

RATE = 16000
STOPS = ("stop", "no", "wait", "hold on", "hang on", "cancel", "sorry")
ACKS = ("mm hmm", "uh huh", "okay", "yeah", "right", "I see", "got it")
ESPEAK_VOICES = (("en-us", 155), ("en-us+f2", 170), ("en-gb+m3", 140))
LEAD_S = 0.1  # the pre-roll before the word (the segmenter keeps some)
AFTER_MS = 2000  # how long after the word the reply may still be stopped


def spoken(family: str) -> list[tuple[str, str, np.ndarray]]:
    """(word, speaker, 16 kHz float32 trimmed audio) for every word, in every speaker of the family."""
    from voiced.bench import turn_set

    out = []
    for word in STOPS + ACKS:
        if family == "piper":
            for pitch in turn_set.PIPER_PITCH:
                out.append((word, f"piper x{pitch}", turn_set._piper(word, turn_set.RATES[1], pitch)))
        else:
            for voice, rate in ESPEAK_VOICES:
                out.append((word, voice, turn_set.trim(turn_set._render(["-v", voice, "-s", str(rate), word]))))
    return out


def replay(audio: np.ndarray, words, decode_ms: float, min_speech_ms: int) -> int | None:
    """When, in ms after the word's end, the session's schedule stops the reply over `audio` (the word
    after LEAD_S of silence); None: it goes on. `words(clip)` is the ASR's text of a clip."""
    start = int(LEAD_S * RATE)
    end_ms = len(audio) * 1000 // RATE
    padded = np.concatenate([np.zeros(start, np.float32), audio, np.zeros(AFTER_MS * RATE // 1000, np.float32)])
    kind, decoded, decoded_to, next_ms, inflight, long_at = None, -1, -1, overtalk.FIRST_MS, None, None
    for t in range(FRAME_MS, end_ms + AFTER_MS, FRAME_MS):
        voiced, silence = min(t, end_ms), max(0, t - end_ms)
        if inflight is not None and inflight[0] <= t:
            _, kind, decoded = inflight
            inflight = None
        if inflight is None and (silence >= overtalk.GAP_MS and voiced > decoded_to
                                 or voiced >= min_speech_ms > decoded or voiced >= next_ms):
            next_ms, decoded_to = voiced + overtalk.EVERY_MS, voiced
            text = words(padded[:start + t * RATE // 1000])
            inflight = (t + decode_ms, overtalk.classify(text, "en"), voiced)
        if long_at is None and voiced >= min_speech_ms:
            long_at = t
        waited = t - long_at if long_at is not None else 0
        if overtalk.decide(kind, voiced, min_speech_ms, decoded, waited) is overtalk.Action.STOP:
            return t - end_ms
    return None


def run(args, machine: str) -> dict:
    from voiced.bench.turn_set import PHONE_SNR_DB, through_phone
    from voiced.config import Config
    from voiced.engines.whisper.engine import WhisperEngine

    engine = WhisperEngine.load(args.asr_model, device=args.device or "cpu", max_batch=4)
    min_ms = Config().barge_in.min_speech_ms
    cache: dict[bytes, str] = {}
    spent = [0.0, 0]

    def words(clip: np.ndarray) -> str:
        key = clip.tobytes()
        if key not in cache:
            t0 = time.perf_counter()
            r = engine.transcribe(ASRRequest(clip, ASROptions(language="en")))
            spent[0] += time.perf_counter() - t0
            spent[1] += 1
            cache[key] = "" if r.is_hallucination else r.text
        return cache[key]

    rng = np.random.default_rng(args.seed)
    rows, lines = [], []
    for word, speaker, audio in spoken(args.family):
        for line in ("clean", "phone"):
            heard = audio if line == "clean" else through_phone(audio, float(rng.uniform(*PHONE_SNR_DB)), rng)
            after = replay(heard, words, args.decode_ms, min_ms)
            rows.append({"word": word, "speaker": speaker, "line": line, "ms": len(audio) * 1000 // RATE,
                         "want": "stop" if word in STOPS else "go on", "stopped_after_ms": after,
                         "heard": words(np.concatenate([np.zeros(int(LEAD_S * RATE), np.float32), heard,
                                                        np.zeros(overtalk.GAP_MS * RATE // 1000, np.float32)]))})
    for line in ("clean", "phone"):
        mine = [r for r in rows if r["line"] == line]
        stops = [r for r in mine if r["want"] == "stop"]
        cut = [r["stopped_after_ms"] for r in stops if r["stopped_after_ms"] is not None]
        acks_cut = [r for r in mine if r["want"] == "go on" and r["stopped_after_ms"] is not None]
        lines.append(f"{args.family:9} {line:5}  stop requests stopped {len(cut)}/{len(stops)}"
                     + (f", {np.mean(cut):.0f} ms after the word (max {max(cut)})" if cut else "")
                     + f"; acknowledgements that stopped it {len(acks_cut)}/{len(mine) - len(stops)}"
                     + (" (" + ", ".join(sorted({r['word'] for r in acks_cut})) + ")" if acks_cut else "")
                     + ("; missed: " + ", ".join(sorted({r["word"] for r in stops if r["stopped_after_ms"] is None}))
                        if len(cut) < len(stops) else ""))
    table = "\n".join(lines)
    return {"bench": "turns-overtalk", "date": time.strftime("%Y-%m-%d"), "machine": machine,
            "family": args.family, "asr_model": args.asr_model, "decode_ms": args.decode_ms,
            "min_speech_ms": min_ms, "asr_decode_mean_ms": round(1000 * spent[0] / max(1, spent[1]), 1),
            "words": rows, "table": table}
