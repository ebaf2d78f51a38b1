"""BiCodec, Spark-TTS's audio codec: our own implementation of the published architecture.

Two token streams, both at 16 kHz:

- *semantic* tokens, 50 per second (320 samples each): wav2vec2 features -> `encoder` (Vocos ConvNeXt
  backbone) -> `quantizer` (factorized VQ: 1024 -> 8 dims, cosine nearest of 8192 codes);
- 32 *global* tokens per voice: a 6 s mel spectrogram -> `speaker_encoder` (ECAPA-TDNN frame features ->
  perceiver resampler with 32 latents -> finite scalar quantizer, 4^6 = 4096 codes).

Decoding (`detokenize`): codebook -> 8->1024 projection -> `prenet` (ConvNeXt backbone with AdaLayerNorm
conditioned on the speaker vector) + speaker vector -> `decoder` (wave generator: conv, four upsampling
blocks x8 x5 x4 x2 with Snake and dilated residual units, tanh).

Attribute names follow the published `BiCodec/model.safetensors` exactly (`decoder.model.1.block.2...`,
`speaker_encoder.speaker_encoder.layer2.se_res2block.1.convs.0...`), so loading is a rename-free
`load_state_dict` once the weight-normed `weight_g`/`weight_v` pairs are folded into plain weights.
Everything in the decode path is local in time (convolutions, per-frame norms), which is what lets
`streaming.py` cut the stream into exact chunks; `receptive_radius()` says how far each frame sees.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from . import vocoder_kernels

log = logging.getLogger(__name__)

HOP = 320  # samples per semantic token at 16 kHz
# ECAPA-TDNN width: fixed by the published architecture (ECAPA_TDNN_GLOB_c512), not in config.yaml.
ECAPA_CHANNELS = 512


# --------------------------------------------------------------------------------------- config


@dataclass
class MelParams:
    sample_rate: int = 16000
    n_fft: int = 1024
    win_length: int = 640
    hop_length: int = 320
    mel_fmin: float = 10.0
    mel_fmax: float | None = None
    num_mels: int = 128


@dataclass
class VocosParams:
    input_channels: int = 1024
    vocos_dim: int = 384
    vocos_intermediate_dim: int = 2048
    vocos_num_layers: int = 12
    out_channels: int = 1024
    sample_ratios: list[int] = field(default_factory=lambda: [1, 1])
    condition_dim: int | None = None
    use_tanh_at_final: bool = False


@dataclass
class BiCodecConfig:
    mel: MelParams = field(default_factory=MelParams)
    encoder: VocosParams = field(default_factory=VocosParams)
    prenet: VocosParams = field(default_factory=lambda: VocosParams(condition_dim=1024))
    postnet: VocosParams = field(default_factory=lambda: VocosParams(vocos_num_layers=6))
    # quantizer
    latent_dim: int = 1024
    codebook_size: int = 8192
    codebook_dim: int = 8
    # speaker encoder
    speaker_input_dim: int = 128
    speaker_out_dim: int = 1024
    speaker_latent_dim: int = 128
    token_num: int = 32
    fsq_levels: list[int] = field(default_factory=lambda: [4, 4, 4, 4, 4, 4])
    fsq_num_quantizers: int = 1
    # wave generator
    wave_channels: int = 1536
    rates: list[int] = field(default_factory=lambda: [8, 5, 4, 2])
    kernel_sizes: list[int] = field(default_factory=lambda: [16, 11, 8, 4])
    # repository-level config.yaml
    sample_rate: int = 16000
    ref_segment_duration: float = 6.0
    latent_hop_length: int = 320
    volume_normalize: bool = True

    @classmethod
    def from_yaml(cls, bicodec_yaml: str | Path, root_yaml: str | Path | None = None) -> BiCodecConfig:
        """Read `BiCodec/config.yaml` (its `audio_tokenizer` section) and the repository's `config.yaml`."""
        import yaml

        raw = yaml.safe_load(Path(bicodec_yaml).read_text())
        at = raw.get("audio_tokenizer", raw)
        try:
            cfg = cls(
                mel=_pick(MelParams, at["mel_params"]),
                encoder=_pick(VocosParams, at["encoder"]),
                prenet=_pick(VocosParams, at["prenet"]),
                postnet=_pick(VocosParams, at["postnet"]),
                latent_dim=at["quantizer"]["input_dim"],
                codebook_size=at["quantizer"]["codebook_size"],
                codebook_dim=at["quantizer"]["codebook_dim"],
                speaker_input_dim=at["speaker_encoder"]["input_dim"],
                speaker_out_dim=at["speaker_encoder"]["out_dim"],
                speaker_latent_dim=at["speaker_encoder"]["latent_dim"],
                token_num=at["speaker_encoder"]["token_num"],
                fsq_levels=list(at["speaker_encoder"]["fsq_levels"]),
                fsq_num_quantizers=at["speaker_encoder"].get("fsq_num_quantizers", 1),
                wave_channels=at["decoder"]["channels"],
                rates=list(at["decoder"]["rates"]),
                kernel_sizes=list(at["decoder"]["kernel_sizes"]),
            )
        except KeyError as e:
            raise ValueError(f"{bicodec_yaml}: missing key {e} in the audio_tokenizer section") from e
        if at["decoder"].get("input_channel", cfg.latent_dim) != cfg.latent_dim:
            raise ValueError(f"{bicodec_yaml}: decoder.input_channel must equal quantizer.input_dim")
        if root_yaml is not None and Path(root_yaml).exists():
            root = yaml.safe_load(Path(root_yaml).read_text()) or {}
            cfg.sample_rate = int(root.get("sample_rate", cfg.sample_rate))
            cfg.ref_segment_duration = float(root.get("ref_segment_duration", cfg.ref_segment_duration))
            cfg.latent_hop_length = int(root.get("latent_hop_length", cfg.latent_hop_length))
            cfg.volume_normalize = bool(root.get("volume_normalize", cfg.volume_normalize))
        if math.prod(cfg.rates) != HOP or cfg.mel.hop_length != HOP:
            raise ValueError(f"{bicodec_yaml}: expected {HOP} samples per token, got rates {cfg.rates}")
        if cfg.fsq_num_quantizers != 1:
            raise ValueError(f"{bicodec_yaml}: fsq_num_quantizers={cfg.fsq_num_quantizers}; the LM has one global stream")
        if any(r != 1 for r in cfg.prenet.sample_ratios):
            raise ValueError(f"{bicodec_yaml}: prenet sample_ratios {cfg.prenet.sample_ratios} unsupported (must be 1)")
        return cfg


