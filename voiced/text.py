"""Cutting text into sentences, for speaking replies while they are still being written."""

from __future__ import annotations

import re

# A sentence ends at . ! ? (and their CJK forms) followed by space or the end, or at a line break.
# Abbreviations like "e.g." or "Dr." may split a sentence early; that only costs a short pause.
_END = re.compile(r"(?<=[.!?;:。！？])[\"')\]]*\s+|\n+")
MIN_CHARS = 12  # don't speak "Hi." "So." alone: tiny pieces sound choppy


def split_sentences(text: str) -> list[str]:
    """Whole text -> sentences (stripped, non-empty)."""
    buf = SentenceBuffer()
    return [*buf.feed(text), *buf.flush()]


class SentenceBuffer:
    """Feed text as it streams in; get back each sentence as soon as it is complete."""

    def __init__(self, min_chars: int = MIN_CHARS):
        self.min_chars = min_chars
        self._text = ""

    def feed(self, piece: str) -> list[str]:
        self._text += piece
        out = []
        start = 0
        for m in _END.finditer(self._text):
            sentence = self._text[start : m.end()].strip()
            if len(sentence) >= self.min_chars:
                out.append(sentence)
                start = m.end()
        self._text = self._text[start:]
        return out

    def flush(self) -> list[str]:
        rest, self._text = self._text.strip(), ""
        return [rest] if rest else []
