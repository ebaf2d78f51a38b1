"""One speech request inside the Spark engine: its record, the state it is in, and the LM's phases.

A request's life: QUEUED (no row yet) -> PREFILL (a row; its sentence's prompt waits for a prefill
step) -> DECODING (the LM writes the sentence's tokens) -> SENTENCE_END (the sentence ended: its last
windows go to the vocoder) -> PREFILL for the next sentence, or the end after the last one. STOPPED
is SENTENCE_END for a request that ends early (its duration cap, or no speaker produced): no sentence
follows. A request leaves at its end, on a fault, or when cancelled (its row goes; `slot` becomes -1).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from voiced.engines.base import TTSOptions

from .checkpoint import SpecialTokens
from .streaming import ChunkPlanner
from .voices import Voice

# The LM's two phases: a controllable voice first writes its speaker (global tokens), then speech
# (semantic tokens); a given speaker starts in the semantic phase.
PHASE_GLOBAL, PHASE_SEMANTIC = 0, 1


class State(enum.Enum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODING = "decoding"
    SENTENCE_END = "sentence end"
    STOPPED = "stopped"


@dataclass
class Request:
    rid: int
    options: TTSOptions
    voice: Voice
    segments: list[str]
    seed: int
    max_semantic: int
    t_submit: float
    state: State = State.QUEUED
    seg: int = 0
    slot: int = -1
    pos: int = 0  # next cache position to write
    last: int = 0  # token to feed at the next decode step
    steps: int = 0  # sampled tokens so far (the sampler's counter)
    phase: int = PHASE_SEMANTIC
    phase_steps: int = 0
    global_ids: list[int] = field(default_factory=list)
    semantic: list[int] = field(default_factory=list)  # this segment's semantic ids
    speaker: torch.Tensor | None = None
    segment_cap: int = 0  # semantic tokens this sentence may take
    planner: ChunkPlanner | None = None
    sequence: int = 0
    offset: int = 0
    total_semantic: int = 0
    prompt_tokens: int = 0
    t_first_chunk: float | None = None
    # Prefilled alone from now on: a group prefill it was in failed and the culprit is being found. A
    # mark on the request (kept for its later sentences), not a stage of its life.
    solo: bool = False

    @property
    def sentence_over(self) -> bool:
        """The LM is done with the current sentence: what is left of it is vocoder work."""
        return self.state in (State.SENTENCE_END, State.STOPPED)


def phase_bias(sp: SpecialTokens, vocab_size: int, device) -> torch.Tensor:
    """Additive logit masks per phase: 0 where allowed, -inf elsewhere."""
    bias = torch.full((2, vocab_size), float("-inf"))
    g = slice(sp.global_base, sp.global_base + sp.n_global)
    s = slice(sp.semantic_base, sp.semantic_base + sp.n_semantic)
    bias[PHASE_GLOBAL, g] = 0
    # a controllable continuation may spell out acoustic values and the global markers first
    for t in [sp.start_acoustic, sp.end_acoustic, sp.start_global, sp.end_global, *sp.acoustic]:
        bias[PHASE_GLOBAL, t] = 0
    bias[PHASE_SEMANTIC, s] = 0
    for t in semantic_phase_markers(sp):
        bias[PHASE_SEMANTIC, t] = 0
    return bias.to(device)


def semantic_phase_markers(sp: SpecialTokens) -> tuple[int, ...]:
    """The tokens besides semantic ones the semantic phase allows: the ends and the markers."""
    return (sp.eos, sp.end_semantic, sp.start_semantic, sp.end_global)
