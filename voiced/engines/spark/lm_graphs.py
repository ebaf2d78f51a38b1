"""The LM's CUDA graphs and the static buffers they replay on (`ServedLM` in served_lm.py runs them).

A 0.5B model at small batch is bound by host overhead per step, not by GPU math: a decode step is ~1000
small kernels launched from Python. So every shape serving meets is captured once and replayed:

- `StepsGraph`: `n_steps` decode steps *and their sampling* for a (batch bucket, KV-length bucket,
  sampler); the sampled token of step i is the input of step i+1 on the device, so a replay runs n steps
  with no host round trip. Its inputs and the samplers' state are `StepState`, at fixed addresses.
- `PrefillGraph`: one packed prefill of n tokens, on `PrefillIO`'s fixed buffers (filled by one
  host->device copy).
- `DecodeGraph`: one decode step to logits, for a (batch, KV length) (`ServedLM.decode`).

Capturing runs each body for real, so each graph saves and restores what its capture writes into rows
that may belong to requests in flight (or, for a prefill, captures from the very inputs it replays next).
All are captured on one stream (`ServedLM.capture_stream`); the steps and prefill graphs, which replay one
at a time, allocate from one memory pool (`ServedLM.graph_pool`). Each graph's `lm` is that ServedLM
(served_lm.py imports this module, so it is not named in the hints here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

log = logging.getLogger(__name__)


class DecodeGraph:
    """A CUDA graph of one decode step for a fixed (batch, kv_len); rows beyond the live batch are
    padding whose writes land in free cache rows at position 0 (overwritten by the next prefill)."""

    def __init__(self, lm, batch: int, kv_len: int) -> None:
        dev = lm.lm_head.weight.device
        self.tokens = torch.zeros(batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.long, device=dev)
        # The warm-up runs really execute and write K/V at position 0 of rows 0..batch-1, which may
        # belong to live requests (graphs are captured lazily): save those entries and put them back.
        saved = [(k[:batch, :, 0].clone(), v[:batch, :, 0].clone()) for k, v in zip(lm.k_caches, lm.v_caches)]
        stream = lm.capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up kernels/allocator outside the graph
                lm.decode_eager(self.tokens, self.positions, kv_len)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream):
            self.logits = lm.decode_eager(self.tokens, self.positions, kv_len)
        for (k, v), (ks, vs) in zip(zip(lm.k_caches, lm.v_caches), saved):
            k[:batch, :, 0].copy_(ks)
            v[:batch, :, 0].copy_(vs)
        log.debug("captured decode graph batch=%d kv_len=%d", batch, kv_len)

    def run(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b = tokens.shape[0]
        self.tokens.zero_()
        self.positions.zero_()
        self.tokens[:b].copy_(tokens)
        self.positions[:b].copy_(positions)
        self.graph.replay()
        return self.logits


@dataclass
class StepState:
    """Per-row decode inputs and sampler state on the device, `[max_batch]` each. The host is the
    source of truth: it writes these before each `run_steps` (one copy) and the steps advance them."""

    tokens: torch.Tensor  # long: the token each row feeds next
    positions: torch.Tensor  # long: the cache position it is written at
    steps: torch.Tensor  # long: tokens sampled so far (the sampler's counter)
    phase: torch.Tensor  # long: which logit mask applies (sampling.PhaseSampler)
    n_global: torch.Tensor  # long: global tokens produced so far (controllable voices)
    seeds: torch.Tensor  # long
    top_k: torch.Tensor  # long
    temperature: torch.Tensor  # float32
    top_p: torch.Tensor  # float32

    INT_FIELDS = ("tokens", "positions", "steps", "phase", "n_global", "seeds", "top_k")
    FLOAT_FIELDS = ("temperature", "top_p")

    @classmethod
    def empty(cls, n: int, device) -> StepState:
        # Two backing blocks, so the host fills the whole state with two copies.
        ints = torch.zeros(len(cls.INT_FIELDS), n, dtype=torch.long, device=device)
        floats = torch.zeros(len(cls.FLOAT_FIELDS), n, dtype=torch.float32, device=device)
        st = cls(*ints.unbind(0), *floats.unbind(0))
        st._ints, st._floats = ints, floats
        return st

    def load(self, ints: torch.Tensor, floats: torch.Tensor) -> None:
        """Copy host-built `[7, n]` long and `[2, n]` float blocks (field order as above) in."""
        self._ints.copy_(ints, non_blocking=True)
        self._floats.copy_(floats, non_blocking=True)

    def columns(self, rows: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The `[7, n]` long and `[2, n]` float blocks of `rows`: views for a slice (a sampler updates them
        in place), copies for an index tensor (written back with `store_ints`)."""
        return self._ints[:, rows], self._floats[:, rows]

    def store_ints(self, rows: torch.Tensor, ints: torch.Tensor) -> None:
        self._ints[:, rows] = ints


