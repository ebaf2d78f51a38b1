"""`voiced bench turns --offline`: the end-of-turn detectors replayed over a turn set, without a daemon.

The live bench (voiced.bench.turn_bench) streams each caller through a daemon in real time; there the
figures are mostly the decode's time and the machine's load (on a shared 2-core CPU tiny.en's decode
of the turn so far takes 0.3-1.5 s). This replay asks what the rule decides when the evidence is ready
a fixed `--decode-ms` after the pause began (e.g. 30 ms, a GPU's), so that a change to the rule
(voiced.core.turns) can be judged in seconds and the same on every machine.

For each caller, frame by frame (20 ms), it runs what the session runs (voiced.core.session):
- the session's own segmenter (voiced.core.segmenter, configured by `pauses.smart_segmentation`),
  whose Paused / Resumed / SpeechStarted events are the decision points the daemon sees;
- the session's own turn tracker (voiced.core.turn_tracker: the pause state machine, the words-stall
  pause, the end-of-turn decision), driven as the session drives it; only the evidence differs:
- at each pause the tracker opens, the transcript of the turn so far through the real Whisper engine
  with the session's own options (`pauses.recognition_options`: word timings, the token cap), and
  Smart Turn's probability on the session's clip (`pauses.model_clip`); the interim decodes the
  tracker asks for after a pause that sound followed, and the sound after stopped words decoded alone;
- a turn ends where the tracker says, or at the segmenter's bound; a turn ended inside a sentence
  makes the rest a new turn (its own pauses, its own decodes), as in the daemon.

Times: the transcript of a pause is ready `decode_ms` after the pause was noticed, Smart Turn's
answer `model_ms` after it (the session waits for the model first, then the transcript), each interim
decode `decode_ms` after it started; a turn ends at the first frame (or evidence) at which the rule's
wait has passed. What it leaves out: the decode time's spread and queueing (several callers sharing a
GPU, decodes that return late under load), the network, and Whisper's numerics on another device
(the cache holds what this machine's engine wrote: fp32 on a CPU, fp16 on a GPU may differ on a word).

The evidence (each decode's text, word probabilities and times, end-of-text probability, the
probability of a sentence end after the last word, and each Smart Turn probability) is cached per set
and model in a JSON file beside the set (`--evidence`), keyed by the audio it was computed on:
re-judging a set after a change to the rule costs no decode, and a change that ends turns elsewhere
decodes only the new clips. A transcript cached before a field the rule reads was added (`stop_prob`)
is decoded again, once.

    voiced bench turns --offline --set SET --asr-model tiny.en-pypi --decode-ms 30 --out replay.json
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from voiced.bench.turn_set import RATE, TurnCaller
from voiced.bench.turn_verdicts import Outcome, judge, summarize, table, turn_targets
from voiced.core import pauses, turns
from voiced.core import segmenter as seg_mod
from voiced.core.turn_tracker import Actions, Decode, TurnTracker
from voiced.engines.base import ASROptions, ASRRequest, Transcript, Word

log = logging.getLogger("voiced.bench.turns")
FRAME = seg_mod.FRAME_SAMPLES  # 20 ms


# ----------------------------------------------------------------------------------- the evidence


class EvidenceStore:
    """Transcripts and Smart Turn probabilities, computed once (engines loaded on first need) and kept
    in a JSON file."""

    def __init__(self, path: Path | None, asr_model: str, device: str = "cpu", smart_turn_model: str | None = None,
                 window: str = "full"):
        self.path, self.asr_model, self.device, self.smart_turn_model = path, asr_model, device, smart_turn_model
        self.window = window  # Whisper's encoder window: full (30 s) or auto (asr.window: sized to the clip on a CPU)
        self.data: dict = {"asr_model": asr_model, "transcripts": {}, "p_complete": {}}
        if path is not None and path.is_file():
            self.data = json.loads(path.read_text())
        self._asr = self._turn_model = None
        self.decodes = self.predictions = 0  # computed in this run (not from the file)
        self.decode_s = 0.0

    def asr(self):
        if self._asr is None:
            from voiced.engines.whisper.engine import WhisperEngine

            self._asr = WhisperEngine.load(self.asr_model, device=self.device, max_batch=4, window=self.window)
        return self._asr

    def turn_model(self):
        if self._turn_model is None:
            from voiced.engines import smart_turn

            path = smart_turn.resolve(self.smart_turn_model) if self.smart_turn_model else smart_turn.find()
            if path is None:
                raise RuntimeError("no Smart Turn model pulled (voiced models pull smart-turn-v3-pypi)")
            self._turn_model = smart_turn.load_smart_turn(path)
            self.data["smart_turn"] = str(Path(path).name)
        return self._turn_model

    def transcript(self, caller: str, audio: np.ndarray, audio_end: int, opts: ASROptions) -> Transcript:
        key = f"{caller}:{audio_end - len(audio)}:{audio_end}:{opts.max_new_tokens}:{int(opts.word_timestamps)}"
        hit = self.data["transcripts"].get(key)
        if hit is None or "stop_prob" not in hit:  # (a cache written before `stop_prob`: decoded again)
            t0 = time.perf_counter()
            r = self.asr().transcribe(ASRRequest(audio.astype(np.float32) / 32768.0, opts))
            self.decode_s += time.perf_counter() - t0
            self.decodes += 1
            hit = {"text": r.text, "hallucination": bool(r.is_hallucination), "end_prob": r.end_prob,
                   "stop_prob": r.stop_prob,
                   "tokens": len(r.tokens),
                   "words": [[w.word, round(float(w.start_s), 3), round(float(w.end_s), 3),
                              round(float(w.probability), 4)] for w in r.words]}
            self.data["transcripts"][key] = hit
        # the caller's language, which the session's options name (Whisper is told it, as the daemon tells it)
        return Transcript(text=hit["text"], language=opts.language or "en", tokens=[], avg_logprob=0.0,
                          no_speech_prob=0.0, compression_ratio=0.0, is_hallucination=hit["hallucination"],
                          words=[Word(w, s, e, p) for w, s, e, p in hit["words"]], end_prob=hit["end_prob"],
                          stop_prob=hit["stop_prob"])

    def p_complete(self, caller: str, clip: np.ndarray, key: str) -> float:
        key = f"{caller}:{key}"
        p = self.data["p_complete"].get(key)
        if p is None:
            p = round(float(self.turn_model().predict([clip])[0]), 4)
            self.predictions += 1
            self.data["p_complete"][key] = p
        return p

    def save(self) -> None:
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data))
            os.replace(tmp, self.path)


# ----------------------------------------------------------------------------------- the session, replayed


@dataclass(eq=False)
class _Work:
    """A pause as the replay works it out: its evidence from the store, and its line in the decisions."""

    pause: pauses.Pause
    result: Transcript
    p: float | None
    log: dict


class CallerReplay:
    """One caller through one smart detector: the session's turn tracker (voiced.core.turn_tracker) driven
    as the session drives it (voiced.core.session), with the evidence from `store` and fixed latencies."""

    def __init__(self, caller: TurnCaller, pcm: np.ndarray, eagerness: str, store: EvidenceStore,
                 asr: ASROptions, decode_ms: float, model_ms: float, interim_every_ms: int = 1000):
        self.c, self.pcm, self.store, self.asr = caller, pcm, store, asr
        self.bounds = turns.bounds(eagerness)
        cfg = seg_mod.SegmenterConfig(turn_detection="smart", eagerness=eagerness)
        self.seg = seg_mod.Segmenter(pauses.smart_segmentation(cfg, self.bounds))
        # the bench's callers ask for no interim results: the tracker's own decodes are the only ones
        self.tracker = TurnTracker(self.seg, self.bounds, interim_every_ms)
        self.decode = int(decode_ms * RATE / 1000)
        self.model = int(model_ms * RATE / 1000)
        self.work: dict[pauses.Pause, _Work] = {}
        self.pending: list[tuple[int, int, str, object]] = []  # (time, order, kind, what)
        self._order = 0
        self.ends: list[float] = []
        self.decisions: list[dict] = []
        self.interims = 0
        self.alone: list[dict] = []  # the sound after stalled words, decoded alone

    # -- plumbing
    def _at(self, t: int, kind: str, what) -> None:
        self._order += 1
        self.pending.append((t, self._order, kind, what))

    def run(self) -> list[float]:
        n_frames = len(self.pcm) // FRAME
        for n in range(n_frames):
            now = (n + 1) * FRAME
            self._complete_until(now)
            events = self.seg.push(self.pcm[n * FRAME: now])
            if events:
                self._events(events, now)
            if self.seg.in_speech:
                decode = self.tracker.interim_due(asked=False)
                if decode is not None:
                    self._interim(decode, now)
                if self.tracker.pause is not None:
                    self._maybe_end(now)
        self._events(self.seg.flush(), n_frames * FRAME)
        return self.ends

    def _complete_until(self, now: int) -> None:
        while True:
            due = [x for x in self.pending if x[0] <= now]
            if not due:
                return
            item = min(due)
            self.pending.remove(item)
            t, _, kind, what = item
            getattr(self, "_done_" + kind)(what, t)

    def _events(self, events: list, now: int) -> None:
        for ev in events:
            if isinstance(ev, seg_mod.SpeechStarted):
                self.tracker.started(ev.offset)
            elif isinstance(ev, seg_mod.Paused):
                self._act(self.tracker.paused(), now)
            elif isinstance(ev, seg_mod.Resumed):
                self._act(self.tracker.resumed(ev.offset), now)
            elif isinstance(ev, seg_mod.SpeechEnded):
                self.ends.append(now / RATE)
            elif isinstance(ev, seg_mod.Utterance):
                pause = self.tracker.ended()
                if pause is not None:
                    self.work[pause].log.setdefault("ended_s", round(now / RATE, 3))

    # -- pauses (as Session._act, _open_pause, _detect, _drop_pause)
    def _act(self, acts: Actions, now: int) -> None:
        if acts.drop is not None:
            self.work[acts.drop].log.setdefault("cancelled_s", round(now / RATE, 3))
        if acts.open is not None:
            self._open(acts.open, now)

    def _open(self, pause: pauses.Pause, now: int) -> None:
        if pause.result is None:  # a silence's: its transcript is ready `decode_ms` after the pause was noticed
            opts = pauses.recognition_options(self.asr, len(pause.audio), 1, words=True)
            result = self.store.transcript(self.c.name, pause.audio, pause.audio_end, opts)
            transcript_at = now + self.decode
        else:  # the words found it: the decode that did is its transcript
            result, transcript_at = pause.result, now
        w = self.work[pause] = _Work(pause, result, None, {})
        if pause.result is None:
            self._at(transcript_at, "watch", w)
        if self.bounds.audio_decides:  # as the session: the model is asked only where it can change the wait
            clip = pauses.model_clip(pause.audio, pause.audio_end, pause.voice_end)
            w.p = self.store.p_complete(self.c.name, clip, f"{pause.audio_end - len(pause.audio)}:{pause.voice_end}")
            self._at(now + self.model, "model", w)
            transcript_at = max(now + self.model, transcript_at)
        self._at(transcript_at, "text", w)
        w.log = {"opened_s": round(now / RATE, 3), "voice_end_s": round(pause.voice_end / RATE, 3),
                 "stalled": pause.stalled, "text": result.text, "p_complete": w.p, "end_prob": result.end_prob,
                 "stop_prob": result.stop_prob,
                 "last_word": result.words[-1].word if result.words else None,
                 "last_word_p": result.words[-1].probability if result.words else None}
        self.decisions.append(w.log)

    def _done_model(self, w: _Work, t: int) -> None:
        if self.tracker.pause is w.pause:
            self.tracker.model_answer(w.pause, w.p)
            self._maybe_end(t)

    def _done_text(self, w: _Work, t: int) -> None:
        if self.tracker.pause is not w.pause:
            return
        _, wait_ms, verdict = self.tracker.transcript(w.pause, w.result)
        ev = w.pause.evidence
        w.log.update(judged=ev.text, doubtful=ev.doubtful, wait_ms=wait_ms, verdict=verdict)
        self._maybe_end(t)

    def _done_watch(self, w: _Work, t: int) -> None:
        self.tracker.pause_words(w.pause, w.result)

    def _maybe_end(self, t: int) -> None:
        if self.tracker.over():
            self._events(self.seg.end_turn(), t)

    # -- the words while sound goes on (as Session._start_interim, _words)
    def _interim(self, decode: Decode, now: int) -> None:
        opts = pauses.recognition_options(self.asr, len(decode.audio), 0, final=False, words=True)
        result = self.store.transcript(self.c.name, decode.audio, decode.audio_end, opts)
        self.interims += 1
        self._at(now + self.decode, "interim", (decode, result))

    def _done_interim(self, what: tuple[Decode, Transcript], t: int) -> None:
        decode, result = what
        acts = self.tracker.words(decode, result)
        if acts.decode is not None:  # the sound after the words, decoded alone (no other interim meanwhile)
            opts = pauses.recognition_options(self.asr, len(acts.decode.audio), 0, final=False)
            alone = self.store.transcript(self.c.name, acts.decode.audio, acts.decode.audio_end, opts)
            self._at(t + self.decode, "alone", (decode, alone))
            return
        self.tracker.interim_done(decode)
        self._act(acts, t)

    def _done_alone(self, what: tuple[Decode, Transcript], t: int) -> None:
        decode, alone = what
        if self.tracker.interim is decode:
            self.alone.append({"at_s": round(t / RATE, 3), "text": alone.text, "hallucination": alone.is_hallucination})
        acts = self.tracker.alone(decode, alone)
        self.tracker.interim_done(decode)
        self._act(acts, t)


def replay_silence(pcm: np.ndarray, hangover_ms: int) -> list[float]:
    """The silence detector: the session's segmenter with `hangover_ms` (turn_detection="silence")."""
    seg = seg_mod.Segmenter(seg_mod.SegmenterConfig(hangover_ms=hangover_ms, keep_audio=False))
    ends = []
    n_frames = len(pcm) // FRAME
    for n in range(n_frames):
        for ev in seg.push(pcm[n * FRAME: (n + 1) * FRAME]):
            if isinstance(ev, seg_mod.SpeechEnded):
                ends.append((n + 1) * FRAME / RATE)
    if seg.flush():
        ends.append(n_frames * FRAME / RATE)
    return ends


