"""The LM's prompt: text cut into sentences, and one sentence's prompt for a voice (DESIGN §6)."""

from __future__ import annotations

import re

from voiced.engines.base import SAMPLE_RATE

from .bicodec import HOP
from .checkpoint import SpecialTokens
from .voices import Voice

TOKENS_PER_SECOND = SAMPLE_RATE // HOP  # 50 semantic tokens per second of speech
N_GLOBAL = 32  # a speaker is 32 global tokens
def longest_prompt(max_seq_len: int) -> int:
    """The longest prompt an engine holding `max_seq_len` positions a request accepts: room is left for
    the speaker's global tokens and the first semantic tokens."""
    return max_seq_len - N_GLOBAL - 17


MAX_SEGMENT_CHARS = 300  # longer sentences are cut at commas / spaces: the LM was trained on short utterances
_CJK = re.compile(r"[\u3000-\u30ff\u3400-\u9fff\uac00-\ud7af\uff00-\uffef]")


def split_text(text: str, max_chars: int = MAX_SEGMENT_CHARS) -> list[str]:
    """Sentences (via the daemon's splitter), each at most `max_chars` (cut at , ; or spaces)."""
    from voiced.text import split_sentences

    out: list[str] = []
    for sent in split_sentences(text) or ([text.strip()] if text.strip() else []):
        while len(sent) > max_chars:
            cut = max(sent.rfind(c, 0, max_chars) for c in (",", "，", ";", "、"))
            if cut < max_chars // 3:
                cut = sent.rfind(" ", 0, max_chars)
            if cut < max_chars // 3:
                cut = max_chars - 1
            out.append(sent[: cut + 1].strip())
            sent = sent[cut + 1 :].strip()
        if sent:
            out.append(sent)
    return out


def join_transcript(transcript: str, text: str) -> str:
    """Reference transcript + text as one content string. A space goes between them unless the text
    starts with a CJK character: "...gospel." + "Actions" would otherwise merge into one BPE token the
    model never saw, while a space before a CJK character breaks that script's tokens instead."""
    if not transcript:
        return text
    if transcript[-1].isspace() or (text and _CJK.match(text[0])):
        return transcript + text
    return transcript + " " + text


def build_prompt(sp: SpecialTokens, encode, voice: Voice, text: str, global_ids: list[int] | None = None) -> list[int]:
    """The LM prompt for one sentence (DESIGN §6). `global_ids`: a speaker already chosen (a
    controllable voice's first sentence produced them); without them a preset voice gets the
    controllable prompt and the LM writes its own 32 global tokens first."""
    v = voice
    if v.kind == "preset" and not global_ids:
        return [sp.task_controllable_tts, sp.start_content, *encode(text), sp.end_content, sp.start_style,
                sp.gender[v.gender], sp.pitch_label[v.pitch], sp.speed_label[v.speed], sp.end_style]
    globals_ = global_ids or v.global_ids or []
    head = [sp.task_tts, sp.start_content]
    g = [sp.start_global, *(sp.global_base + i for i in globals_), sp.end_global]
    if v.kind == "cloned" and v.transcript and v.semantic_ids:
        # prompt continuation: the model carries on speaking from the reference clip
        return [*head, *encode(join_transcript(v.transcript, text)), sp.end_content, *g, sp.start_semantic,
                *(sp.semantic_base + i for i in v.semantic_ids)]
    return [*head, *encode(text), sp.end_content, *g]