class StepsGraph:
    """A CUDA graph of `n_steps` decode+sample steps for a fixed (batch bucket, kv_len, sampler)."""

    def __init__(self, lm, pick, batch: int, n_steps: int, kv_len: int) -> None:
        dev = lm.lm_head.weight.device
        st = lm.state
        self.out = torch.zeros(lm.max_batch, n_steps, dtype=torch.long, device=dev)
        # Capture runs the body for real (warm-up and capture): keep the state and the cache entries
        # it touches (positions 0..n_steps-1 of rows 0..batch-1, from a zeroed state) and restore them.
        state_saved = (st._ints.clone(), st._floats.clone())
        kv_saved = [(k[:batch, :, :n_steps].clone(), v[:batch, :, :n_steps].clone()) for k, v in zip(lm.k_caches, lm.v_caches)]
        st._ints.zero_()
        st.top_k.fill_(1)
        st.temperature.fill_(1.0)
        st.top_p.fill_(1.0)
        blank = (st._ints.clone(), st._floats.clone())
        stream = lm.capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                st.load(*blank)
                lm.steps_body(pick, batch, n_steps, kv_len, self.out)
        torch.cuda.current_stream().wait_stream(stream)
        st.load(*blank)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream, pool=lm.graph_pool()):
            lm.steps_body(pick, batch, n_steps, kv_len, self.out)
        st.load(*state_saved)
        for (k, v), (ks, vs) in zip(zip(lm.k_caches, lm.v_caches), kv_saved):
            k[:batch, :, :n_steps].copy_(ks)
            v[:batch, :, :n_steps].copy_(vs)
        log.debug("captured %d-step decode graph batch=%d kv_len=%d", n_steps, batch, kv_len)


class PrefillIO:
    """A packed prefill's inputs and output, at fixed addresses so that graphs can replay on them: one
    pinned host block and its device copy `[tokens | segment | position | slot]` (`cap` each) then
    `last` (`rows`: the index of each prompt's last token), and the output `[rows, C]`. The host fills
    the block and sends it in one copy."""

    def __init__(self, cap: int, rows: int, hidden: int, dtype: torch.dtype, device) -> None:
        device = torch.device(device)
        cuda = device.type == "cuda"
        self.cap, self.rows = cap, rows
        self.host = torch.zeros(4 * cap + rows, dtype=torch.long, pin_memory=cuda)
        self.dev = torch.zeros_like(self.host, device=device) if cuda else self.host
        self.out = torch.zeros(rows, hidden, dtype=dtype, device=device)
        # the host block may be rewritten only once the copy out of it has run
        self.sent = torch.cuda.Event() if cuda else None
        self._sent_once = False

    def views(self, n: int):
        """(tokens, segments, positions, slots) of the first n packed tokens, and `last`, on the device."""
        c, d = self.cap, self.dev
        return d[:n], d[c : c + n], d[2 * c : 2 * c + n], d[3 * c : 3 * c + n], d[4 * c :]

    def fill(self, prompts: list, lengths: list[int], slots: list[int], n: int, max_seq: int) -> None:
        if self.sent is not None and self._sent_once:
            self.sent.synchronize()  # normally long done: the previous prefill's step has synced since
        c, h = self.cap, self.host.numpy()
        tokens, seg, pos, slot = h[:n], h[c : c + n], h[2 * c : 2 * c + n], h[3 * c : 3 * c + n]
        on_device = []
        o = 0
        for i, (p, t, s) in enumerate(zip(prompts, lengths, slots)):
            if isinstance(p, torch.Tensor):
                if p.device.type == "cpu":
                    tokens[o : o + t] = p.numpy()
                else:
                    on_device.append((o, p))
            else:
                tokens[o : o + t] = p
            seg[o : o + t] = i
            pos[o : o + t] = np.arange(t)
            slot[o : o + t] = s
            o += t
        if o < n:  # padding: one more segment after the last prompt, in its row, positions clamped
            tokens[o:n] = 0
            seg[o:n] = len(prompts)
            pos[o:n] = np.minimum(lengths[-1] + np.arange(n - o), max_seq - 1)
            slot[o:n] = slots[-1]
        last = h[4 * c :]
        last[:] = 0
        last[: len(lengths)] = np.cumsum(lengths) - 1
        if self.dev is not self.host:
            self.dev.copy_(self.host, non_blocking=True)
            self.sent.record()
            self._sent_once = True
        for o, p in on_device:
            self.dev[o : o + p.shape[0]].copy_(p)


class PrefillGraph:
    """A CUDA graph of one packed prefill of n tokens (embedding, mask, rope factors, every layer, the
    prompts' last hidden states into `io.out`), replayed on whatever `io` holds. Capture runs the pass
    for real first (kernels, cuBLAS plans, compiled code warmed outside the graph), on the inputs the
    caller has just put in `io`: it writes exactly what the replay that follows writes, so rows of
    requests in flight are never touched, whenever a length is first met."""

    def __init__(self, lm, io: PrefillIO, n: int) -> None:
        stream = lm.capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                lm.prefill_body(io, n)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=stream, pool=lm.graph_pool()):
            lm.prefill_body(io, n)
        log.debug("captured prefill graph of %d tokens", n)
