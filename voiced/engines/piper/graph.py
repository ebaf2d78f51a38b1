"""A Piper voice's VITS graph cut in two where its decoder begins, so a sentence is heard chunk by chunk.

A Piper voice is one ONNX graph: text encoder, duration predictor and flow turn phoneme ids into a latent
sequence (192 channels, one frame per 256 output samples: `/Mul_7_output_0`, the input of the HiFi-GAN
decoder's first node `/dec/conv_pre/Conv`), and the decoder turns that into audio. The decoder is ~75 %
of the time (a 3.9 s sentence on one core of this machine: 0.14 s to the latents, 0.43 s to decode them),
and it is convolutional: a frame's audio depends on the latents around it only. So the graph is cut at the
latents (onnx's Extractor, at load), the latents are made for a whole piece at once, and the decoder runs
on windows of them: each chunk's frames with CONTEXT_FRAMES of latents on either side, of whose audio the
chunk's own part is kept. With 16 frames of context the chunks join into the whole decode to 3.4e-7 (the
largest difference on that sentence; 8 frames: 2e-3). The first chunk of a piece is FIRST_FRAMES long, so
its audio leaves after the latents and one short window; later chunks grow (x GROWTH, up to MAX_FRAMES)
so the context decoded twice costs little.

A graph without a decoder node by that name (another exporter) is not cut: its pieces are synthesized
whole, as before.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

DECODER_PREFIX = "/dec/"
CONTEXT_FRAMES = 16
FIRST_FRAMES = 24  # 24 x 256 samples at 22,050 Hz: 0.28 s of speech in the first chunk
GROWTH, MAX_FRAMES = 4, 384


@dataclass
class SplitGraph:
    encoder: object  # onnxruntime.InferenceSession: the graph's inputs -> the latents
    decoder: object  # onnxruntime.InferenceSession: the latents -> audio
    latent: str  # the latents' name (the decoder's input)

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
    encoder = extract.extract_model(inputs, [latent]).SerializeToString()
    decoder = extract.extract_model([latent], [m.graph.output[0].name]).SerializeToString()
    return SplitGraph(ort.InferenceSession(encoder, sess_options=options, providers=providers),
                      ort.InferenceSession(decoder, sess_options=options, providers=providers), latent)


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
