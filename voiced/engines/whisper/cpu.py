"""What the engine does differently on a CPU, where a decoder step is bound by memory traffic.

At batch 1 a decoder step reads every decoder weight once, the 1500 audio positions' cross keys
and values, and the whole output projection (the tied token embedding: 51865 x width, 80 MB in
float32 for tiny): its time is bytes over memory bandwidth, plus a few microseconds per op.

* float32 (the default, exact): the token embedding is kept column-major (the same values, stored
  transposed). The logits `x @ E.T` then stream through memory row after row of E.T, each row
  scaled by one activation and summed into a vector that stays in cache, about twice as fast as
  the dot-product-per-token order of a row-major E (12 ms against 24 ms per step for tiny.en
  on two cores); an embedding lookup reads one strided column, which costs
  nothing at one token per step.
* int8 (opt-in, `dtype="int8"`): the matrix products over many rows run as dynamically quantized
  int8 GEMMs (torch.ao: int8 weights with one scale per output channel, activations quantized per
  call with one scale per tensor; fbgemm/oneDNN kernels): every Linear layer of the encoder (1500
  rows), the decoder's cross-attention key/value projections (1500 rows, once per request) and the
  output projection (a quarter of its 80 MB read per step). The decoder's per-token layers stay
  float32: at one row, quantizing the activations on every call cost more than the smaller weights
  saved (a decoder step with them in int8 is slower than float32).
  One scale per tensor fails where a few rows are huge: the encoder's MLP output layers read GELU
  outputs that reach 559 in tiny.en's last layer on the window's final positions, against a
  median near 0, and quantized whole they left every other row without resolution (WER 48.7 %
  against 17.9 % in float32 on our 50-utterance set). Those layers send the rows whose largest
  value is over 8 times the median row's through a float32 product instead (`OutlierRowsLinear`).
  Convolutions, attention, layer norms and the KV caches stay float32. Results are approximate
  (measured with `voiced eval`: docs/BENCHMARKS.md).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .model import TextDecoder, Whisper


def column_major_embedding_(decoder: TextDecoder) -> None:
    """Store the token embedding transposed in memory (same values, same shape)."""
    w = decoder.token_embedding.weight
    if w.stride(0) != 1:
        with torch.no_grad():
            w.data = w.data.T.contiguous().T


def int8_available() -> bool:
    return any(e in torch.backends.quantized.supported_engines for e in ("x86", "fbgemm", "onednn"))


class OutlierRowsLinear(nn.Module):
    """A dynamically quantized Linear whose outlier rows (largest |value| over `factor` times the
    median row's) run in float32 against the dequantized weight, so that they do not set the
    quantization scale of all the others."""

    def __init__(self, quantized: nn.Module, factor: float = 8.0):
        super().__init__()
        self.quantized = quantized
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        peak = rows.abs().amax(dim=1)
        big = peak > self.factor * peak.median()
        if rows.shape[0] < 3 or not bool(big.any()):
            return self.quantized(x)
        out_big = F.linear(rows[big], self.quantized.weight().dequantize(), self.quantized.bias())
        out = torch.empty(rows.shape[0], out_big.shape[1], dtype=x.dtype, device=x.device)
        out[~big] = self.quantized(rows[~big])
        out[big] = out_big
        return out.view(*x.shape[:-1], -1)


def quantize_int8_(model: Whisper) -> Whisper:
    """Quantize the many-row matrix products to int8 (see the module doc). In place; the token
    embedding stays float32 for lookups, the output projection gets an int8 copy."""
    if not int8_available():
        raise RuntimeError("this torch build has no x86/fbgemm/oneDNN quantized kernels for int8; use float32")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    dec = model.decoder
    vocab, width = dec.token_embedding.weight.shape
    head = nn.Linear(width, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(dec.token_embedding.weight)
    dec.output_projection = head
    scope = {"encoder": per_channel_dynamic_qconfig, "decoder.output_projection": per_channel_dynamic_qconfig}
    for i in range(len(dec.blocks)):
        for name in ("key", "value"):
            scope[f"decoder.blocks.{i}.cross_attn.{name}"] = per_channel_dynamic_qconfig
    with warnings.catch_warnings():
        # torch.ao's eager quantization is marked deprecated in favour of torchao (not a dependency
        # here); it is what ships with torch and it runs these kernels.
        warnings.simplefilter("ignore")
        quantize_dynamic(model, scope, dtype=torch.qint8, inplace=True)
    for block in model.encoder.blocks:
        block.mlp[2] = OutlierRowsLinear(block.mlp[2])
    return model
