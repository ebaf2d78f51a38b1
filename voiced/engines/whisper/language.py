"""Language detection, as openai-whisper does it: the decoder's distribution after
<|startoftranscript|> alone, over the language tokens."""

from __future__ import annotations

import torch

from voiced.engines.rows import to_device

from .decoding import NEG_INF
from .model import KVCache, TextDecoder
from .tokenizer import WhisperTokenizer


def detect_languages(decoder: TextDecoder, tok: WhisperTokenizer, cache: KVCache,
                     rows: list[int]) -> list[tuple[str, dict[str, float]]]:
    """For each cache row (its audio's cross keys/values written): the most likely language code and
    the probability of every language."""
    dev = cache.self_k.device
    sot = torch.full((len(rows), 1), tok.sot, dtype=torch.long, device=dev)
    lang_logits = decoder.prefill(sot, to_device(rows, dev), cache)[:, 0]
    only_langs = torch.full_like(lang_logits, NEG_INF)
    lo, hi = tok.language_tokens[0], tok.language_tokens[-1] + 1  # consecutive ids: a slice, no index tensor
    only_langs[:, lo:hi] = lang_logits[:, lo:hi]
    best = only_langs.argmax(dim=-1)
    probs = only_langs.softmax(dim=-1)[:, lo:hi]
    # One copy back: each row's probabilities, then its best id (float32 holds ids < 2**24 exactly).
    host = torch.cat([probs, best[:, None].to(probs.dtype)], dim=1).tolist()
    return [(tok.language_codes[int(h[-1]) - tok.sot - 1], dict(zip(tok.language_codes, h[:-1]))) for h in host]
