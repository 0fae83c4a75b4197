"""A loaded model: its config, one Runner per graph, and the host-side data the stages need."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends.base import Runner

__all__ = ["LoadedModel"]


@dataclass(frozen=True)
class LoadedModel:
    """Everything the numpy stages need, independent of the backend that runs the graphs.

    ``config.family`` says which graphs ``runners`` holds (``trt_cosy.runtime.graphs.GRAPHS`` for v2,
    ``graphs_v1.V1_GRAPHS``, ``graphs_v3.GRAPHS_V3``), keyed by graph name; ``llm_tables`` holds the
    embedding tables the host looks tokens up in (``text_embedding``, ``speech_embedding``,
    ``llm_embedding``); ``flow_noise`` is the official fixed CFM start noise, float32 [1, 80, 15000]
    (v1 draws fresh noise per call: empty [1, 80, 0]); ``hift_noise`` is the CosyVoice3 causal HiFT's
    fixed NSF noise buffer, float32 [1, S, 9] uniform [0, 1) (None for v1 and v2).
    """

    config: Any  # the family's config class (``Family.config_class``): ModelConfig, V1ModelConfig, V3ModelConfig
    backend: str
    runners: dict[str, Runner]
    llm_tables: dict[str, np.ndarray]
    flow_noise: np.ndarray
    hift_noise: np.ndarray | None = None