# ----------------------------------------------------------------------------------- driver


def load_caller(directory: Path, caller: TurnCaller) -> np.ndarray:
    from voiced_client.wavio import read_wav

    samples, rate = read_wav(directory / caller.audio)
    if rate != RATE:
        raise ValueError(f"{caller.audio}: {rate} Hz; the turn set is 16 kHz")
    return samples.astype(np.int16)


def session_asr_options(language: str = "en") -> ASROptions:
    """The recognition options a bench caller's session gets (the config's defaults, its language)."""
    from voiced.config import Config
    from voiced.core.spec import asr_options_for

    return asr_options_for(Config(), language=language)


SLOW_MS = 700  # issue 25's end-of-turn p90 target: more than 10 % of the turns ending later make the p90 miss it


def ended_by(decisions: list[dict], ends: list[float], speech_end_s: float) -> str | None:
    """What ended the caller's turn after the real end of speech: the verdict (`turns.Evidence.verdict`)
    of the pause whose wait ended it, "bound" where no pause's verdict did (the segmenter's upper
    bound, or the call's end); None where no turn ended after the real end."""
    after = [t for t in ends if t >= speech_end_s]
    if not after:
        return None
    at = round(after[0], 3)
    return next((d.get("verdict", "no text") for d in decisions if d.get("ended_s") == at), "bound")


