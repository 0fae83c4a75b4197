"""One exception hierarchy for trt-cosy. Every message says what to do next."""

from __future__ import annotations

__all__ = [
    "TrtCosyError",
    "ModelDirError",
    "EngineMismatchError",
    "MissingDependencyError",
    "InputError",
    "BuildError",
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


def require(module: str, extra: str):
    """Import an optional dependency or raise naming the extra that provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependencyError(
            f"{module!r} is not installed ({exc}). Install it with: pip install 'trt-cosy[{extra}]'"
        ) from exc
