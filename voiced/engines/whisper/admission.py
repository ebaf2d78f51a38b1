"""Who is admitted (`choose_admissions`), and an admission's device work (`Admission`): the admitted
requests' audio to the device in one copy, the encoder over it in buckets (`fast_encoder.encoder_pieces`),
every decoder layer's cross keys/values into their cache rows, language detection where asked, and the
prefill of their initial tokens, whose last logits are their first sampling step. The engine gives the
chosen their rows (engine.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from voiced.engines.rows import to_device

from .audio import N_SAMPLES, log_mel_spectrogram
from .fast_encoder import FastEncoder, encoder_pieces
from .language import detect_languages
from .model import KVCache, Whisper
from .prefill_graphs import Prefills
from .tokenizer import WhisperTokenizer

# (`chosen` below: the engine's admitted requests, each with its rows, its audio and its RequestDecoder.)


def choose_admissions(queue: Iterable[Any], window: int | None, free: int, most: int) -> list[Any]:
    """The queued requests to admit into `free` rows: highest priority first, at most `most`; a request
    marked solo goes in alone. Every row in use holds audio of one window (`window`, None when no row is;
    the cache reads that many audio positions: `KVCache.window`): only requests of that window join them,
    and a first in line of another waits until the rows are empty, the others behind it too."""
    chosen: list[Any] = []
    busy = window is not None
    for req in sorted(queue, key=lambda r: (-r.request.options.priority, r.order)):
        if len(chosen) >= most or (chosen and chosen[0].solo):
            break
        if window is None:
            window = req.window
        elif req.window != window:
            if busy and not chosen:
                break  # nobody passes the first in line
            continue
        if req.solo and chosen:
            continue  # it goes in alone, at a later step
        if req.dec.plan.beam_size <= free:
            chosen.append(req)
            free -= req.dec.plan.beam_size
    return chosen


class Admission:
    """On a GPU the encoder's pass (`fast_encoder`, one graph replay per bucket) also leaves every decoder
    layer's cross keys/values in `fast_encoder.cross_out`, copied into the cache with one call per tensor
    (`_copy_cross`), and the prefill of SOT sequences runs padded to its encoder bucket (`prefills`), graphed
    or not, so that the graph and the eager pass run the very same kernels (an unpadded pass rounds
    differently, enough to flip a bf16 near-tie). On the CPU the modules run: the encoder, then each layer's
    cross projections (`_write_cross`), then the prefill."""

    def __init__(self, model: Whisper, cache: KVCache, tok: WhisperTokenizer, buckets: list[int],
                 fast_encoder: FastEncoder | None, prefills: Prefills | None) -> None:
        self.model, self.cache, self.tok, self.dims = model, cache, tok, model.dims
        self.buckets = buckets  # the encoder's batch buckets
        self.fast_encoder, self.prefills = fast_encoder, prefills
        self.is_cuda = model.device.type == "cuda"
        # The admitted audio's staging block (`_audio`; pinned on CUDA), kept: a fresh pinned [n, 30 s] block
        # per admission costs ~5 ms of host time before the encoder can start.
        self._host_audio: torch.Tensor | None = None  # made at the first admission, grown when too small
        self._audio_sent = torch.cuda.Event() if self.is_cuda else None  # the copy that last read it

    def run(self, chosen: list[Any], warming: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Admit `chosen` (rows given, in row order): returns their first-step logits and their no-speech
        probabilities (row order, on the device). `warming`: shapes only, the encoder skipped (its buckets
        ran at warm-up already)."""
        self._encode_into_cache(self._audio(chosen), chosen, warming)
        self._detect_languages([r for r in chosen if r.dec.plan.language is None])
        return self._prefill(chosen)

    def _encode_into_cache(self, audio: torch.Tensor, chosen: list[Any], warming: bool) -> None:
        """Encoder over audio [n, N_SAMPLES] of `chosen`, then every layer's cross keys/values into each
        request's rows."""
        if not self.is_cuda:
            mel = log_mel_spectrogram(audio, self.dims.n_mels).to(self.model.dtype)
            self._write_cross(self.model.encoder(mel), chosen)
            return
        start = 0
        for b in encoder_pieces(len(chosen), self.buckets):
            part = chosen[start:start + b]
            x = audio[start:start + len(part)]
            if len(part) < b:
                x = torch.cat([x, x.new_zeros(b - len(part), x.shape[1])])
            # Warming up, shapes only: every bucket's pass ran already (captured, or once eagerly), so the
            # buffer holds finite numbers that stand in for the features' cross keys/values.
            if not warming:
                self.fast_encoder.run(x, b, self.model.dtype)
            self._copy_cross(part)
            start += len(part)

    def _write_cross(self, features: torch.Tensor, part: list[Any]) -> None:
        """Every layer's cross keys/values of `features` [>= len(part), A, D] into the rows of `part`
        (feature i for each of request i's beams). The indices go to the device without a sync."""
        dev = self.model.device
        rows = [x for r in part for x in r.rows]
        if len(rows) == len(part):  # one row each (no beams): the features in order, as a view
            features = features[:len(part)]
        else:
            features = features[to_device([i for i, r in enumerate(part) for _ in r.rows], dev)]
        self.model.decoder.write_cross(self.cache, to_device(rows, dev), features)

    def _copy_cross(self, part: list[Any]) -> None:
        """Copy the cross keys/values the encoder's pass left in `fast_encoder.cross_out` ([k | v, layer,
        row, A, D], row i: request i's audio) into the cache rows of `part`, every layer at once: one
        `index_copy_` per tensor along the slot dimension, once per beam index (beam j of each request;
        a request with fewer beams writes its last row again, the same values: any copy that lands is
        right). The slots go to the device without a sync."""
        n = len(part)
        beams = max(len(r.rows) for r in part)
        slots = to_device([[r.rows[min(j, len(r.rows) - 1)] for r in part] for j in range(beams)], self.model.device)
        k, v = self.fast_encoder.cross_out[:, :, :n].unbind(0)  # [L, n, A, D] each
        for j in range(beams):
            self.cache.cross_k.index_copy_(1, slots[j], k)
            self.cache.cross_v.index_copy_(1, slots[j], v)


    def _audio(self, chosen: list[Any]) -> torch.Tensor:
        """The requests' audio as padded windows [n, window] on the model's device (their window: 30 s, or
        sized to the clip on a CPU, the same for every request admitted together). Only the
        longest request's span crosses to the device, laid out on the host through numpy (no torch call per
        request) in the kept staging block (pinned on CUDA) and sent in one copy; the padding to the window
        is made on the device. `submit` refused anything longer than a window."""
        lens = [r.request.audio.shape[0] for r in chosen]
        n, width = len(chosen), max(lens)
        if self.is_cuda:
            # The previous admission's copy has read the block by now (its tokens were read back since):
            # the wait is a guard that costs nothing.
            self._audio_sent.synchronize()
        if self._host_audio is None or self._host_audio.numel() < n * width:
            self._host_audio = torch.empty(max(n, self.buckets[-1]) * N_SAMPLES, pin_memory=self.is_cuda)
        # Each row is written whole (its audio, then zeros to `width`): nothing of an earlier admission's
        # longer audio is left in it.
        host = self._host_audio[:n * width].view(n, width)
        host_np = host.numpy()
        for i, r in enumerate(chosen):
            host_np[i, :lens[i]] = r.request.audio
            host_np[i, lens[i]:] = 0
        if self.is_cuda:
            host = host.to(self.model.device, non_blocking=True)
            self._audio_sent.record(torch.cuda.current_stream(self.model.device))
        return torch.nn.functional.pad(host, (0, chosen[0].window - width))

    def _detect_languages(self, detect: list[Any]) -> None:
        """Language detection (language.py) for the requests that did not give theirs."""
        if not detect:
            return
        found = detect_languages(self.model.decoder, self.tok, self.cache, [r.rows[0] for r in detect])
        for r, (language, probs) in zip(detect, found):
            r.dec.language_probs = probs
            r.dec.plan.language = language

    def _prefill(self, chosen: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill the initial tokens of `chosen`, grouped by length (they differ only with prompts);
        returns the logits of their last positions and the no-speech probability at
        <|startoftranscript|>, both in row order, on the device (read back with the tokens)."""
        tok, dev = self.tok, self.model.device
        base = chosen[0].rows[0]
        groups: dict[int, list[Any]] = {}
        for r in chosen:
            groups.setdefault(len(r.dec.start(r.dec.plan.language)), []).append(r)
        # One group (no prompts: the usual case) holds the rows base.. in order: its results are the answer.
        n = sum(len(r.rows) for r in chosen)
        out = None if len(groups) == 1 else torch.empty(n, self.dims.n_vocab, device=dev)
        no_speech = None if len(groups) == 1 else torch.empty(n, device=dev)
        for length, group in groups.items():
            grows = [x for r in group for x in r.rows]
            sot = {r.dec.sot_index for r in group}
            if self.prefills is not None and self.prefills.covers(length, sot, len(grows)):
                last, group_no_speech = self.prefills.run([r.dec.initial for r in group for _ in r.rows], grows)
            else:
                toks = to_device([r.dec.initial for r in group for _ in r.rows], dev)
                logits = self.model.decoder.prefill(toks, to_device(grows, dev), self.cache)
                if len(sot) == 1:
                    at_sot = logits[:, sot.pop()]
                else:
                    sot_idx = to_device([r.dec.sot_index for r in group for _ in r.rows], dev)
                    at_sot = logits.gather(1, sot_idx[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
                last, group_no_speech = logits[:, -1], at_sot.softmax(dim=-1)[:, tok.no_speech]
            if out is None:
                return last, group_no_speech
            at = to_device([g - base for g in grows], dev)
            out[at] = last
            no_speech[at] = group_no_speech
        return out, no_speech

