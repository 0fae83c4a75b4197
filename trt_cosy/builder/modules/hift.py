"""CosyVoice2 HiFT vocoder (``HiFTGenerator`` + ``ConvRNNF0Predictor``) as a torch reference module.

Built from ``HiFTConfig``; weight norm is folded at load, so every conv is a plain conv whose
state-dict keys are the official ones minus the parametrization suffixes. ``HiFTGraph`` wraps the
generator with the ``HIFT`` graph contract (``trt_cosy.runtime.graphs``): the NSF noise and the
streaming source cache are inputs, so the graph is deterministic and exports to ONNX.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ...config import HiFTConfig
from ..checkpoint import fold_weight_norm, load_checkpoint
from .hift_source import ConvISTFT, ConvSTFT, SourceModule, source_options

__all__ = ["HiFTGenerator", "HiFTGraph", "load_hift"]

_LOGGER = logging.getLogger(__name__)
_POST_SLOPE = 0.01  # official decode() uses F.leaky_relu's default slope before conv_post
_MAX_MAGNITUDE = 100.0


class Snake(nn.Module):
    """``x + sin^2(alpha x) / (alpha + 1e-9)``, per-channel alpha (``alpha_logscale=False``)."""

    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha.unsqueeze(0).unsqueeze(-1)  # alpha: [1, C, 1]
        sine = torch.sin(x * alpha)  # sine: [B, C, T]
        return x + (1.0 / (alpha + 1e-9)) * (sine * sine)  # [B, C, T]; torch's pow(s, 2) is s * s


class ResBlock(nn.Module):
    """HiFi-GAN residual block with Snake activations: x += conv2(snake(conv1_d(snake(x))))."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__()
        self.convs1 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, dilation=d, padding=(kernel_size * d - d) // 2)
            for d in dilations
        )
        self.convs2 = nn.ModuleList(
            nn.Conv1d(channels, channels, kernel_size, padding=(kernel_size - 1) // 2) for _ in dilations
        )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv1, conv2, act1, act2 in zip(
            self.convs1, self.convs2, self.activations1, self.activations2, strict=True
        ):
            x = conv2(act2(conv1(act1(x)))) + x  # x: [B, C, T]
        return x


class F0Predictor(nn.Module):
    """``ConvRNNF0Predictor``: 5 x (conv k3 + ELU), Linear -> |f0| in Hz (no RNN despite the name)."""

    def __init__(self, in_channels: int, cond_channels: int, layers: int = 5):
        super().__init__()
        blocks: list[nn.Module] = []
        for index in range(layers):
            blocks.append(
                nn.Conv1d(in_channels if index == 0 else cond_channels, cond_channels, 3, padding=1)
            )
            blocks.append(nn.ELU())
        self.condnet = nn.Sequential(*blocks)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        hidden = self.condnet(mel).transpose(1, 2)  # hidden: [B, F, C]
        return torch.abs(self.classifier(hidden).squeeze(-1))  # [B, F]


class HiFTGenerator(nn.Module):
    """``HiFTGenerator`` (v2, non-causal) with folded weight norm and injected source noise."""

    def __init__(self, config: HiFTConfig):
        super().__init__()
        self.config = config
        base = config.base_channels
        n_fft, hop = config.istft_n_fft, config.istft_hop_len
        self.m_source = SourceModule(**source_options(config))
        self.f0_predictor = F0Predictor(config.f0_in_channels, config.f0_cond_channels)
        self.conv_pre = nn.Conv1d(config.in_channels, base, 7, padding=3)
        self.ups = nn.ModuleList(
            nn.ConvTranspose1d(base // 2**i, base // 2 ** (i + 1), k, u, padding=(k - u) // 2)
            for i, (u, k) in enumerate(zip(config.upsample_rates, config.upsample_kernel_sizes, strict=True))
        )
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        for i, (rate, k, dilations) in enumerate(
            zip(
                _source_down_rates(config.upsample_rates),
                config.source_resblock_kernel_sizes,
                config.source_resblock_dilation_sizes,
                strict=True,
            )
        ):
            channels = base // 2 ** (i + 1)
            if rate == 1:
                self.source_downs.append(nn.Conv1d(n_fft + 2, channels, 1))
            else:
                self.source_downs.append(nn.Conv1d(n_fft + 2, channels, rate * 2, rate, padding=rate // 2))
            self.source_resblocks.append(ResBlock(channels, k, dilations))
        self.resblocks = nn.ModuleList(
            ResBlock(base // 2 ** (i + 1), k, dilations)
            for i in range(len(self.ups))
            for k, dilations in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = nn.Conv1d(base // 2 ** len(self.ups), n_fft + 2, 7, padding=3)
        self.stft = ConvSTFT(n_fft, hop)
        self.istft = ConvISTFT(n_fft, hop)

    def source(self, f0: torch.Tensor, sine_noise: torch.Tensor, cache_source: torch.Tensor) -> torch.Tensor:
        """NSF excitation with its first S samples replaced by ``cache_source`` [B, 1, S]."""
        generated = self.m_source(f0, sine_noise)  # generated: [B, 1, 480F]
        cached = cache_source.shape[-1]
        tail = generated.narrow(-1, cached, generated.shape[-1] - cached)  # tail: [B, 1, 480F - S]
        return torch.cat([cache_source, tail], dim=-1)  # [B, 1, 480F]

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """mel [B, 80, F] + source [B, 1, 480F] -> waveform [B, 480F] (official ``decode``)."""
        source_spec = self.stft(source)  # source_spec: [B, n_fft + 2, 120F + 1]
        x = self.conv_pre(mel)  # x: [B, C0, F]
        kernels = len(self.config.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.config.lrelu_slope))  # x: [B, C_i, F * prod(rates[:i+1])]
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # x: [B, C_last, 120F + 1]
            x = x + self.source_resblocks[i](self.source_downs[i](source_spec))
            total = self.resblocks[i * kernels](x)
            for j in range(1, kernels):
                total = total + self.resblocks[i * kernels + j](x)
            x = total / kernels
        x = self.conv_post(F.leaky_relu(x, _POST_SLOPE))  # x: [B, n_fft + 2, 120F + 1]
        bins = self.config.istft_n_fft // 2 + 1
        magnitude = torch.clamp(torch.exp(x[:, :bins]), max=_MAX_MAGNITUDE)  # magnitude: [B, K, 120F + 1]
        phase = torch.sin(x[:, bins:])  # phase: [B, K, 120F + 1] (the official "redundant" sin)
        wav = self.istft(magnitude * torch.cos(phase), magnitude * torch.sin(phase))  # wav: [B, 480F]
        return torch.clamp(wav, -self.config.audio_limit, self.config.audio_limit)

    def forward(
        self, mel: torch.Tensor, sine_noise: torch.Tensor, cache_source: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        f0 = self.f0_predictor(mel)  # f0: [B, F]
        source = self.source(f0, sine_noise, cache_source)  # source: [B, 1, 480F]
        return self.decode(mel, source), source, f0


class HiFTGraph(nn.Module):
    """The ``HIFT`` graph: (mel, sine_noise, cache_source) -> (wav, source, f0)."""

    def __init__(self, hift: HiFTGenerator):
        super().__init__()
        self.hift = hift

    def forward(
        self, mel: torch.Tensor, sine_noise: torch.Tensor, cache_source: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hift(mel, sine_noise, cache_source)


def _source_down_rates(upsample_rates: tuple[int, ...]) -> list[int]:
    """Stride of each ``source_downs`` conv: the upsampling still to come after stage i."""
    rates = []
    for i in range(len(upsample_rates)):
        remaining = 1
        for rate in upsample_rates[i + 1 :]:
            remaining *= rate
        rates.append(remaining)
    return rates  # v2 [8, 5, 3] -> [15, 3, 1]


def load_hift(model_dir: Path, config: HiFTConfig) -> HiFTGenerator:
    """Build the generator from ``config`` and load ``<model_dir>/hift.pt`` (weight norm folded)."""
    path = Path(model_dir) / "hift.pt"
    hift = load_checkpoint(HiFTGenerator(config), path, fold_weight_norm)
    _LOGGER.debug("HiFT loaded from %s (base channels %d)", path, config.base_channels)
    return hift
