"""A Piper voice's VITS graph cut in three, so a sentence is heard chunk by chunk and its first chunk early.

A Piper voice is one ONNX graph: text encoder and duration predictor turn phoneme ids into the prior's latents
(192 channels, one frame per 256 output samples, with a mask), a normalizing flow turns those into the
decoder's latents (`/Mul_7_output_0`, the input of the HiFi-GAN decoder's first node `/dec/conv_pre/Conv`),
and the decoder turns them into audio. The decoder is ~75 % of the time (a 3.9 s sentence on one core of
this machine: 0.14 s to the latents, 0.43 s to decode them), and it is convolutional: a frame's audio
depends on the latents around it only. So the graph is cut (onnx's Extractor, at load) at the decoder and
at the flow: the prior runs on a whole piece, and the decoder on windows of latents: each chunk's frames
with CONTEXT_FRAMES of latents on either side, of whose audio the chunk's own part is kept (16 frames: the
chunks join into the whole decode to 3.4e-7; 8 frames: 2e-3). The flow is convolutional too (4 couplings
of 4 convolutions of width 5: 32 frames reach a frame), so the first chunk's latents come from the flow on
its first frames and FLOW_CONTEXT more, not the whole piece: on a 2.7 s sentence the flow is half the time
to the prior's latents. The first chunk of a piece is FIRST_FRAMES long, so its audio leaves after the
prior, a short flow and one short window; later chunks grow (x GROWTH, up to MAX_FRAMES) so the context
decoded twice costs little.

A graph without a decoder node by that name (another exporter) is not cut: its pieces are synthesized
whole. One whose flow does not take exactly the prior's latents and mask is cut at the decoder only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

DECODER_PREFIX, FLOW_PREFIX = "/dec/", "/flow/"
CONTEXT_FRAMES = 16
# The flow's 16 convolutions of width 5 reach 32 frames; 16 more keep a head's latents within 3e-6 of the whole
# piece's (32 alone: 3e-5), for 2 ms of the first chunk.
FLOW_CONTEXT = 48
FIRST_FRAMES = 16  # 16 x 256 samples at 22,050 Hz: 0.19 s of speech in the first chunk
# Each chunk twice the last: after so short a first chunk the next is ready about when the last has played,
# even on two busy cores (worst 18 ms late; growing x4, 72 ms), at 12 % more decoding (docs/BENCHMARKS.md).
GROWTH, MAX_FRAMES = 2, 384


@dataclass
class SplitGraph:
    encoder: object  # onnxruntime.InferenceSession: the graph's inputs -> the prior (the flow's inputs, or the latents)
    decoder: object  # onnxruntime.InferenceSession: the latents -> audio
    latent: str  # the latents' name (the decoder's input)
    flow: object | None = None  # onnxruntime.InferenceSession: the prior's latents and mask -> the latents
    flow_inputs: tuple[str, ...] = ()

    def prior(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """One piece's encoder outputs, each with its frames on the last axis."""
        return self.encoder.run(None, feed)

    def latents(self, prior: list[np.ndarray], end: int | None = None) -> np.ndarray:
        """The decoder's latents of frames [0, end) (None: all of them) from `prior`; for a head of the piece
        the flow runs on that head and the FLOW_CONTEXT frames after it only."""
        if self.flow is None:
            return prior[0][:, :, :end]
        hi = None if end is None else end + FLOW_CONTEXT
        z = self.flow.run(None, {name: x[:, :, :hi] for name, x in zip(self.flow_inputs, prior)})[0]
        return z[:, :, :end]

    def decode(self, z: np.ndarray, start: int, end: int) -> np.ndarray:
        """Audio of frames [start, end) of latents `z` ([1, channels, frames]), decoded with context around them."""
        frames = z.shape[2]
        lo, hi = max(0, start - CONTEXT_FRAMES), min(frames, end + CONTEXT_FRAMES)
        y = np.asarray(self.decoder.run(None, {self.latent: z[:, :, lo:hi]})[0], dtype=np.float32).reshape(-1)
        hop = len(y) // (hi - lo)
        return y[(start - lo) * hop:(end - lo) * hop]


def split(model: Path, options, providers: list[str]) -> SplitGraph | None:
    """The voice's graph cut at its decoder's input; None where it has no decoder node by Piper's names."""
    import onnx
    import onnx.utils
    import onnxruntime as ort

    m = onnx.load(str(model))
    first = next((n for n in m.graph.node if n.name.startswith(DECODER_PREFIX)), None)
    if first is None:
        log.info("%s: no %s* node, so each piece is synthesized whole", model, DECODER_PREFIX)
        return None
    latent = first.input[0]
    inputs = [i.name for i in m.graph.input]
    extract = onnx.utils.Extractor(m)
    decoder = extract.extract_model([latent], [m.graph.output[0].name])
    flow_inputs = _flow_inputs(m)

    def session(graph):
        return ort.InferenceSession(graph.SerializeToString(), sess_options=options, providers=providers)

    if len(flow_inputs) != 2:  # the prior's latents and their mask, as Piper's exporter writes the flow
        log.info("%s: the flow is not cut (its inputs: %s), so a piece's latents are made whole", model, flow_inputs)
        return SplitGraph(session(extract.extract_model(inputs, [latent])), session(decoder), latent)
    return SplitGraph(session(extract.extract_model(inputs, flow_inputs)), session(decoder), latent,
                      session(extract.extract_model(flow_inputs, [latent])), tuple(flow_inputs))


def _flow_inputs(m) -> list[str]:
    """What the graph's nodes from the first flow node on take from the nodes before it (constants aside): the
    prior's latents and mask in a Piper voice. ONNX nodes are in topological order."""
    nodes = list(m.graph.node)
    at = next((i for i, n in enumerate(nodes) if n.name.startswith(FLOW_PREFIX)), None)
    if at is None:
        return []
    before = {out: n for n in nodes[:at] for out in n.output}
    found = []
    for n in nodes[at:]:
        for name in n.input:
            if name in before and before[name].op_type != "Constant" and name not in found:
                found.append(name)
    return found


def chunks(frames: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a piece of `frames` latent frames: FIRST_FRAMES, then growing."""
    out, start, size = [], 0, FIRST_FRAMES
    while start < frames:
        end = min(frames, start + size)
        if frames - end < FIRST_FRAMES:  # no tail shorter than a first chunk: it would cost its context for little
            end = frames
        out.append((start, end))
        start, size = end, min(MAX_FRAMES, size * GROWTH)
    return out
