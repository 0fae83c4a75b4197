"""One exception hierarchy for trt-cosy. Every message says what to do next."""

from __future__ import annotations

__all__ = [
    "TrtCosyError",
    "ModelDirError",
    "EngineMismatchError",
    "MissingDependencyError",
    "InputError",
    "BuildError",
    "NativeCrashError",
]


class TrtCosyError(Exception):
    """Base class of every error trt-cosy raises on purpose."""


class ModelDirError(TrtCosyError):
    """A release directory is missing a file, or a file is malformed."""


class EngineMismatchError(TrtCosyError):
    """Built engines are missing, stale or were built for another checkpoint or system."""


class MissingDependencyError(TrtCosyError):
    """An optional dependency is not installed; the message names the extra to install."""


class InputError(TrtCosyError):
    """Bad user input: text, audio, voice or option values."""


class BuildError(TrtCosyError):
    """A build step failed its own self-check (a trt-cosy bug, not a user error)."""


class NativeCrashError(EngineMismatchError):
    """A native library (OpenVINO's CPU plugin, ...) crashed compiling a graph in a child process
    (``runtime.native_guard``); the message names the graph, backend, precision, signal and machine,
    and which ``--backend`` / ``--precision`` to use instead."""


def require(module: str, extra: str):
    """Import an optional dependency or raise naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{module!r} is not installed ({exc}). Install it with: pip install 'trt-cosy[{extra}]'"
        ) from exc
