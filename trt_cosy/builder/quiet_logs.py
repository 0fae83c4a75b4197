"""Quiet ONNX Runtime's quantisers, which log one line per node, unless trt-cosy logs at DEBUG."""

from __future__ import annotations

import logging

__all__ = ["quiet_logger"]

_LOGGER = logging.getLogger("trt_cosy.builder")


class quiet_logger:
    """Hold the logger ``name`` (``"root"``: the root logger) at ERROR inside the block, unless
    trt-cosy's build logs at DEBUG."""

    def __init__(self, name: str):
        self._logger = logging.getLogger(name if name != "root" else None)
        self._level = self._logger.level

    def __enter__(self) -> None:
        if not _LOGGER.isEnabledFor(logging.DEBUG):
            self._logger.setLevel(max(self._level, logging.ERROR))

    def __exit__(self, *exc: object) -> None:
        self._logger.setLevel(self._level)
