"""A Runner wrapper that records what verify needs to see inside the stages."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ..runtime.backends.base import NamesFrom, Runner

__all__ = ["RecordingRunner"]


class RecordingRunner(NamesFrom):
    """Wraps a runner; keeps its last feed and outputs, and the last-position logits of every call.

    ``last_logits`` are the rows of ``llm_greedy_logits`` when wrapped around an LLM runner.
    """

    def __init__(self, inner: Runner):
        self.inner = inner
        self._names = inner  # input_names / output_names (NamesFrom)
        self.name = inner.name
        self.feed: dict[str, np.ndarray] = {}
        self.outputs: dict[str, np.ndarray] = {}
        self.last_logits: list[np.ndarray] = []

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.feed = dict(feed)
        self.outputs = self.inner.infer(feed)
        if "logits" in self.outputs:
            self.last_logits.append(self.outputs["logits"][0, -1].copy())  # [V]
        return self.outputs
