"""The Runner interface every backend implements (torch reference, ONNX Runtime, TensorRT).

Stage code (``trt_cosy.stages``) only ever talks to runners through ``infer``; it never
imports a backend. Output-buffer contract: arrays returned by ``infer`` belong to the caller
and stay valid after the next call (a backend that reuses buffers must copy before returning).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["Runner"]


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
