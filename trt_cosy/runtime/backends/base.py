"""The Runner interface every backend implements (torch reference, ONNX Runtime, OpenVINO,
TensorRT), and what the backends' runners share: feed checks and casts, the lazily created runner.

Stage code (``trt_cosy.stages``) only ever talks to runners through ``infer``; it never
imports a backend. Output-buffer contract: arrays returned by ``infer`` belong to the caller
and stay valid after the next call (a backend that reuses buffers must copy before returning).

``LazyRunner``: a runner whose backend object (session, compiled model, plan) is created on first
use. The runner is created once (thread-safe, double-checked: no lock once it exists) by the first
``infer``, ``input_names``, ``output_names``, ``input_specs`` or ``kv_decoder``, or by ``load()``,
which a server can call in the background after start-up. Subclasses say how to create it
(``_create``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from ...errors import InputError

__all__ = ["Runner", "LazyRunner", "cast_input", "check_feed"]

_LOGGER = logging.getLogger(__name__)

RunnerT = TypeVar("RunnerT")


@runtime_checkable
class Runner(Protocol):
    """One graph (one stage) loaded on one backend."""

    name: str

    @property
    def input_names(self) -> tuple[str, ...]: ...

    @property
    def output_names(self) -> tuple[str, ...]: ...

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run the graph on ``feed`` (all inputs by name) and return every output by name."""
        ...


def cast_input(
    graph: str, key: str, value: np.ndarray, dtype: np.dtype | None, writeable: bool = False
) -> np.ndarray:
    """``value`` as a C-contiguous array of the graph input's ``dtype`` (None: as it is), for any backend.

    ``same_kind`` casting allows int64 -> int32 and float64 -> float32 and refuses float -> int, which
    raises ``InputError`` naming the graph and input. ``writeable``: a read-only array (a memory-mapped
    table) is copied, for backends that share only writable memory (OpenVINO)."""
    array = np.asarray(value)
    if dtype is None or array.dtype == dtype:
        if writeable and not array.flags.writeable:
            return np.array(array, order="C")
        return np.ascontiguousarray(array)
    try:
        return np.ascontiguousarray(array.astype(dtype, casting="same_kind"))
    except TypeError as exc:
        raise InputError(
            f"graph '{graph}' input '{key}' is {dtype}; got {array.dtype}, which does not "
            f"convert safely. Pass {dtype} values."
        ) from exc


def check_feed(graph: str, inputs: Iterable[str], feed: Mapping[str, np.ndarray]) -> None:
    """Refuse a feed that lacks one of the graph's ``inputs`` (``InputError`` naming them all)."""
    names = list(inputs)
    missing = [key for key in names if key not in feed]
    if missing:
        raise InputError(
            f"graph '{graph}' needs inputs {names}; missing {missing}. Feed every input by name."
        )


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
