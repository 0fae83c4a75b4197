"""CosyVoice3 vocoder (official ``CausalHiFTGenerator`` + ``CausalConvRNNF0Predictor``), export-friendly.

Same sizes as the CosyVoice2 HiFT (docs/cosyvoice-spec §5.5), but every conv is causal:

* ``conv_pre`` looks 4 frames to the right (kernel 5, zeros on the right when finalizing);
* the f0 predictor's first conv looks 3 frames right (kernel 4); the other four are left-causal;
* ``ups`` = nearest ×u, then a left-causal conv (kernel k); ``source_downs`` = strided left-causal
  convs (kernel 2u, stride u, u-1 zeros on the left); resblocks and ``conv_post`` are left-causal.

SineGen2 runs in causal mode: the frame phase is upsampled with *nearest* (not linear)
interpolation and the additive noise is the fixed uniform buffer ``sine_waves`` (an input here).
With ``finalize=False`` (streaming) the last 3 mel frames only feed the f0 look-ahead, the 4 before
them only ``conv_pre``'s look-ahead, and the last 480 output samples are dropped, as the official
``inference(finalize=False)`` does. The flag is fixed per instance (one exported graph per value).

The official code runs the f0 predictor in float64; ``CausalHiFTGraph(f0_float64=True)`` does the
same for the reference, the default float32 is what ONNX Runtime / TensorRT can run.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ....builder.checkpoint import fold_weight_norm, load_checkpoint
from ....builder.modules.hift import ResBlock, _source_down_rates
from ....builder.modules.hift_source import ConvISTFT, ConvSTFT, SourceModule, source_options
from ..config import CausalHiFTConfig

__all__ = ["CausalConv1d", "CausalHiFTGenerator", "CausalHiFTGraph", "load_causal_hift"]

_LOGGER = logging.getLogger(__name__)
_POST_SLOPE = 0.01  # F.leaky_relu default before conv_post, as in the official decode
_MAX_MAGNITUDE = 100.0


class CausalConv1d(nn.Conv1d):
    """Official ``CausalConv1d``: stride 1, zeros on one side so the length is preserved.

    ``forward(x, pad=False)`` is the official call with a context cache: the caller passes the
    context frames as the tail of ``x`` and gets ``len(x) - padding`` frames back.
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, dilation: int = 1, right: bool = False
    ):
        super().__init__(in_channels, out_channels, kernel_size, dilation=dilation)
        self.padding_size = int((kernel_size * dilation - dilation) / 2) * 2 + (kernel_size + 1) % 2
        self.right = right

    def forward(self, x: torch.Tensor, pad: bool = True) -> torch.Tensor:
        if pad:
            x = F.pad(x, (0, self.padding_size) if self.right else (self.padding_size, 0))  # [B, C, T + p]
        return super().forward(x)  # [B, C', T]


class _CausalUpsample(nn.Conv1d):
    """``CausalConv1dUpsample``: nearest ×stride, ``kernel - 1`` zeros on the left, conv."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int):
        super().__init__(in_channels, out_channels, kernel_size)
        self.stride_up = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.unsqueeze(-1).expand(-1, -1, -1, self.stride_up).flatten(2)  # x: [B, C, T·u] (nearest)
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))  # [B, C', T·u]


class _CausalDownsample(nn.Conv1d):
    """``CausalConv1dDownSample``: ``stride - 1`` zeros on the left, conv (kernel 2·stride, stride)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (self.stride[0] - 1, 0)))  # [B, C', ceil(T / stride)]


class CausalResBlock(ResBlock):
    """The CosyVoice2 ``ResBlock`` with left-causal convs (same keys, same forward)."""

    def __init__(self, channels: int, kernel_size: int, dilations: tuple[int, ...]):
        super().__init__(channels, kernel_size, dilations)
        self.convs1 = nn.ModuleList(
            CausalConv1d(channels, channels, kernel_size, dilation=d) for d in dilations
        )
        self.convs2 = nn.ModuleList(CausalConv1d(channels, channels, kernel_size) for _ in dilations)


