"""The random draws of the golden sets made by running the official code end to end (tools/golden).

The official CosyVoice 1 flow and CosyVoice 1/2 HiFT draw from torch's global RNG. The golden-making
scripts (``tools/golden/official_runs.py``) replace every ``torch.rand`` / ``torch.randn_like`` call of
the official run by draw number ``i`` of ``numpy.random.default_rng([seed, i])`` and store only the log
``[chunk, "rand" | "randn", shape]``; ``OfficialDraws`` regenerates the values for trt-cosy's stages.
Imports numpy only (the official environment loads this file by path).
"""

from __future__ import annotations

import numpy as np

__all__ = ["draw_values", "OfficialDraws"]


def draw_values(seed: int, index: int, kind: str, shape) -> np.ndarray:
    """Draw ``index`` of a draw log as the official run got it: uniform [0, 1) or standard normal, float32."""
    rng = np.random.default_rng([seed, index])
    if kind == "rand":
        return rng.random(tuple(shape), dtype=np.float32)
    return rng.standard_normal(tuple(shape), dtype=np.float32)


class OfficialDraws:
    """One official run's draws chunk by chunk: the ``V1Draws`` interface of CosyVoice 1 (flow noise,
    SineGen phase and noise) and the CosyVoice2 vocoder noise (``sine_noise``)."""

    def __init__(self, seed: int, log: list):
        self.seed, self.chunk = seed, -1
        self.by_chunk: dict[int, list] = {}
        for index, (chunk, kind, shape) in enumerate(log):
            self.by_chunk.setdefault(chunk, []).append((index, kind, shape))

    def _take(self, kind: str, fits) -> np.ndarray:
        for index, drawn_kind, shape in self.by_chunk.get(self.chunk, []):
            if drawn_kind == kind and fits(shape):
                return draw_values(self.seed, index, kind, shape)
        raise ValueError(f"chunk {self.chunk}: the official run made no such {kind} draw")

    def flow_noise(self, frames: int) -> np.ndarray:
        """v1 CFM start noise [1, 80, frames]: the first draw of each chunk."""
        self.chunk += 1
        return self._take("randn", lambda shape: len(shape) == 3 and shape[1] == 80 and shape[2] == frames)

    def hift_phase(self) -> np.ndarray:
        """v1 SineGen phases: the uniform draw of ``Uniform(-pi, pi).sample((1, 9, 1))``, as [1, 9]."""
        return self._take("rand", lambda shape: True)[:, :, 0]

    def hift_noise(self, samples: int) -> np.ndarray:
        """v1 SineGen ``randn_like(sines)`` [1, 9, S], as [1, S, 9]."""
        return self._take("randn", lambda shape: len(shape) == 3 and shape[1] == 9).transpose(0, 2, 1)

    def sine_noise(self, chunk: int) -> np.ndarray:
        """v2 SineGen2 ``randn_like(sines)`` [1, S, 9] of official token2wav call ``chunk``."""
        self.chunk = chunk
        return self._take("randn", lambda shape: len(shape) == 3 and shape[-1] == 9)
