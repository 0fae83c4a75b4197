"""CosyVoice 1 HiFT (22.05 kHz, upsample [8, 8]): the shared generator with the v1 ``SineGen`` source.

``HiFTGenerator`` (``hift.py``) builds every v1 layer from ``HiFTConfig`` alone (source downs
[8, 1], two source resblocks, 256 samples per frame); only its excitation differs. The official
``SourceModuleHnNSF`` picks ``SineGen`` when the sample rate is 22050 (spec §5.2): the phase is a
cumulative sum over *samples* (not frames) of ``f0 · k / sr``, taken mod 1, plus a uniform random
phase per overtone (the fundamental's is 0). ``SineGenSource`` reproduces it with the randomness
as inputs, and ``HiFTGraphV1`` wires it into the generator's f0 predictor and ``decode``.

Phase in float32 (TensorRT has no float64): torch's CPU ``cumsum`` accumulates float32 in
float64, so the official phase is ``frac(fl32(X))`` with X the exact running sum of the per-sample
steps; a float32 running sum over 256·F samples would be off by ~1e-3 cycles. f0 is constant over
each frame's 256 samples (nearest upsampling), so ``SineGenSource.cycles`` rebuilds X from exact
pieces instead: per frame, the whole cycles and two 11-bit fixed-point limbs of the fractional
cycles are summed over frames (integers below 2^24: exact in float32, in any summation order), and
the in-frame part ``(j + 1) · step`` is split so that its products are exact too. The integer and
fractional parts of X are added once, which rounds exactly as the official float32 cast does, and
the result is taken mod 1. Valid up to ``MAX_EXACT_FRAMES`` frames (95 s); beyond, the limb sums
lose their lowest bits and the phase drifts by ~1e-4 cycles, no more.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Final

import torch
from torch import Tensor, nn

from ....builder.checkpoint import fold_weight_norm, load_checkpoint
from ....builder.modules.hift import HiFTGenerator
from ....builder.modules.hift_source import HnNSFSource, source_options
from ....config import HiFTConfig

__all__ = ["MAX_EXACT_FRAMES", "SineGenSource", "HiFTGraphV1", "build_hift_v1", "load_hift_v1"]

_LOGGER = logging.getLogger(__name__)
_HIFT_FILE = "hift.pt"


_LIMB: Final = 2.0**11  # fixed-point limb of the per-frame fractional cycles (two limbs: 2^-22 cycles)
_SPLIT: Final = 2.0**15  # in-frame step split: (j + 1) · high part is exact for j + 1 <= 256
MAX_EXACT_FRAMES: Final = int(2**24 // (_LIMB + 1))  # limb sums stay below 2^24 (8188 frames)


class SineGenSource(HnNSFSource):
    """``SourceModuleHnNSF`` + ``SineGen`` (v1): frame f0 -> excitation at sample rate. Key ``l_linear``."""

    def __init__(
        self,
        sampling_rate: int,
        harmonics: int,
        sine_amp: float,
        noise_std: float,
        voiced_threshold: float,
        samples_per_frame: int,
    ):
        if samples_per_frame <= 0 or samples_per_frame & (samples_per_frame - 1) or samples_per_frame > 256:
            raise ValueError(f"samples_per_frame must be a power of two <= 256, got {samples_per_frame}")
        super().__init__(sampling_rate, harmonics, sine_amp, noise_std, voiced_threshold)
        self.hop = samples_per_frame
        self.register_buffer(
            "sample_counts", torch.arange(1, samples_per_frame + 1, dtype=torch.float32), persistent=False
        )

    def phases(self, rand_phase: Tensor) -> Tensor:
        """``Uniform(-π, π)`` from its uniform draw u [B, H] (float32 ``low + u · (high - low)``), fundamental 0."""
        low = torch.tensor(-math.pi, dtype=torch.float32)
        high = torch.tensor(math.pi, dtype=torch.float32)
        phase = low + rand_phase * (high - low)  # phase: [B, H]
        keep = (torch.arange(phase.shape[1]) > 0).to(phase.dtype)  # [H]: 0 for the fundamental
        return phase * keep  # [B, H]

    def cycles(self, f0: Tensor) -> Tensor:
        """f0 [B, F] (Hz, frame rate) -> ``frac(fl32(cumsum(step over samples)))`` [B, F, hop, H], float32 only.

        step = f0 · k / sr is the official per-sample value (the same float32 ops on the same f0).
        """
        step = f0.unsqueeze(-1) * self.harmonic_numbers / self.sampling_rate  # step: [B, F, H]
        start_int, start_frac = self._frame_starts(step * self.hop)  # exact ×2^8; each [B, F, H]
        high = torch.floor(step * _SPLIT) / _SPLIT  # <= 16 significant bits: [B, F, H]
        counts = self.sample_counts.view(1, 1, -1, 1)  # [1, 1, hop, 1]
        inner = counts * high.unsqueeze(2)  # exact: [B, F, hop, H]
        inner_int = torch.floor(inner)  # [B, F, hop, H]
        inner_frac = (inner - inner_int) + counts * (step - high).unsqueeze(2)  # [B, F, hop, H]
        whole = start_int.unsqueeze(2) + inner_int  # exact integer cycles: [B, F, hop, H]
        total = whole + (start_frac.unsqueeze(2) + inner_frac)  # one rounding, as fl32(X): [B, F, hop, H]
        return total - torch.floor(total)  # [B, F, hop, H]

    @staticmethod
    def _frame_starts(per_frame: Tensor) -> tuple[Tensor, Tensor]:
        """Cycles before each frame, exactly: (integer part, fraction) of the exclusive sum over frames."""
        whole = torch.floor(per_frame)  # [B, F, H]
        scaled = (per_frame - whole) * _LIMB  # exact: [B, F, H]
        limb1 = torch.floor(scaled)  # units of 2^-11 cycles
        scaled = (scaled - limb1) * _LIMB
        limb2 = torch.floor(scaled)  # units of 2^-22 cycles
        rest = scaled - limb2  # [0, 1) units of 2^-22 cycles

        def before(x: Tensor) -> Tensor:
            return torch.cumsum(x, dim=1) - x  # exclusive prefix sum over frames: [B, F, H]

        sum2 = before(limb2)
        carry2 = torch.floor(sum2 / _LIMB)
        sum1 = before(limb1) + carry2
        carry1 = torch.floor(sum1 / _LIMB)
        fraction = ((sum1 - carry1 * _LIMB) + ((sum2 - carry2 * _LIMB) + before(rest)) / _LIMB) / _LIMB
        return before(whole) + carry1, fraction  # [B, F, H] each

    def forward(self, f0: Tensor, rand_phase: Tensor, sine_noise: Tensor) -> Tensor:
        """f0 [B, F] (Hz), rand_phase [B, H], sine_noise [B, hop·F, H] -> source [B, 1, hop·F]."""
        batch = f0.shape[0]
        theta = (2 * math.pi) * self.cycles(f0).flatten(1, 2)  # theta: [B, S, H]
        sines = self.sine_amp * torch.sin(theta + self.phases(rand_phase).unsqueeze(1))  # [B, S, H]
        f0_up = f0.unsqueeze(-1).expand(-1, -1, self.hop).reshape(batch, -1)  # nearest ×hop: [B, S]
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
        generated = hift.m_source(f0, rand_phase, sine_noise)  # [B, 1, S]
        cached = cache_source.shape[-1]
        tail = generated.narrow(-1, cached, generated.shape[-1] - cached)  # [B, 1, S - C]
        source = torch.cat([cache_source, tail], dim=-1)  # [B, 1, S]
        return hift.decode(mel, source), source, f0


def build_hift_v1(config: HiFTConfig) -> HiFTGenerator:
    """The shared generator with its source swapped for the v1 ``SineGen`` one."""
    hift = HiFTGenerator(config)
    hift.m_source = SineGenSource(**source_options(config))
    return hift


def load_hift_v1(model_dir: Path, config: HiFTConfig) -> HiFTGenerator:
    """Build the v1 generator and load ``<model_dir>/hift.pt`` (weight norm folded, strict)."""
    path = Path(model_dir) / _HIFT_FILE
    hift = load_checkpoint(build_hift_v1(config), path, fold_weight_norm)
    _LOGGER.debug("v1 HiFT loaded from %s (%d Hz)", path, config.sampling_rate)
    return hift
