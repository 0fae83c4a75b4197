"""The Runner interface every backend implements (torch reference, ONNX Runtime, TensorRT).

Stage code (``trt_cosy.stages``) only ever talks to runners through ``infer``; it never
imports a backend. Output-buffer contract: arrays returned by ``infer`` belong to the caller
and stay valid after the next call (a backend that reuses buffers must copy before returning).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from ..errors import InputError

__all__ = ["Runner", "cast_input", "check_feed"]


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


def cast_input(graph: str, key: str, value: np.ndarray, dtype: np.dtype | None, writeable: bool = False) -> np.ndarray:
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
        raise InputError(f"graph '{graph}' needs inputs {names}; missing {missing}. Feed every input by name.")
