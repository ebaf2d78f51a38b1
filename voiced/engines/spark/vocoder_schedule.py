"""The vocoder's scheduling in the Spark engine: when a vocoder turn is due, which requests it serves
and in what order, which windows of theirs it decodes together, and the shapes warm-up must run.

Policy (the engine's `step` asks, `launch` queues the turn's decode, `_vocode` emits what `collect` reads):
  - first chunks first: a request still waiting for its first sound is served before (and never
    padded up to) the bulk chunks of long replies; then the requests closest to running dry (least
    audio buffered ahead of real time);
  - a turn decodes at most VOCODER_STEP_WINDOWS windows and VOCODER_STEP_TOKENS padded tokens (batch
    bucket x longest padded window), one window always;
  - merging: once every active request has its first audio out, the ready chunks of a request go as one
    window (up to VOCODER_MERGE_TOKENS), paying the vocoder's context once instead of per chunk, and (several
    requests in flight) the chunks of a request well ahead of real time wait to grow such a window;
  - urgency: while a request decodes toward its first chunk, a vocoder turn runs only for work that
    cannot wait (a first chunk ready, a sentence ended, a request within VOCODER_SLACK_S of running dry).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from voiced.engines.base import SAMPLE_RATE

from .bicodec import BiCodec
from .request import Request, State
from .streaming import (
    BATCH_BUCKETS,
    DecodeJob,
    LaunchedDecode,
    Window,
    batch_bucket,
    decoded_tokens,
    launch_jobs,
    longest_fitting,
    padded_length,
    window_lengths,
)

# A request whose streamed audio is this far ahead of real time can have its next chunk decoded a
# vocoder turn later: so that requests still waiting for their first chunk are decoded first, and
# (with other requests still being written) so that its ready chunks grow into one longer window.
VOCODER_SLACK_S = 1.0
# One vocoder step's work: at most this many windows, and batch bucket x padded window length at most
# this many tokens (one window always goes, whatever its length).
VOCODER_STEP_WINDOWS = 16
VOCODER_STEP_TOKENS = 1024
# The longest window (padded) that merging consecutive ready chunks of one request makes (0: no merging).
# Each window pays 2R (~136) tokens of context: a lone 25-token chunk decodes ~161 tokens (176 padded),
# 35 chunks merged decode 1011 (1024 padded) for 875 released. Merging never applies while an active
# request still waits for its first audio: the steps on that path stay short.
VOCODER_MERGE_TOKENS = 1024


@dataclass
class VocoderWork:
    """What the vocoder did since the engine started (the benchmark reports the ratios)."""

    steps: int = 0
    windows: int = 0
    window_tokens: int = 0  # tokens of the windows decoded (context included)
    decoded_tokens: int = 0  # what the vocoder computed: window_tokens plus padding and repeated batch rows
    audio_tokens: int = 0  # tokens whose audio was released

    def add(self, windows: list[Window]) -> dict:
        """Count one vocoder step's windows; returns that step's counts."""
        step = {"windows": len(windows), "window_tokens": sum(w.end - w.start for w in windows),
                "decoded_tokens": decoded_tokens(windows), "audio_tokens": sum(w.keep_to - w.keep_from for w in windows)}
        self.steps += 1
        for k, v in step.items():
            setattr(self, k, getattr(self, k) + v)
        return step


@dataclass
class VocoderTurn:
    """One vocoder turn's windows, launched (`VocoderSchedule.launch`) and not yet read back."""

    rows: list[Request]  # in the order served
    jobs: list[tuple[Request, DecodeJob]]
    launched: LaunchedDecode
    emitted_before: list[tuple[Request, int]]

    def roll_back(self) -> None:
        """The turn failed: no request can be blamed for a pass over all its windows, so nothing may
        have advanced (the scheduler drops one request and steps again): the windows go back."""
        for r, was in self.emitted_before:
            r.planner.emitted = was


def ahead_s(r: Request, now: float) -> float:
    """Seconds of r's audio already sent beyond real time (since its first chunk); -inf before it."""
    if r.t_first_chunk is None:
        return float("-inf")
    return r.offset / SAMPLE_RATE - (now - r.t_first_chunk)


def has_window(r: Request) -> bool:
    return (r.planner is not None and r.speaker is not None and bool(r.semantic)
            and r.planner.next_window(len(r.semantic), r.sentence_over) is not None)


def merging(active: list[Request]) -> bool:
    """Ready chunks of a request go as one window only while no active request waits for its first audio:
    a merged turn is longer, and the first-audio path keeps short turns. Under load some request nearly
    always waits, so windows are then lone chunks: the vocoder's tokens are not what bounds the callers a
    GPU carries (merging in every turn that serves no first chunk decodes fewer tokens and carries no more)."""
    if VOCODER_MERGE_TOKENS <= 0:
        return False
    return all(r.t_first_chunk is not None for r in active)


def first_chunk_decoding(active: list[Request]) -> bool:
    """Some request is still decoding toward its first chunk (no window of it is ready yet)."""
    return any(r.t_first_chunk is None and r.state is State.DECODING and not has_window(r) for r in active)


def urgent(active: list[Request], now: float) -> bool:
    """Vocoder work that cannot wait: a first chunk is ready, a sentence ended (its row must move
    on), or a request's audio is within VOCODER_SLACK_S of running dry at the caller."""
    for r in active:
        if r.state is State.PREFILL:
            continue
        if r.sentence_over:
            return True
        if has_window(r) and (r.t_first_chunk is None or ahead_s(r, now) <= VOCODER_SLACK_S):
            return True
    return False