class CausalF0Predictor(nn.Module):
    """``CausalConvRNNF0Predictor``: conv k4 (right look-ahead 3) + 4 × conv k3 (left), ELU, Linear, |.|."""

    def __init__(self, in_channels: int, cond_channels: int, layers: int = 5):
        super().__init__()
        blocks: list[nn.Module] = [CausalConv1d(in_channels, cond_channels, 4, right=True), nn.ELU()]
        for _ in range(layers - 1):
            blocks += [CausalConv1d(cond_channels, cond_channels, 3), nn.ELU()]
        self.condnet = nn.Sequential(*blocks)
        self.classifier = nn.Linear(cond_channels, 1)

    @property
    def look_right(self) -> int:
        return self.condnet[0].padding_size

    def forward(self, mel: torch.Tensor, finalize: bool) -> torch.Tensor:
        """mel [B, 80, F] -> f0 [B, F] (finalize) or [B, F - 3] (the last 3 frames are look-ahead)."""
        hidden = self.condnet[0](mel, pad=finalize)  # hidden: [B, C, F']
        for layer in self.condnet[1:]:
            hidden = layer(hidden)
        return torch.abs(self.classifier(hidden.transpose(1, 2)).squeeze(-1))  # [B, F']


class CausalSourceModule(SourceModule):
    """``SourceModuleHnNSF`` with ``SineGen2(causal=True)``: the frame phase is held per frame."""

    def sines(self, f0: torch.Tensor) -> torch.Tensor:
        phase = self.frame_phase(f0) * self.samples_per_frame  # phase: [B, F, H]
        phase = (
            phase.unsqueeze(2).expand(-1, -1, self.samples_per_frame, -1).flatten(1, 2)
        )  # [B, S, H] (nearest)
        return torch.sin(phase) * self.sine_amp  # [B, S, H]


