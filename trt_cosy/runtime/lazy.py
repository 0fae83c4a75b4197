"""``LazyRunner``: a runner whose backend object (session, compiled model) is created on first use.

The bookkeeping shared by ``ort.LazyOrtRunner`` and ``openvino.LazyOvRunner``: the runner is created
once (thread-safe, double-checked: no lock once it exists) by the first ``infer``, ``input_names``,
``output_names``, ``input_specs`` or ``kv_decoder``, or by ``load()``, which a server can call in the
background after start-up. Subclasses say how to create it (``_create``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import numpy as np

__all__ = ["LazyRunner"]

_LOGGER = logging.getLogger(__name__)

RunnerT = TypeVar("RunnerT")


class LazyRunner(Generic[RunnerT]):
    """The lazily created runner of graph ``name``; subclasses implement ``_create``."""

    def __init__(self, name: str):
        self.name = name
        self._runner: RunnerT | None = None
        self._lock = threading.Lock()

    def _create(self) -> RunnerT:
        raise NotImplementedError

    @property
    def loaded(self) -> bool:
        """Whether the underlying runner exists yet."""
        return self._runner is not None

    def load(self) -> RunnerT:
        """The underlying runner, created if this is the first use."""
        runner = self._runner
        if runner is not None:  # the hot path: no lock once the runner exists
            return runner
        with self._lock:
            if self._runner is None:
                _LOGGER.debug("creating the deferred graph '%s'", self.name)
                self._runner = self._create()
            return self._runner

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.load().input_names  # type: ignore[attr-defined]

    @property
    def output_names(self) -> tuple[str, ...]:
        return self.load().output_names  # type: ignore[attr-defined]

    def input_specs(self) -> dict[str, tuple[tuple[int | str | None, ...], np.dtype | None]]:
        return self.load().input_specs()  # type: ignore[attr-defined]

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.load().infer(feed)  # type: ignore[attr-defined]

    def kv_decoder(self, cache_shape: tuple[int, ...]) -> Any:
        """The underlying runner's ``kv_decoder`` (the LLM graph may be deferred)."""
        return self.load().kv_decoder(cache_shape)  # type: ignore[attr-defined]
