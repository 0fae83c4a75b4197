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
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import numpy as np

from ...errors import EngineMismatchError, InputError

__all__ = [
    "Runner",
    "GraphRunner",
    "KVDecoder",
    "LazyRunner",
    "NamesFrom",
    "InputSpecs",
    "cast_input",
    "check_feed",
    "engine_file",
]

InputSpecs = dict[str, tuple[tuple[int | str | None, ...], np.dtype | None]]
"""Each input's declared shape (a str or None marks a dynamic axis) and numpy dtype (None: fed as given)."""

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


def engine_file(path: str | Path, what: str, graph: str, backend: str) -> Path:
    """``path`` when it is a file, else ``EngineMismatchError`` naming ``what`` it should be (``"OpenVINO
    model"``) and the build that writes it (``trt-cosy build --backend <backend>``)."""
    path = Path(path)
    if not path.is_file():
        raise EngineMismatchError(
            f"{what} {path} for graph '{graph}' does not exist. Rebuild it with "
            f"`trt-cosy build --backend {backend}`."
        )
    return path


def check_feed(graph: str, inputs: Iterable[str], feed: Mapping[str, np.ndarray]) -> None:
    """Refuse a feed that lacks one of the graph's ``inputs`` (``InputError`` naming them all)."""
    names = list(inputs)
    missing = [key for key in names if key not in feed]
    if missing:
        raise InputError(
            f"graph '{graph}' needs inputs {names}; missing {missing}. Feed every input by name."
        )


class NamesFrom:
    """``input_names`` / ``output_names`` of a runner that takes them from another object, ``_names``
    (anything with both: a graph spec, a TensorRT plan's I/O, the runner it wraps or defers)."""

    _names: Any

    @property
    def input_names(self) -> tuple[str, ...]:
        return self._names.input_names

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._names.output_names


class LazyRunner(NamesFrom, Generic[RunnerT]):
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
    def _names(self) -> Any:
        return self.load()

    def input_specs(self) -> dict[str, tuple[tuple[int | str | None, ...], np.dtype | None]]:
        return self.load().input_specs()  # type: ignore[attr-defined]

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.load().infer(feed)  # type: ignore[attr-defined]

    def kv_decoder(self, cache_shape: tuple[int, ...]) -> Any:
        """The underlying runner's ``kv_decoder`` (the LLM graph may be deferred)."""
        return self.load().kv_decoder(cache_shape)  # type: ignore[attr-defined]


class GraphRunner:
    """What the CPU backends' runners share (``OrtRunner``, ``OvRunner``): the graph's name, its declared
    inputs (``_specs``, in the model's order) and outputs, and the feed check and cast of ``infer``.

    ``_writeable``: inputs are handed over as writable arrays (a read-only one is copied), for backends
    that share only writable memory (OpenVINO)."""

    name: str
    _specs: InputSpecs
    _outputs: tuple[str, ...]
    _writeable: bool = False

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(self._specs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return self._outputs

    def input_specs(self) -> InputSpecs:
        """Each input's declared shape (a str or None marks a dynamic axis) and numpy dtype."""
        return dict(self._specs)

    def _feed(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Every input of ``feed`` checked and cast to its declared dtype (``cast_input``)."""
        check_feed(self.name, self._specs, feed)
        return {
            key: cast_input(self.name, key, feed[key], dtype, self._writeable)
            for key, (_, dtype) in self._specs.items()
        }


class KVDecoder(ABC):
    """One request's step-by-step decode through a graph of the ``LLM`` contract, the KV cache kept in
    the backend's own memory between steps (each step's present bound as the next step's past), so it
    never round-trips through numpy; only the logits come back. One decoder holds one request's cache:
    create one per request (the runner is shared). ``cached``: the positions in the cache."""

    def __init__(self) -> None:
        self.cached = 0

    def step(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """Feed ``inputs_embeds`` [1, T, D] after the cached positions; return the logits [1, T, V]."""
        inputs = np.array(inputs_embeds, dtype=np.float32, order="C")  # [1, T, D], a writable copy
        logits = self._step(inputs)  # [1, T, V]
        self.cached += inputs.shape[1]
        return logits

    @abstractmethod
    def _step(self, inputs: np.ndarray) -> np.ndarray:
        """Run ``inputs`` [1, T, D] on the cache and keep the new one; the logits [1, T, V] as numpy."""
