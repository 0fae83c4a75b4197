"""Process-wide TensorRT objects: the guarded import, one logger and one ``trt.Runtime``.

TensorRT uses the logger given to the first Builder/Runtime of a process for its global messages
and requires every logger to outlive all objects created through it (``NvInferRuntime.h``,
``class ILogger``: "The logger must be valid until all objects created are released"). A logger
per runner could therefore be released while TensorRT still points at it, so this module creates
one logger per ``tensorrt`` module and keeps it for the life of the process, and one
``trt.Runtime`` that deserializes every plan (Polygraphy's ``get_trt_logger()`` does the same).

The logger's Python callback runs under the GIL for every message TensorRT emits (thousands of
VERBOSE lines during a build), so it drops messages below this module logger's level first,
before any formatting.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Final

from ....errors import MissingDependencyError, require
from .cuda import gpu_unavailable_reason

__all__ = ["load_tensorrt", "trt_logger", "shared_runtime", "VERBOSE"]

_LOGGER = logging.getLogger("trt_cosy.runtime.backends.tensorrt")  # TensorRT's own messages, under the backend's name

VERBOSE: Final = 5  # logging level of TensorRT's VERBOSE messages: below DEBUG, off unless asked for
_LOCK = threading.Lock()
_LOGGERS: dict[int, Any] = {}  # id(tensorrt module) -> its one ILogger (never released)
_RUNTIMES: dict[int, Any] = {}  # id(tensorrt module) -> its one trt.Runtime (never released)


def load_tensorrt() -> Any:
    """Import tensorrt after checking a GPU is usable; else ``MissingDependencyError`` with the reason."""
    reason = gpu_unavailable_reason()
    if reason is not None:
        raise MissingDependencyError(
            f"TensorRT cannot run here: {reason}. TensorRT plans need an NVIDIA GPU with tensorrt and "
            "cuda-python (pip install 'trt-cosy[gpu]', or 'trt-cosy[gpu-cu12]' on a CUDA 12 driver); "
            "use the onnxruntime backend elsewhere."
        )
    return require("tensorrt", "gpu")


def trt_logger(trt: Any) -> Any:
    """The process's one ``trt.ILogger``, forwarding TensorRT's messages to Python logging."""
    with _LOCK:
        return _logger_locked(trt)


def shared_runtime(trt: Any) -> Any:
    """The process's one ``trt.Runtime`` (created with ``trt_logger``); it outlives every engine."""
    with _LOCK:
        if id(trt) not in _RUNTIMES:
            _RUNTIMES[id(trt)] = trt.Runtime(_logger_locked(trt))
        return _RUNTIMES[id(trt)]


def _logger_locked(trt: Any) -> Any:
    if id(trt) not in _LOGGERS:
        _LOGGERS[id(trt)] = _make_logger(trt)
    return _LOGGERS[id(trt)]


def _make_logger(trt: Any) -> Any:
    severity = trt.ILogger.Severity
    levels = {
        severity.INTERNAL_ERROR: logging.CRITICAL,
        severity.ERROR: logging.ERROR,
        severity.WARNING: logging.WARNING,
        severity.INFO: logging.DEBUG,
        severity.VERBOSE: VERBOSE,
    }

    class _Bridge(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity: Any, msg: str) -> None:
            level = levels.get(severity, VERBOSE)
            if _LOGGER.isEnabledFor(level):  # cached by logging: the common "dropped" case costs one lookup
                _LOGGER.log(level, "TensorRT: %s", msg)

    return _Bridge()
