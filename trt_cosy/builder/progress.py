"""Build progress: each step's line goes to the module's logger and, when given, to the caller's callback
(``trt-cosy build`` prints it on stderr)."""

from __future__ import annotations

import logging
from collections.abc import Callable

__all__ = ["Progress", "emitter"]

Progress = Callable[[str], None]


def emitter(logger: logging.Logger, progress: Progress | None) -> Progress:
    """``emit(message)``: log ``message`` at INFO on ``logger`` and hand it to ``progress`` (if any)."""

    def emit(message: str) -> None:
        logger.info("%s", message)
        if progress is not None:
            progress(message)

    return emit