def window_shapes(first: int, chunk: int, radius: int) -> list[tuple[int, int]]:
    """Every (batch bucket, padded window length) a vocoder step can decode: windows are at most
    first + R (the first), chunk + 2R tokens long or VOCODER_MERGE_TOKENS (merged chunks), padded
    as `padded_length` does; batches as `VocoderSchedule.decode` fills them (at most
    VOCODER_STEP_WINDOWS, bucket x length within VOCODER_STEP_TOKENS)."""
    longest = max(first + radius, chunk + 2 * radius, VOCODER_MERGE_TOKENS)
    out = []
    for length in window_lengths(longest):
        for b in BATCH_BUCKETS:
            if b > VOCODER_STEP_WINDOWS or (b > 1 and b * length > VOCODER_STEP_TOKENS):
                break
            out.append((b, length))
    return out


class VocoderSchedule:
    """Chooses and decodes the windows of one vocoder turn (see the module's policy)."""

    def __init__(self, codec: BiCodec, device: str, radius: int) -> None:
        self.codec, self.device, self.radius = codec, device, radius
        self.work = VocoderWork()

    def ready_rows(self, active: list[Request], now: float) -> list[Request]:
        """The requests a vocoder step would serve now: those with a window ready that need not wait, or
        a sentence ended (its row must move on or be released). Built once per step (~0.1 ms at 64
        requests on the host) and handed to `decode` when that step vocodes."""
        rows = [r for r in active if r.state is not State.PREFILL and (r.sentence_over or has_window(r))]
        if len(active) > 1 and merging(active) and any(r.state is State.DECODING for r in active):
            # Chunks that can wait for a later vocoder turn do: those of a request whose audio is more
            # than VOCODER_SLACK_S ahead of real time, still being written, and whose ready chunks do
            # not fill a merged window yet. The LM's steps then go back to back and the window, when it
            # comes, releases more audio for its context. Never for a request alone: that stays
            # independent of the clock.
            rows = [r for r in rows if r.sentence_over or ahead_s(r, now) <= VOCODER_SLACK_S
                    or self._fills_merged_window(r)]
        return rows

    def _fills_merged_window(self, r: Request) -> bool:
        w = r.planner.next_window(len(r.semantic), r.sentence_over, VOCODER_MERGE_TOKENS)
        return w is not None and w.keep_to + r.planner.chunk + self.radius <= len(r.semantic)

    def launch(self, rows: list[Request], now: float, order: dict[int, int], active: list[Request],
               last_step: dict) -> VocoderTurn:
        """Choose this turn's windows of `rows` (`order`: arrival per request id; `last_step` gets the
        turn's counts), advance their planners and queue their decode on the current stream; `collect`
        reads the audio back. On a failure nothing has advanced."""
        # Priority: when a request's first chunk is ready, it must not wait behind (or be padded up to)
        # the bulk chunks of long replies: later chunks of requests well ahead of real time wait a step.
        if any(r.t_first_chunk is None and has_window(r) for r in rows):
            rows = [r for r in rows if r.t_first_chunk is None or r.sentence_over
                    or ahead_s(r, now) <= VOCODER_SLACK_S]
        # First chunks first (higher priority, then arrival), then the requests closest to running dry.
        rows.sort(key=lambda r: (0, -r.options.priority, order.get(r.rid, 0)) if r.t_first_chunk is None
                  else (1, ahead_s(r, now), 0))
        turn = VocoderTurn(rows, [], LaunchedDecode([], [], None),
                           [(r, r.planner.emitted) for r in rows if r.planner is not None])
        merge = merging(active)
        # Take windows one per request per round, in that order, while the step's budget lasts; a
        # merged window takes as much of the budget as the windows already taken leave it.
        jobs = turn.jobs
        taken: set[int] = set()
        longest, full = 0, False
        while not full:
            progress = False
            for r in rows:
                if r.speaker is None or not r.semantic:
                    continue
                cap = min(VOCODER_MERGE_TOKENS, longest_fitting(VOCODER_STEP_TOKENS, len(jobs) + 1)) if merge else 0
                w = r.planner.next_window(len(r.semantic), r.sentence_over, cap)
                if w is None:
                    continue
                length = max(longest, padded_length(w.end - w.start))
                if jobs and (len(jobs) >= VOCODER_STEP_WINDOWS
                             or batch_bucket(len(jobs) + 1) * length > VOCODER_STEP_TOKENS):
                    full = True
                    break
                r.planner.emitted = w.keep_to
                longest = length
                jobs.append((r, DecodeJob(r.semantic, r.speaker, w)))  # the ids stay on the host (decode_jobs)
                taken.add(id(r))
                progress = True
            if not progress:
                break
        if jobs:
            try:
                turn.launched = launch_jobs(self.codec, [j for _, j in jobs])
            except BaseException:
                turn.roll_back()
                raise
            last_step.update(self.work.add([j.window for _, j in jobs]))
        last_step["windows"] = len(jobs)
        last_step["window_rows"] = len(taken)
        last_step["merged"] = merge
        return turn

    def collect(self, turn: VocoderTurn) -> tuple[list[Request], dict[int, list[np.ndarray]]]:
        """Wait for a launched turn: its rows in the order served and the audio of each (by id(row)).
        On a failure nothing has advanced."""
        try:
            audio = turn.launched.collect()
        except BaseException:
            turn.roll_back()
            raise
        pending: dict[int, list[np.ndarray]] = {}
        for (r, _), a in zip(turn.jobs, audio):
            pending.setdefault(id(r), []).append(a)
        return turn.rows, pending
