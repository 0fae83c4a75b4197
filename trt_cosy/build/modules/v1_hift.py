"""CosyVoice 1 HiFT (22.05 kHz, upsample [8, 8]): the shared generator with the v1 ``SineGen`` source.

``HiFTGenerator`` (``hift.py``) builds every v1 layer from ``HiFTConfig`` alone (source downs
[8, 1], two source resblocks, 256 samples per frame); only its excitation differs. The official
``SourceModuleHnNSF`` picks ``SineGen`` when the sample rate is 22050 (spec §5.2): the phase is a
cumulative sum over *samples* (not frames) of ``f0 · k / sr``, taken mod 1, plus a uniform random
phase per overtone (the fundamental's is 0). ``SineGenSource`` reproduces it with the randomness
as inputs, and ``HiFTGraphV1`` wires it into the generator's f0 predictor and ``decode``.

Export note: torch's CPU ``cumsum`` accumulates float32 in float64, and at 256·F samples the
float32 rounding of a float32 running sum would move the phase by ~1e-3 rad; the cumsum is
therefore done in float64 (exact for these magnitudes) and rounded once, as the official code is.
ONNX Runtime runs this as is; TensorRT has no float64, so a TRT build must keep this source step
on ONNX Runtime or the host (or emulate the exact sum with two float32 parts).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from torch import Tensor, nn

from ...config import HiFTConfig
from ..checkpoint import fold_weight_norm, load_strict, read_state_dict
from .hift import HiFTGenerator

__all__ = ["SineGenSource", "HiFTGraphV1", "load_hift_v1"]

_LOGGER = logging.getLogger(__name__)
_HIFT_FILE = "hift.pt"


class SineGenSource(nn.Module):
    """``SourceModuleHnNSF`` + ``SineGen`` (v1): f0 at sample rate -> excitation. Key ``l_linear``."""

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

    def phases(self, rand_phase: Tensor) -> Tensor:
        """``Uniform(-π, π)`` from its uniform draw u [B, H] (float32 ``low + u · (high - low)``), fundamental 0."""
        low = torch.tensor(-math.pi, dtype=torch.float32)
        high = torch.tensor(math.pi, dtype=torch.float32)
        phase = low + rand_phase * (high - low)  # phase: [B, H]
        keep = (torch.arange(phase.shape[1]) > 0).to(phase.dtype)  # [H]: 0 for the fundamental
        return phase * keep  # [B, H]

    def forward(self, f0_up: Tensor, rand_phase: Tensor, sine_noise: Tensor) -> Tensor:
        """f0_up [B, S] (Hz, sample rate), rand_phase [B, H], sine_noise [B, S, H] -> source [B, 1, S]."""
        rad = f0_up.unsqueeze(-1) * self.harmonic_numbers / self.sampling_rate  # rad: [B, S, H]
        cumulative = torch.cumsum(rad.to(torch.float64), dim=1).to(torch.float32)  # [B, S, H]
        theta = (2 * math.pi) * (cumulative - torch.floor(cumulative))  # (x mod 1) for x >= 0: exact
        sines = self.sine_amp * torch.sin(theta + self.phases(rand_phase).unsqueeze(1))  # [B, S, H]
        voiced = (f0_up > self.voiced_threshold).to(torch.float32).unsqueeze(-1)  # voiced: [B, S, 1]
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3  # [B, S, 1]
        sines = sines * voiced + noise_amp * sine_noise  # [B, S, H]
        return torch.tanh(self.l_linear(sines)).transpose(1, 2)  # [B, 1, S]


class HiFTGraphV1(nn.Module):
    """Contract ``V1_HIFT``: (mel, sine_noise, rand_phase, cache_source) -> (wav, source, f0)."""

    def __init__(self, hift: HiFTGenerator):
        super().__init__()
        self.hift = hift

    def forward(
        self, mel: Tensor, sine_noise: Tensor, rand_phase: Tensor, cache_source: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        hift = self.hift
        f0 = hift.f0_predictor(mel)  # f0: [B, F]
        batch = f0.shape[0]
        frames_up = hift.config.samples_per_frame
        f0_up = f0.unsqueeze(-1).expand(-1, -1, frames_up).reshape(batch, -1)  # nearest ×256: [B, S]
        generated = hift.m_source(f0_up, rand_phase, sine_noise)  # [B, 1, S]
        cached = cache_source.shape[-1]
        tail = generated.narrow(-1, cached, generated.shape[-1] - cached)  # [B, 1, S - C]
        source = torch.cat([cache_source, tail], dim=-1)  # [B, 1, S]
        return hift.decode(mel, source), source, f0


def build_hift_v1(config: HiFTConfig) -> HiFTGenerator:
    """The shared generator with its source swapped for the v1 ``SineGen`` one."""
    hift = HiFTGenerator(config)
    hift.m_source = SineGenSource(
        sampling_rate=config.sampling_rate,
        harmonics=config.nb_harmonics,
        sine_amp=config.nsf_alpha,
        noise_std=config.nsf_sigma,
        voiced_threshold=config.nsf_voiced_threshold,
    )
    return hift


def load_hift_v1(model_dir: Path, config: HiFTConfig) -> HiFTGenerator:
    """Build the v1 generator and load ``<model_dir>/hift.pt`` (weight norm folded, strict)."""
    path = Path(model_dir) / _HIFT_FILE
    hift = build_hift_v1(config)
    load_strict(hift, fold_weight_norm(read_state_dict(path)), str(path))
    _LOGGER.debug("v1 HiFT loaded from %s (%d Hz)", path, config.sampling_rate)
    return hift.eval()
