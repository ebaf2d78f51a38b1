"""Language detection, as openai-whisper does it: the decoder's distribution after
<|startoftranscript|> alone, over the language tokens."""

from __future__ import annotations

import torch

from .decoding import NEG_INF
from .model import KVCache, TextDecoder
from .tokenizer import WhisperTokenizer


def detect_languages(decoder: TextDecoder, tok: WhisperTokenizer, cache: KVCache,
                     rows: list[int]) -> list[tuple[str, dict[str, float]]]:
    """For each cache row (its audio's cross keys/values written): the most likely language code and
    the probability of every language."""
    dev = cache.self_k.device
    sot = torch.full((len(rows), 1), tok.sot, dtype=torch.long, device=dev)
    lang_logits = decoder.prefill(sot, torch.tensor(rows, device=dev), cache)[:, 0]
    only_langs = torch.full_like(lang_logits, NEG_INF)
    ids = list(tok.language_tokens)
    only_langs[:, ids] = lang_logits[:, ids]
    best = only_langs.argmax(dim=-1).tolist()
    probs = only_langs.softmax(dim=-1)[:, ids].cpu().tolist()
    return [(tok.language_codes[b - tok.sot - 1], dict(zip(tok.language_codes, p))) for b, p in zip(best, probs)]