class CausalHiFTGenerator(nn.Module):
    """``CausalHiFTGenerator`` with folded weight norm; the NSF noise buffer is an input."""

    def __init__(self, config: CausalHiFTConfig):
        super().__init__()
        self.config = config
        base = config.base_channels
        n_fft = config.istft_n_fft
        self.m_source = CausalSourceModule(**source_options(config))
        self.f0_predictor = CausalF0Predictor(config.f0_in_channels, config.f0_cond_channels)
        self.conv_pre = CausalConv1d(config.in_channels, base, config.conv_pre_look_right + 1, right=True)
        rates, kernels = config.upsample_rates, config.upsample_kernel_sizes
        self.ups = nn.ModuleList(
            _CausalUpsample(base // 2**i, base // 2 ** (i + 1), k, u)
            for i, (u, k) in enumerate(zip(rates, kernels, strict=True))
        )
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        sources = zip(
            _source_down_rates(rates),
            config.source_resblock_kernel_sizes,
            config.source_resblock_dilation_sizes,
            strict=True,
        )
        for i, (rate, k, dilations) in enumerate(sources):
            channels = base // 2 ** (i + 1)
            if rate == 1:
                self.source_downs.append(CausalConv1d(n_fft + 2, channels, 1))
            else:
                self.source_downs.append(_CausalDownsample(n_fft + 2, channels, rate * 2, rate))
            self.source_resblocks.append(CausalResBlock(channels, k, dilations))
        self.resblocks = nn.ModuleList(
            CausalResBlock(base // 2 ** (i + 1), k, dilations)
            for i in range(len(self.ups))
            for k, dilations in zip(config.resblock_kernel_sizes, config.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = CausalConv1d(base // 2 ** len(self.ups), n_fft + 2, 7)
        self.stft = ConvSTFT(n_fft, config.istft_hop_len)
        self.istft = ConvISTFT(n_fft, config.istft_hop_len)

    def _upsample_stack(self, x: torch.Tensor, source_spec: torch.Tensor) -> torch.Tensor:
        kernels = len(self.config.resblock_kernel_sizes)
        for i, up in enumerate(self.ups):
            x = up(F.leaky_relu(x, self.config.lrelu_slope))  # x: [B, C_i, F' · prod(rates[:i+1])]
            if i == len(self.ups) - 1:
                x = F.pad(x, (1, 0), mode="reflect")  # x: [B, C_last, 120F' + 1]
            x = x + self.source_resblocks[i](self.source_downs[i](source_spec))
            total = self.resblocks[i * kernels](x)
            for j in range(1, kernels):
                total = total + self.resblocks[i * kernels + j](x)
            x = total / kernels
        return x

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool) -> torch.Tensor:
        """mel [B, 80, M] + source [B, 1, 480M] -> wav [B, 480M] (finalize) or [B, 480(M - 5)]."""
        source_spec = self.stft(source)  # source_spec: [B, n_fft + 2, 120M + 1]
        x = self.conv_pre(mel, pad=finalize)  # x: [B, C0, M'] (M' = M - 4 when not finalizing)
        if not finalize:
            frames = source_spec.shape[-1] - self.stft_frames_per_mel * self.config.conv_pre_look_right
            source_spec = source_spec.narrow(-1, 0, frames)  # [B, n_fft + 2, 120M' + 1]
        x = self.conv_post(
            F.leaky_relu(self._upsample_stack(x, source_spec), _POST_SLOPE)
        )  # [B, n_fft+2, 120M'+1]
        bins = self.config.istft_n_fft // 2 + 1
        magnitude = torch.clamp(torch.exp(x[:, :bins]), max=_MAX_MAGNITUDE)  # magnitude: [B, K, 120M' + 1]
        phase = torch.sin(x[:, bins:])  # phase: [B, K, 120M' + 1] (the official "redundant" sin)
        wav = self.istft(magnitude * torch.cos(phase), magnitude * torch.sin(phase))  # wav: [B, 480M']
        if not finalize:
            wav = wav.narrow(-1, 0, wav.shape[-1] - self.config.samples_per_frame)  # [B, 480(M' - 1)]
        return torch.clamp(wav, -self.config.audio_limit, self.config.audio_limit)

    @property
    def stft_frames_per_mel(self) -> int:
        """Source STFT frames per mel frame (prod(upsample_rates) = 120)."""
        return self.config.samples_per_frame // self.config.istft_hop_len

    def forward(
        self, mel: torch.Tensor, sine_noise: torch.Tensor, finalize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """mel [B, 80, F], sine_noise [B, >= 480F, 9] -> (wav, source, f0); see ``models.v3.graphs`` for lengths."""
        predictor_dtype = self.f0_predictor.classifier.weight.dtype
        f0 = self.f0_predictor(mel.to(predictor_dtype), finalize).to(mel.dtype)  # f0: [B, F']
        samples = f0.shape[1] * self.config.samples_per_frame
        source = self.m_source(f0, sine_noise.narrow(1, 0, samples))  # source: [B, 1, 480F']
        body = mel if finalize else mel.narrow(2, 0, f0.shape[1])  # body: [B, 80, F']
        return self.decode(body, source, finalize), source, f0


class CausalHiFTGraph(nn.Module):
    """Contracts ``HIFT_V3`` (finalize) / ``HIFT_V3_STREAM``: (mel, sine_noise) -> (wav, source, f0).

    ``f0_float64=True`` runs the f0 predictor on a float64 copy, as the official inference does
    (reference only: ONNX Runtime's and TensorRT's convs are float32).
    """

    def __init__(self, hift: CausalHiFTGenerator, finalize: bool, f0_float64: bool = False):
        super().__init__()
        self.hift = hift
        self.finalize = finalize
        if f0_float64:
            predictor = CausalF0Predictor(hift.config.f0_in_channels, hift.config.f0_cond_channels)
            predictor.load_state_dict(hift.f0_predictor.state_dict())
            self.hift = _with_f0_predictor(hift, predictor.double().eval())

    def forward(
        self, mel: torch.Tensor, sine_noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.hift(mel, sine_noise, finalize=self.finalize)


def _with_f0_predictor(hift: CausalHiFTGenerator, predictor: CausalF0Predictor) -> CausalHiFTGenerator:
    """A shallow copy of ``hift`` that shares every weight except the f0 predictor."""
    clone = CausalHiFTGenerator.__new__(CausalHiFTGenerator)
    nn.Module.__init__(clone)
    clone.config = hift.config
    for name, child in hift.named_children():
        setattr(clone, name, predictor if name == "f0_predictor" else child)
    return clone.eval()


def load_causal_hift(model_dir: Path, config: CausalHiFTConfig) -> CausalHiFTGenerator:
    """Build the generator from ``config`` and load ``<model_dir>/hift.pt`` (weight norm folded)."""
    path = Path(model_dir) / "hift.pt"
    hift = load_checkpoint(CausalHiFTGenerator(config), path, fold_weight_norm)
    _LOGGER.debug("CausalHiFT loaded from %s (base channels %d)", path, config.base_channels)
    return hift