def slow_ends(verdicts: list[dict]) -> dict:
    """For the callers whose turn ended over SLOW_MS after the real end: how many each verdict held,
    finished and paused callers apart (what the p90 is made of)."""
    out: dict = {}
    for v in verdicts:
        if v["eot_ms"] is not None and v["eot_ms"] > SLOW_MS:
            kinds = out.setdefault(v.get("ended_by") or "bound", {"finished": 0, "paused": 0})
            kinds[v["kind"]] += 1
    return dict(sorted(out.items(), key=lambda kv: -sum(kv[1].values())))


def replay_detector(detector: str, directory: Path, callers: list[TurnCaller], store: EvidenceStore,
                    decode_ms: float, model_ms: float) -> dict:
    t0 = time.monotonic()
    verdicts = []
    asr = {c.language: session_asr_options(c.language) for c in callers}  # as each caller's session is told
    for c in callers:
        pcm = load_caller(directory, c)
        if detector.startswith("silence"):
            ends, detail = replay_silence(pcm, int(detector.partition(":")[2] or 500)), {}
        else:
            r = CallerReplay(c, pcm, detector.split(":", 1)[1], store, asr[c.language], decode_ms, model_ms)
            ends = r.run()
            detail = {"decisions": r.decisions, "interim_decodes": r.interims, "sound_alone": r.alone,
                      "ended_by": ended_by(r.decisions, ends, c.speech_end_s)}
        v = judge(c, Outcome(turn_ends=ends))
        v.update(text=c.text, parts=c.parts, **detail)
        verdicts.append(v)
    row = summarize(detector, verdicts)
    if detector.startswith("smart:"):
        row["targets"] = turn_targets(row)
        row["slow_ends"] = slow_ends(verdicts)
    row["wall_s"] = round(time.monotonic() - t0, 1)
    return row