def _pick(kind, raw: dict[str, Any]):
    names = kind.__dataclass_fields__.keys()
    return kind(**{k: v for k, v in raw.items() if k in names})


# ----------------------------------------------------------------------------- building blocks


class AdaLayerNorm(nn.Module):
    """LayerNorm whose scale and shift come from a conditioning vector (the speaker embedding)."""

    def __init__(self, condition_dim: int, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.dim = eps, dim
        self.scale = nn.Linear(condition_dim, dim)
        self.shift = nn.Linear(condition_dim, dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:  # x [B, T, C]
        x = F.layer_norm(x, (self.dim,), eps=self.eps)
        return x * self.scale(cond)[:, None] + self.shift(cond)[:, None]


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int, intermediate: int, layer_scale: float, condition_dim: int | None) -> None:
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = AdaLayerNorm(condition_dim, dim) if condition_dim else nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, intermediate)
        self.pwconv2 = nn.Linear(intermediate, dim)
        self.gamma = nn.Parameter(layer_scale * torch.ones(dim)) if layer_scale > 0 else None

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None) -> torch.Tensor:  # x [B, C, T]
        h = self.dwconv(x).transpose(1, 2)
        h = self.norm(h, cond) if isinstance(self.norm, AdaLayerNorm) else self.norm(h)
        h = self.pwconv2(F.gelu(self.pwconv1(h)))
        if self.gamma is not None:
            h = self.gamma * h
        return x + h.transpose(1, 2)


class VocosBackbone(nn.Module):
    """[B, C_in, T] -> [B, T, dim]. Receptive radius: 3 frames for `embed` + 3 per block."""

    def __init__(self, input_channels: int, dim: int, intermediate: int, num_layers: int, condition_dim: int | None = None) -> None:
        super().__init__()
        self.embed = nn.Conv1d(input_channels, dim, kernel_size=7, padding=3)
        self.norm = AdaLayerNorm(condition_dim, dim) if condition_dim else nn.LayerNorm(dim, eps=1e-6)
        scale = 1.0 / num_layers
        self.convnext = nn.ModuleList([ConvNeXtBlock(dim, intermediate, scale, condition_dim) for _ in range(num_layers)])
        self.final_layer_norm = nn.LayerNorm(dim, eps=1e-6)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(x).transpose(1, 2)
        x = self.norm(x, cond) if isinstance(self.norm, AdaLayerNorm) else self.norm(x)
        x = x.transpose(1, 2)
        for block in self.convnext:
            x = block(x, cond)
        return self.final_layer_norm(x.transpose(1, 2))

    @property
    def radius(self) -> int:
        return 3 + 3 * len(self.convnext)


