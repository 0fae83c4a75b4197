"""A loaded model: its config, one Runner per graph, and the host-side data the stages need."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from .base import Runner

__all__ = ["LoadedModel"]


@dataclass(frozen=True)
class LoadedModel:
    """Everything the numpy stages need, independent of the backend that runs the graphs.

    ``runners`` is keyed by graph name (``trt_cosy.runtime.graphs.GRAPHS``);
    ``llm_tables`` holds the embedding tables the host looks tokens up in
    (``text_embedding``, ``speech_embedding``, ``llm_embedding``); ``flow_noise`` is the official
    fixed CFM start noise, float32 [1, 80, 15000].
    """

    config: ModelConfig
    backend: str
    runners: dict[str, Runner]
    llm_tables: dict[str, np.ndarray]
    flow_noise: np.ndarray
