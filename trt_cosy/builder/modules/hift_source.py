"""HiFT's neural-source-filter excitation and its STFT / iSTFT, as export-friendly torch ops.

The source reproduces the official CosyVoice2 ``SourceModuleHnNSF`` with ``SineGen2`` (used for every
sample rate except 22050), including its float32 rounding where that is cheap to follow, so that the
long cumulative phase stays within the golden tolerances. The Gaussian noise is an input
(``sine_noise``); nothing here draws random numbers. The STFT and iSTFT are fixed DFT bases applied by
``conv1d`` / ``conv_transpose1d`` (no ``torch.stft`` / ``torch.istft``, which do not export).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...config import HiFTConfig

__all__ = ["HnNSFSource", "SourceModule", "source_options", "ConvSTFT", "ConvISTFT", "upsample_linear", "periodic_hann"]


def periodic_hann(n_fft: int) -> np.ndarray:
    """``scipy.signal.get_window("hann", n_fft, fftbins=True)`` (the official ``stft_window``)."""
    n = np.arange(n_fft, dtype=np.float64)
    return 0.5 - 0.5 * np.cos(2.0 * np.pi * n / n_fft)


def upsample_linear(x: torch.Tensor, scale: int) -> torch.Tensor:
    """``F.interpolate(x, scale_factor=scale, mode="linear", align_corners=False)`` written out.

    The source coordinate of output sample i is ``(i + 0.5) * float32(1 / scale) - 0.5`` clamped at 0,
    as torch computes it; the index and weight math are spelled out so the exported graph uses only
    Gather and element-wise ops (ONNX Resize differs between backends in its coordinate rounding).
    """
    frames = x.shape[-1]
    ratio = float(np.float32(1.0 / scale))
    positions = torch.arange(frames * scale, device=x.device, dtype=torch.float32)  # positions: [S]
    src = torch.clamp((positions + 0.5) * ratio - 0.5, min=0.0)  # src: [S]
    last = (frames - 1) * torch.ones_like(src)  # last: [S]
    index0 = torch.minimum(torch.floor(src), last)  # index0: [S]
    index1 = torch.minimum(index0 + 1.0, last)  # index1: [S]
    weight1 = torch.clamp(src - index0, 0.0, 1.0)  # weight1: [S]
    weight0 = 1.0 - weight1  # weight0: [S]
    x0 = torch.index_select(x, -1, index0.long())  # x0: [B, C, S]
    x1 = torch.index_select(x, -1, index1.long())  # x1: [B, C, S]
    return weight0 * x0 + weight1 * x1  # [B, C, S]


def source_options(config: HiFTConfig) -> dict[str, Any]:
    """The NSF source's constructor arguments from a HiFT config (the same for every family's source)."""
    return dict(
        sampling_rate=config.sampling_rate,
        samples_per_frame=config.samples_per_frame,
        harmonics=config.nb_harmonics,
        sine_amp=config.nsf_alpha,
        noise_std=config.nsf_sigma,
        voiced_threshold=config.nsf_voiced_threshold,
    )


class HnNSFSource(nn.Module):
    """What ``SourceModuleHnNSF`` holds with either sine generator (v1 ``SineGen``, v2 ``SineGen2``):
    the NSF settings, the harmonic numbers 1..H+1 and the harmonic merge ``l_linear`` (its only weights)."""

    def __init__(
        self, sampling_rate: int, harmonics: int, sine_amp: float, noise_std: float, voiced_threshold: float
    ):
        super().__init__()
        self.sampling_rate = sampling_rate
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.register_buffer(
            "harmonic_numbers", torch.arange(1, harmonics + 2, dtype=torch.float32), persistent=False
        )
        self.l_linear = nn.Linear(harmonics + 1, 1)


class SourceModule(HnNSFSource):
    """``SourceModuleHnNSF`` + ``SineGen2``: f0 (frame rate) -> excitation (sample rate).

    State-dict keys: ``l_linear.{weight, bias}`` (the module is ``m_source`` in the generator).
    """

    def __init__(
        self,
        sampling_rate: int,
        samples_per_frame: int,
        harmonics: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
    ):
        super().__init__(sampling_rate, harmonics, sine_amp, noise_std, voiced_threshold)
        self.samples_per_frame = samples_per_frame

    def frame_phase(self, f0: torch.Tensor) -> torch.Tensor:
        """Cumulative phase of every harmonic at frame rate, ``phase`` of the official ``_f02sine``.

        Official: ``rad = (f0_up * k / sr) mod 1`` at sample rate, a random initial phase added at
        sample 0, then ``interpolate(rad, scale_factor=1/480, linear)``. With align_corners=False the
        down-sampled value j reads samples ``480 j + 239`` and ``480 j + 240`` with weights 0.5 / 0.5.
        Both lie in frame j of the nearest-upsampled f0, so the result is exactly that frame's rad
        (0.5 a + 0.5 a == a in float32), and sample 0 (the only one holding the random initial phase)
        is never read: the random phase provably has no effect, so it is not an input. We therefore
        compute rad per frame, which is bit-identical and 480x cheaper.
        """
        harmonic_f0 = f0.unsqueeze(-1) * self.harmonic_numbers  # harmonic_f0: [B, F, H]
        rad = harmonic_f0 / self.sampling_rate  # rad: [B, F, H]
        rad = rad - torch.floor(rad)  # (x mod 1) for x >= 0, exact in float32
        # torch's CPU cumsum accumulates float32 in double; the official phase inherits that.
        return torch.cumsum(rad, dim=1) * 2 * math.pi  # [B, F, H]

    def sines(self, f0: torch.Tensor) -> torch.Tensor:
        """Harmonic sines at sample rate, before uv gating: ``sine_amp * sin(phase)``."""
        phase = self.frame_phase(f0).transpose(1, 2) * self.samples_per_frame  # phase: [B, H, F]
        phase = upsample_linear(phase, self.samples_per_frame)  # phase: [B, H, S]
        return torch.sin(phase.transpose(1, 2)) * self.sine_amp  # [B, S, H]

    def forward(self, f0: torch.Tensor, sine_noise: torch.Tensor) -> torch.Tensor:
        """f0 [B, F] (Hz), sine_noise [B, S, H] (standard normal) -> source [B, 1, S]."""
        batch = f0.shape[0]
        f0_up = f0.unsqueeze(-1).expand(-1, -1, self.samples_per_frame).reshape(batch, -1, 1)  # [B, S, 1]
        voiced = (f0_up > self.voiced_threshold).to(torch.float32)  # voiced: [B, S, 1]
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3  # noise_amp: [B, S, 1]
        sines = self.sines(f0) * voiced + noise_amp * sine_noise  # sines: [B, S, H]
        return torch.tanh(self.l_linear(sines)).transpose(1, 2)  # [B, 1, S]


def _dft_angle(n_fft: int) -> np.ndarray:
    """``2 pi k n / n_fft`` for each one-sided bin k and sample n: [K, N], K = n_fft/2 + 1."""
    bins = n_fft // 2 + 1
    return 2.0 * np.pi * np.outer(np.arange(bins), np.arange(n_fft)) / n_fft  # angle: [K, N]


class ConvSTFT(nn.Module):
    """``torch.stft(n_fft, hop, window=periodic hann, center=True, reflect)`` -> [real; imag] channels."""

    def __init__(self, n_fft: int, hop: int):
        super().__init__()
        self.n_fft = n_fft
        self.hop = hop
        angle = _dft_angle(n_fft)  # angle: [K, N]
        window = periodic_hann(n_fft)
        basis = np.concatenate([np.cos(angle) * window, -np.sin(angle) * window])  # basis: [2K, N]
        self.register_buffer(
            "basis", torch.from_numpy(basis[:, None, :].astype(np.float32)), persistent=False
        )

    def forward(self, signal: torch.Tensor) -> torch.Tensor:
        """signal [B, 1, S] -> spectrum [B, 2K, S / hop + 1] (K = n_fft/2 + 1; real bins, then imaginary)."""
        half = self.n_fft // 2
        padded = F.pad(signal, (half, half), mode="reflect")  # padded: [B, 1, S + n_fft]
        return F.conv1d(padded, self.basis, stride=self.hop)  # [B, 2K, S / hop + 1]


class ConvISTFT(nn.Module):
    """``torch.istft(n_fft, hop, window=periodic hann, center=True)`` of a one-sided spectrum.

    Inverse real DFT of each frame times the window, overlap-added by ``conv_transpose1d``, divided
    by the overlap-added squared window, then ``n_fft/2`` samples trimmed from each side. The
    imaginary parts of the DC and Nyquist bins are ignored, as a complex-to-real inverse FFT does.
    """

    def __init__(self, n_fft: int, hop: int):
        super().__init__()
        self.n_fft = n_fft
        self.hop = hop
        angle = _dft_angle(n_fft)  # angle: [K, N]
        bins = angle.shape[0]
        weight = np.full((bins, 1), 2.0)  # weight: [K, 1], Hermitian pairs counted twice
        weight[0] = 1.0
        weight[-1] = 1.0 if n_fft % 2 == 0 else 2.0
        window = periodic_hann(n_fft)
        real = weight * np.cos(angle) / n_fft * window  # real: [K, N]
        imag = -weight * np.sin(angle) / n_fft * window  # imag: [K, N]
        basis = np.concatenate([real, imag])[:, None, :]  # basis: [2K, 1, N]
        self.register_buffer("basis", torch.from_numpy(basis.astype(np.float32)), persistent=False)
        envelope = (window**2)[None, None, :]  # envelope: [1, 1, N]
        self.register_buffer("window_sq", torch.from_numpy(envelope.astype(np.float32)), persistent=False)

    def forward(self, real: torch.Tensor, imag: torch.Tensor) -> torch.Tensor:
        """real, imag [B, K, T] -> signal [B, hop * (T - 1)]."""
        spectrum = torch.cat([real, imag], dim=1)  # spectrum: [B, 2K, T]
        frames = F.conv_transpose1d(spectrum, self.basis, stride=self.hop)  # frames: [B, 1, hop(T-1)+N]
        ones = torch.ones_like(real[:, :1, :])  # ones: [B, 1, T]
        envelope = F.conv_transpose1d(ones, self.window_sq, stride=self.hop)  # envelope: [B, 1, hop(T-1)+N]
        half = self.n_fft // 2
        length = frames.shape[-1] - 2 * half
        signal = frames.narrow(-1, half, length) / envelope.narrow(-1, half, length)  # [B, 1, hop(T-1)]
        return signal.squeeze(1)  # [B, hop(T-1)]