class SamplingBlock(nn.Module):
    """[B, T, C] -> [B, C, T']: learned (transposed) conv plus repeat / average-pool skips.

    With both scales 1 (the published configs) it has no parameters and returns 3x its input:
    the learned branch, the repeat skip and the pool skip all collapse to the identity.
    """

    def __init__(self, dim: int, groups: int = 1, upsample_scale: int = 1, downsample_scale: int = 1) -> None:
        super().__init__()
        self.up, self.down = upsample_scale, downsample_scale
        if self.up > 1:
            self.de_conv_upsampler = nn.Sequential(
                nn.LeakyReLU(0.2),
                nn.ConvTranspose1d(dim, dim, kernel_size=self.up * 2, stride=self.up,
                                   padding=self.up // 2 + self.up % 2, output_padding=self.up % 2, groups=groups),
            )
        if self.down > 1:
            self.conv_downsampler = nn.Sequential(
                nn.LeakyReLU(0.2),
                nn.Conv1d(dim, dim, kernel_size=2 * self.down, stride=self.down,
                          padding=self.down // 2 + self.down % 2, groups=groups),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.transpose(1, 2)
        if self.up > 1:
            repeat = x.repeat_interleave(self.up, dim=2)
            merged = repeat + self.de_conv_upsampler(x)
        else:
            repeat = merged = x
        if self.down > 1:
            return (self.conv_downsampler(merged) + F.avg_pool1d(repeat, self.down, self.down)
                    + F.avg_pool1d(merged, self.down, self.down))
        return merged + repeat + merged


class FeatEncoder(nn.Module):
    """wav2vec2 features [B, 1024, T] -> latent [B, latent, T] (published name: `encoder`)."""

    def __init__(self, p: VocosParams) -> None:
        super().__init__()
        self.encoder = VocosBackbone(p.input_channels, p.vocos_dim, p.vocos_intermediate_dim, p.vocos_num_layers)
        self.downsample = nn.Sequential(*[
            nn.Sequential(SamplingBlock(p.vocos_dim, groups=p.vocos_dim, downsample_scale=r),
                          VocosBackbone(p.vocos_dim, p.vocos_dim, p.vocos_intermediate_dim, 2))
            for r in p.sample_ratios
        ])
        self.project = nn.Linear(p.vocos_dim, p.out_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.downsample(self.encoder(x))).transpose(1, 2)


class FeatDecoder(nn.Module):
    """latent [B, latent, T] (+ speaker condition) -> [B, out, T] (published names: `prenet`, `postnet`)."""

    def __init__(self, p: VocosParams) -> None:
        super().__init__()
        self.linear_pre = nn.Linear(p.input_channels, p.vocos_dim)
        self.downsample = nn.Sequential(*[
            nn.Sequential(SamplingBlock(p.vocos_dim, groups=p.vocos_dim, upsample_scale=r),
                          VocosBackbone(p.vocos_dim, p.vocos_dim, p.vocos_intermediate_dim, 2))
            for r in p.sample_ratios
        ])
        self.vocos_backbone = VocosBackbone(p.vocos_dim, p.vocos_dim, p.vocos_intermediate_dim,
                                            p.vocos_num_layers, condition_dim=p.condition_dim)
        self.linear = nn.Linear(p.vocos_dim, p.out_channels)
        self.use_tanh_at_final = p.use_tanh_at_final

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        x = self.downsample(self.linear_pre(x.transpose(1, 2))).transpose(1, 2)
        x = self.linear(self.vocos_backbone(x, cond)).transpose(1, 2)
        return torch.tanh(x) if self.use_tanh_at_final else x

    @property
    def radius(self) -> int:
        return sum(seq[1].radius for seq in self.downsample) + self.vocos_backbone.radius


class Snake1d(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))
        self._inverse: tuple[tuple, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inverse_alpha() * torch.sin(self.alpha * x).pow(2)

    def inverse_alpha(self) -> torch.Tensor:
        """1 / (alpha + 1e-9), the same bits as computing it in every call, computed once per value of
        alpha: the eager vocoder's host time is its number of torch calls (29 Snakes, ~60 calls a
        decode). The key (the parameter, its version, device, dtype) changes with every load or move;
        reading it calls no torch function. A normal tensor even under inference mode, so that a later
        forward with autograd on may save it."""
        a = self.alpha
        key = (id(a), a._version, a.device, a.dtype)
        if self._inverse is None or self._inverse[0] != key:
            with torch.inference_mode(False), torch.no_grad():
                self._inverse = (key, (a + 1e-9).reciprocal())
        return self._inverse[1]


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim), nn.Conv1d(dim, dim, kernel_size=7, dilation=dilation, padding=3 * dilation),
            Snake1d(dim), nn.Conv1d(dim, dim, kernel_size=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class UpsampleBlock(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(cin),
            nn.ConvTranspose1d(cin, cout, kernel_size=kernel, stride=stride, padding=(kernel - stride) // 2),
            ResidualUnit(cout, 1), ResidualUnit(cout, 3), ResidualUnit(cout, 9),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


class WaveGenerator(nn.Module):
    """[B, latent, T] -> [B, 1, T * 320] (published name: `decoder`)."""

    def __init__(self, cfg: BiCodecConfig) -> None:
        super().__init__()
        c = cfg.wave_channels
        layers: list[nn.Module] = [nn.Conv1d(cfg.latent_dim, c, kernel_size=7, padding=3)]
        for i, (k, s) in enumerate(zip(cfg.kernel_sizes, cfg.rates)):
            layers.append(UpsampleBlock(c // 2**i, c // 2 ** (i + 1), k, s))
        out = c // 2 ** len(cfg.rates)
        layers += [Snake1d(out), nn.Conv1d(out, 1, kernel_size=7, padding=3), nn.Tanh()]
        self.model = nn.Sequential(*layers)
        self.rates, self.kernels = list(cfg.rates), list(cfg.kernel_sizes)

    def forward(self, x: torch.Tensor, ends: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """ends: (valid `[B]` on the device, padded length): row b ends after valid[b] token frames, and every
        time-mixing convolution sees zeros past that (an end-masked window, streaming.py). The modules' path
        leaves that to streaming's hooks on those convolutions; the kernels' path applies it itself."""
        if x.device.type in ("cuda", "meta") and vocoder_kernels.enabled():
            return self.forward_kernels(x, ends)
        return self.model(x)

    def forward_kernels(self, x: torch.Tensor, ends: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
        """`self.model(x)`, bit for bit, with its elementwise work through vocoder_kernels: each convolution
        runs without its bias, which the kernel after it adds (a Snake's input, or a residual unit's
        output), and each Snake before a time-mixing convolution writes that convolution's end mask."""
        k = vocoder_kernels
        length = x.shape[-1]
        keeps: dict[int, torch.Tensor] = {}  # one per rate: several Snakes share each

        def keep(t: int) -> torch.Tensor | None:  # row b's positions at this rate from valid[b] * t // length on
            if ends is None:
                return None
            if t not in keeps:
                keeps[t] = ends[0] * t // ends[1]
            return keeps[t]

        conv_in, *blocks, last, conv_out, _tanh = self.model
        if ends is not None:  # conv_in's input is no Snake's output: masked as streaming's hook does
            x = torch.where(torch.arange(length, device=x.device)[None, None, :] < keep(length)[:, None, None], x, 0.0)
        x = F.conv1d(x, conv_in.weight, None, conv_in.stride, conv_in.padding)
        bias = conv_in.bias
        for block in blocks:
            s, up, *units = block.block
            h = k.snake(x, s.alpha, s.inverse_alpha(), bias, keep(x.shape[-1]))
            x = F.conv_transpose1d(h, up.weight, None, up.stride, up.padding)
            bias = up.bias
            for unit in units:
                s1, conv, s2, pointwise = unit.block
                if bias is not None:  # the transposed conv's output + bias is the residual stream: written too
                    x, h = k.snake(x, s1.alpha, s1.inverse_alpha(), bias, keep(x.shape[-1]), with_input=True)
                    bias = None
                else:
                    h = k.snake(x, s1.alpha, s1.inverse_alpha(), None, keep(x.shape[-1]))
                h = F.conv1d(h, conv.weight, None, conv.stride, conv.padding, conv.dilation)
                h = k.snake(h, s2.alpha, s2.inverse_alpha(), conv.bias)  # the pointwise conv mixes no time: no mask
                x = k.bias_residual(x, F.conv1d(h, pointwise.weight), pointwise.bias)
        h = k.snake(x, last.alpha, last.inverse_alpha(), None, keep(x.shape[-1]))
        return torch.tanh(F.conv1d(h, conv_out.weight, conv_out.bias, conv_out.stride, conv_out.padding))

    def radius_frames(self) -> float:
        """How far (in token frames) one output sample's inputs reach, the larger of the two sides.

        Transposed conv (kernel k, stride s, padding p): output j reads inputs i with
        i*s - p <= j <= i*s - p + k - 1, i.e. (k-1-p)/s input samples back and p/s ahead. Convs with
        kernel k and dilation d reach d*(k-1)/2 either side. Summed in frames across the rates."""
        left = right = 3.0  # conv_in, k7 at the frame rate
        rate = 1
        for k, s in zip(self.kernels, self.rates):
            p = (k - s) // 2
            left += (k - 1 - p) / s / rate
            right += p / s / rate
            rate *= s
            left += 3 * (1 + 3 + 9) / rate  # three residual units, k7 dilations 1, 3, 9
            right += 3 * (1 + 3 + 9) / rate
        left += 3 / rate  # final conv k7
        right += 3 / rate
        return max(left, right)


class FactorizedVQ(nn.Module):
    """Semantic quantizer: 1x1 conv down to `codebook_dim`, cosine nearest code, 1x1 conv back up."""

    def __init__(self, cfg: BiCodecConfig) -> None:
        super().__init__()
        self.in_project = nn.Conv1d(cfg.latent_dim, cfg.codebook_dim, kernel_size=1)
        self.out_project = nn.Conv1d(cfg.codebook_dim, cfg.latent_dim, kernel_size=1)
        self.codebook = nn.Embedding(cfg.codebook_size, cfg.codebook_dim)
        # Training-time usage statistics; kept so the published tensor loads into a named buffer.
        self.register_buffer("cluster_size", torch.zeros(cfg.codebook_size))

    def tokenize(self, z: torch.Tensor) -> torch.Tensor:  # z [B, latent, T] -> [B, T]
        e = F.normalize(self.in_project(z).transpose(1, 2), dim=-1)
        cb = F.normalize(self.codebook.weight, dim=-1)
        return (e @ cb.t()).argmax(-1)  # max cosine == min distance between unit vectors

    def detokenize(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, latent, T]
        return self.out_project(self.codebook(ids).transpose(1, 2))


# ------------------------------------------------------------------------------ speaker encoder


class Conv1dReluBn(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int = 1, padding: int = 0, dilation: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, 1, padding, dilation)
        self.bn = nn.BatchNorm1d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(F.relu(self.conv(x)))


class Res2Conv1dReluBn(nn.Module):
    def __init__(self, channels: int, kernel: int, padding: int, dilation: int, scale: int) -> None:
        super().__init__()
        self.width = channels // scale
        n = scale - 1 if scale > 1 else 1
        self.convs = nn.ModuleList([nn.Conv1d(self.width, self.width, kernel, 1, padding, dilation) for _ in range(n)])
        self.bns = nn.ModuleList([nn.BatchNorm1d(self.width) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, self.width, 1)
        out, sp = [], parts[0]
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            if i:
                sp = sp + parts[i]
            sp = bn(F.relu(conv(sp)))
            out.append(sp)
        if len(parts) > len(self.convs):
            out.append(parts[len(self.convs)])
        return torch.cat(out, 1)


class SEConnect(nn.Module):
    def __init__(self, channels: int, bottleneck: int = 128) -> None:
        super().__init__()
        self.linear1 = nn.Linear(channels, bottleneck)
        self.linear2 = nn.Linear(bottleneck, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.linear2(F.relu(self.linear1(x.mean(dim=2)))))
        return x * gate[:, :, None]


class SERes2Block(nn.Module):
    def __init__(self, channels: int, kernel: int, padding: int, dilation: int, scale: int) -> None:
        super().__init__()
        self.se_res2block = nn.Sequential(
            Conv1dReluBn(channels, channels), Res2Conv1dReluBn(channels, kernel, padding, dilation, scale),
            Conv1dReluBn(channels, channels), SEConnect(channels),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.se_res2block(x)


class AttentiveStatsPool(nn.Module):
    """Present for the published x-vector head's weights; the token path does not run it."""

    def __init__(self, in_dim: int, bottleneck: int = 128) -> None:
        super().__init__()
        self.linear1 = nn.Conv1d(in_dim * 3, bottleneck, kernel_size=1)
        self.linear2 = nn.Conv1d(bottleneck, in_dim, kernel_size=1)


class ECAPA(nn.Module):
    """ECAPA-TDNN (global-context variant); `frames()` returns the [B, 1536, T] features the tokens use."""

    def __init__(self, feat_dim: int, embed_dim: int, channels: int = ECAPA_CHANNELS) -> None:
        super().__init__()
        self.layer1 = Conv1dReluBn(feat_dim, channels, kernel=5, padding=2)
        self.layer2 = SERes2Block(channels, 3, 2, 2, 8)
        self.layer3 = SERes2Block(channels, 3, 3, 3, 8)
        self.layer4 = SERes2Block(channels, 3, 4, 4, 8)
        self.conv = nn.Conv1d(channels * 3, 512 * 3, kernel_size=1)
        # x-vector head (training / speaker-similarity only)
        self.pool = AttentiveStatsPool(512 * 3)
        self.bn = nn.BatchNorm1d(512 * 3 * 2)
        self.linear = nn.Linear(512 * 3 * 2, embed_dim)

    def frames(self, mel: torch.Tensor) -> torch.Tensor:  # mel [B, F, T]
        o1 = self.layer1(mel)
        o2 = self.layer2(o1)
        o3 = self.layer3(o2)
        o4 = self.layer4(o3)
        return F.relu(self.conv(torch.cat([o2, o3, o4], 1)))


class PerceiverAttention(nn.Module):
    def __init__(self, dim: int, heads: int = 8, dim_head: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_kv = nn.Linear(dim, heads * dim_head * 2, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, latents: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        ctx = torch.cat([latents, context], dim=1)  # latents also attend to themselves
        q = self.to_q(latents)
        k, v = self.to_kv(ctx).chunk(2, dim=-1)
        b = latents.shape[0]
        q, k, v = (t.view(b, t.shape[1], self.heads, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, latents.shape[1], -1))


class GEGLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, gate = x.chunk(2, dim=-1)
        return F.gelu(gate) * x


class PerceiverRMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class PerceiverResampler(nn.Module):
    def __init__(self, dim: int, dim_context: int, num_latents: int, depth: int = 2, ff_mult: int = 4) -> None:
        super().__init__()
        self.proj_context = nn.Linear(dim_context, dim) if dim_context != dim else nn.Identity()
        self.latents = nn.Parameter(torch.randn(num_latents, dim) * 0.02)
        inner = int(dim * ff_mult * 2 / 3)
        self.layers = nn.ModuleList([
            nn.ModuleList([PerceiverAttention(dim),
                           nn.Sequential(nn.Linear(dim, inner * 2), GEGLU(), nn.Linear(inner, dim))])
            for _ in range(depth)
        ])
        self.norm = PerceiverRMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, C] -> [B, num_latents, dim]
        x = self.proj_context(x)
        lat = self.latents[None].expand(x.shape[0], -1, -1)
        for attn, ff in self.layers:
            lat = attn(lat, x) + lat
            lat = ff(lat) + lat
        return self.norm(lat)


class FSQ(nn.Module):
    """Residual finite scalar quantizer with one stage: project to len(levels) dims, round each to
    one of `levels[i]` values, index = mixed-radix number of the rounded values."""

    def __init__(self, dim: int, levels: list[int]) -> None:
        super().__init__()
        self.project_in = nn.Linear(dim, len(levels))
        self.project_out = nn.Linear(len(levels), dim)
        lv = torch.tensor(levels, dtype=torch.int64)
        self.register_buffer("levels", lv, persistent=False)
        self.register_buffer("basis", torch.cumprod(torch.tensor([1] + levels[:-1]), 0), persistent=False)

    def tokenize(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, dim] -> [B, N]
        z = self.project_in(x).float()
        lv = self.levels.float()
        half_l = (lv - 1) * (1 + 1e-3) / 2
        offset = torch.where(self.levels % 2 == 0, 0.5, 0.0).to(z.device)
        shift = torch.atanh(offset / half_l)
        bounded = torch.tanh(z + shift) * half_l - offset
        digits = bounded.round() + (self.levels // 2)  # 0..levels-1
        return (digits.long() * self.basis).sum(-1)

    def detokenize(self, ids: torch.Tensor) -> torch.Tensor:  # [B, N] -> [B, N, dim]
        digits = (ids[..., None] // self.basis) % self.levels
        half = self.levels // 2
        codes = (digits - half).float() / half.float()
        return self.project_out(codes.to(self.project_out.weight.dtype))


class SpeakerEncoder(nn.Module):
    def __init__(self, cfg: BiCodecConfig) -> None:
        super().__init__()
        self.speaker_encoder = ECAPA(cfg.speaker_input_dim, cfg.speaker_out_dim)
        self.perceiver_sampler = PerceiverResampler(cfg.speaker_latent_dim, 512 * 3, cfg.token_num)
        self.quantizer = FSQ(cfg.speaker_latent_dim, cfg.fsq_levels)
        self.project = nn.Linear(cfg.speaker_latent_dim * cfg.token_num, cfg.speaker_out_dim)

    def tokenize(self, mel: torch.Tensor) -> torch.Tensor:  # [B, n_mels, T] -> [B, 32]
        feats = self.speaker_encoder.frames(mel)
        return self.quantizer.tokenize(self.perceiver_sampler(feats.transpose(1, 2)))

    def detokenize(self, ids: torch.Tensor) -> torch.Tensor:  # [B, 32] -> speaker vector [B, out]
        z = self.quantizer.detokenize(ids)  # [B, 32, latent]
        # Flattened latent-major ([B, latent, 32] -> [B, latent*32]), as the model was trained.
        return self.project(z.transpose(1, 2).reshape(z.shape[0], -1))


# ----------------------------------------------------------------------------------- the codec


def mel_filterbank(n_freqs: int, f_min: float, f_max: float, n_mels: int, sample_rate: int) -> torch.Tensor:
    """Slaney-scale, Slaney-normalised triangular filters `[n_freqs, n_mels]` (torchaudio/librosa semantics)."""

    def hz_to_mel(f: torch.Tensor) -> torch.Tensor:
        f_sp, min_log_hz = 200.0 / 3, 1000.0
        min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
        return torch.where(f >= min_log_hz, min_log_mel + torch.log(f.clamp(min=1e-10) / min_log_hz) / logstep, f / f_sp)

    def mel_to_hz(m: torch.Tensor) -> torch.Tensor:
        f_sp, min_log_hz = 200.0 / 3, 1000.0
        min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
        return torch.where(m >= min_log_mel, min_log_hz * torch.exp(logstep * (m - min_log_mel)), f_sp * m)

    cpu = dict(dtype=torch.float64, device="cpu")  # plain CPU math even under a meta/cuda default device
    all_freqs = torch.linspace(0, sample_rate // 2, n_freqs, **cpu)
    m_lo, m_hi = hz_to_mel(torch.tensor([float(f_min), float(f_max)], **cpu)).tolist()
    m_pts = torch.linspace(m_lo, m_hi, n_mels + 2, **cpu)
    f_pts = mel_to_hz(m_pts)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = f_pts[None, :] - all_freqs[:, None]
    down = -slopes[:, :-2] / f_diff[:-1]
    up = slopes[:, 2:] / f_diff[1:]
    fb = torch.clamp(torch.minimum(down, up), min=0)
    enorm = 2.0 / (f_pts[2 : n_mels + 2] - f_pts[:n_mels])
    return (fb * enorm[None, :]).float()


class BiCodec(nn.Module):
    def __init__(self, cfg: BiCodecConfig) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = FeatEncoder(cfg.encoder)
        self.quantizer = FactorizedVQ(cfg)
        self.speaker_encoder = SpeakerEncoder(cfg)
        self.prenet = FeatDecoder(cfg.prenet)
        self.decoder = WaveGenerator(cfg)
        m = cfg.mel
        fmax = m.mel_fmax if m.mel_fmax is not None else m.sample_rate / 2
        self.register_buffer("mel_fb", mel_filterbank(m.n_fft // 2 + 1, m.mel_fmin, fmax, m.num_mels, m.sample_rate), persistent=False)
        self.register_buffer("mel_window", torch.hann_window(m.win_length, device=self.mel_fb.device), persistent=False)

    # ---- decode

    def speaker_vector(self, global_ids: torch.Tensor) -> torch.Tensor:
        """[B, 32] global token ids -> [B, out_dim] conditioning vector (compute once per voice)."""
        return self.speaker_encoder.detokenize(global_ids)

    def decode(self, semantic_ids: torch.Tensor, spk: torch.Tensor) -> torch.Tensor:
        """[B, T] semantic ids + [B, C] speaker vector -> [B, T * 320] waveform."""
        z = self.quantizer.detokenize(semantic_ids)
        x = self.prenet(z, spk) + spk[:, :, None]
        window = getattr(self, "_window_valid", None)  # an end-masked window's state (streaming.decode_windows)
        return self.decoder(x, None if window is None else window[:2])[:, 0]

    @torch.no_grad()
    def detokenize(self, semantic_ids: torch.Tensor, global_ids: torch.Tensor) -> torch.Tensor:
        return self.decode(semantic_ids, self.speaker_vector(global_ids))

    def receptive_radius(self) -> int:
        """Token frames either side that one frame of output depends on; chunked decoding with at least
        this much left context and lookahead reproduces the whole-utterance decode exactly."""
        return int(math.ceil(self.prenet.radius + self.decoder.radius_frames()))

    # ---- encode (voice registration)

    def mel(self, wav: torch.Tensor) -> torch.Tensor:
        """[B, N] -> [B, n_mels, N // hop + 1] magnitude mel (power 1, no log), as the speaker encoder expects."""
        m = self.config.mel
        spec = torch.stft(wav.float(), n_fft=m.n_fft, hop_length=m.hop_length, win_length=m.win_length,
                          window=self.mel_window.float(), center=True, pad_mode="reflect", return_complex=True).abs()
        return torch.matmul(spec.transpose(1, 2), self.mel_fb).transpose(1, 2)

    @torch.no_grad()
    def global_tokens(self, ref_clip: torch.Tensor) -> torch.Tensor:
        """[B, N] reference clip (6 s) -> [B, 32] global token ids."""
        dtype = self.speaker_encoder.project.weight.dtype
        return self.speaker_encoder.tokenize(self.mel(ref_clip).to(dtype))

    @torch.no_grad()
    def semantic_tokens(self, features: torch.Tensor) -> torch.Tensor:
        """wav2vec2 mixed features [B, T, 1024] -> [B, T] semantic ids."""
        dtype = self.encoder.project.weight.dtype
        return self.quantizer.tokenize(self.encoder(features.transpose(1, 2).to(dtype)))


# ----------------------------------------------------------------------------------- checkpoint

# Present in the published checkpoint, used only in training: the postnet (predicts wav2vec2
# features) and the speaker encoder's x-vector head is kept as modules above; the postnet is not.
TRAINING_ONLY_PREFIXES = ("postnet.",)
# torchaudio's MelSpectrogram buffers, if a checkpoint carries them: we recompute them from config.
RECOMPUTED_PREFIXES = ("mel_transformer.",)


def fold_weight_norm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Merge each `X.weight_g`/`X.weight_v` pair (also the newer `X.parametrizations.weight.original0/1`)
    into `X.weight = g * v / ||v||`, the norm taken over every dim but the first, as torch's weight_norm."""
    out: dict[str, torch.Tensor] = {}
    pairs = {".weight_g": ".weight_v", ".parametrizations.weight.original0": ".parametrizations.weight.original1"}
    for key, value in state.items():
        for g_suffix, v_suffix in pairs.items():
            if key.endswith(v_suffix):
                break
            if key.endswith(g_suffix):
                prefix = key[: -len(g_suffix)]
                v = state.get(prefix + v_suffix)
                if v is None:
                    raise ValueError(f"checkpoint has {key} without {prefix + v_suffix}")
                g = value.float()
                vf = v.float()
                norm = vf.norm(dim=tuple(range(1, vf.ndim)), keepdim=True)
                out[prefix + ".weight"] = (g * vf / norm).to(v.dtype)
                break
        else:
            out[key] = value
    return out


def unfold_weight_norm(state: dict[str, torch.Tensor], weight_norm_keys: list[str]) -> dict[str, torch.Tensor]:
    """The inverse, for writing checkpoints in the published layout: `X.weight` -> `X.weight_g`, `X.weight_v`."""
    out = dict(state)
    for key in weight_norm_keys:
        w = out.pop(key)
        prefix = key[: -len(".weight")]
        out[prefix + ".weight_g"] = w.norm(dim=tuple(range(1, w.ndim)), keepdim=True)
        out[prefix + ".weight_v"] = w.clone()
    return out


def weight_normed_keys(model: BiCodec) -> list[str]:
    """Which of our `.weight`s are stored weight-normed upstream: every conv of the wave generator and
    the semantic quantizer's two projections."""
    keys = [k for k in model.state_dict() if k.startswith("decoder.model.") and k.endswith(".weight")
            and model.get_submodule(k[: -len(".weight")]).__class__ in (nn.Conv1d, nn.ConvTranspose1d)]
    return keys + ["quantizer.in_project.weight", "quantizer.out_project.weight"]


def load_bicodec(bicodec_dir: str | Path, root_config: str | Path | None, device: str | torch.device,
                 dtype: torch.dtype = torch.float32) -> BiCodec:
    """Build BiCodec from `BiCodec/config.yaml` + `BiCodec/model.safetensors`, checking every tensor."""
    from safetensors.torch import load_file

    bicodec_dir = Path(bicodec_dir)
    cfg = BiCodecConfig.from_yaml(bicodec_dir / "config.yaml", root_config)
    model = BiCodec(cfg)
    raw = load_file(bicodec_dir / "model.safetensors")
    state = fold_weight_norm(raw)
    ignored = [k for k in state if k.startswith(TRAINING_ONLY_PREFIXES + RECOMPUTED_PREFIXES)]
    for k in ignored:
        state.pop(k)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{bicodec_dir}/model.safetensors does not match BiCodec: "
                         f"missing {missing[:10]}{'...' if len(missing) > 10 else ''}, "
                         f"unexpected {unexpected[:10]}{'...' if len(unexpected) > 10 else ''}")
    bad = [k for k in expected if expected[k].shape != state[k].shape]
    if bad:
        raise ValueError(f"{bicodec_dir}: shape mismatch for {bad[:5]} (config.yaml and weights disagree)")
    model.load_state_dict(state, strict=True)
    log.info("loaded BiCodec from %s (%d tensors, %d training-only ignored)", bicodec_dir, len(raw), len(ignored))
    model.eval()
    return model.to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------- audio helpers


def volume_normalize(audio: np.ndarray, coeff: float = 0.2) -> np.ndarray:
    """Loudness normalisation applied to reference clips before tokenizing (same rule as training):
    scale so the loud end of the amplitude distribution (90th-99th percentile) sits near `coeff`."""
    audio = np.asarray(audio, dtype=np.float32)
    mags = np.sort(np.abs(audio))
    if mags.size == 0:
        return audio
    if mags[-1] < 0.1:
        audio = audio / max(mags[-1], 1e-3) * 0.1
    # percentile estimates use the original magnitudes, as the trained pipeline did
    loud = mags[mags > 0.01]
    if loud.size <= 10:
        return audio
    volume = np.mean(loud[int(0.9 * loud.size) : int(0.99 * loud.size)])
    audio = audio * np.clip(coeff / volume, 0.1, 10)
    peak = np.max(np.abs(audio))
    return audio / peak if peak > 1 else audio


def reference_clip(wav: np.ndarray, cfg: BiCodecConfig) -> np.ndarray:
    """The fixed-length clip the speaker encoder sees: the first `ref_segment_duration` seconds, the
    recording tiled when shorter, length a whole number of tokens."""
    n = int(cfg.sample_rate * cfg.ref_segment_duration) // cfg.latent_hop_length * cfg.latent_hop_length
    if len(wav) < n:
        wav = np.tile(wav, n // len(wav) + 1)
    return wav[:n]
