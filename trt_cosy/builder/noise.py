"""The fixed CFM start noise of the official CosyVoice2 flow, reproduced with torch's own RNG.

``CausalConditionalCFM.__init__`` seeds everything with 0 and draws ``randn(1, 80, 15000)``
(docs/cosyvoice-spec §4.3); every call then uses the prefix ``noise[:, :, :T]``. Regenerating it
without torch would mean re-implementing torch's CPU normal fill, so the build ships it as data.
"""

from __future__ import annotations

import logging
from typing import Final

import numpy as np
import torch

__all__ = ["official_flow_noise", "NOISE_FRAMES", "NOISE_SEED"]

_LOGGER = logging.getLogger(__name__)

NOISE_FRAMES: Final = 15000  # 50 frames/s × 300 s, as drawn by the official class
NOISE_SEED: Final = 0
_MEL_BINS: Final = 80


def official_flow_noise(frames: int = NOISE_FRAMES) -> np.ndarray:
    """The official ``rand_noise[:, :, :frames]`` as float32 [1, 80, frames].

    The full [1, 80, 15000] tensor is always drawn (the values of a shorter draw would differ),
    with the global torch RNG seeded to 0; the previous RNG state is restored afterwards.
    """
    if not 0 < frames <= NOISE_FRAMES:
        raise ValueError(f"frames must be in 1..{NOISE_FRAMES} (the official noise length), got {frames}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(NOISE_SEED)
        noise = torch.randn(1, _MEL_BINS, NOISE_FRAMES)  # [1, 80, 15000]
    return noise[:, :, :frames].numpy().copy()  # [1, 80, frames]