def run_offline(args, directory: Path, callers: list[TurnCaller], detectors: list[str], machine: str) -> dict:
    """`voiced bench turns --offline`'s work for the daemon's detectors (turn_bench.main parses the
    arguments, adds the smart-turn reference and emits the result)."""
    name = Path(args.asr_model).name + ("" if args.asr_window == "full" else "-auto-window")
    evidence = args.evidence or (Path(directory) / f"replay-evidence-{name}.json")
    store = EvidenceStore(evidence, args.asr_model, args.device or "cpu", args.smart_turn_model, args.asr_window)
    result = {"bench": "turns", "offline": True, "date": time.strftime("%Y-%m-%d"), "machine": machine,
              "set": str(directory), "callers": len(callers), "paused": sum(c.kind == "paused" for c in callers),
              "asr_model": args.asr_model, "asr_window": args.asr_window, "decode_ms": args.decode_ms, "model_ms": args.model_ms,
              "evidence": str(evidence), "detectors": []}
    try:
        for d in detectors:
            row = replay_detector(d, directory, callers, store, args.decode_ms, args.model_ms)
            result["detectors"].append(row)
            log.info("%s: %s", d, {k: row[k] for k in ("paused_cut_off", "finished_cut_off", "eot_ms", "unended")})
            if "slow_ends" in row:
                log.info("%s: turns ending over %d ms after the real end, by what held them: %s", d, SLOW_MS,
                         row["slow_ends"])
    finally:
        store.save()
    result["decodes"], result["decode_s"] = store.decodes, round(store.decode_s, 1)
    result["smart_turn_predictions"] = store.predictions
    result["table"] = table(result["detectors"])
    return result
