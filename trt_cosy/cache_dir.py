"""Where trt-cosy keeps per-user files: ``$TRT_COSY_CACHE``, else ``~/.cache/trt-cosy``.

A leaf module (it imports nothing from trt-cosy), so the runtime, the downloader and the server can
all name the cache without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

__all__ = ["CACHE_ENV", "cache_root"]

CACHE_ENV: Final = "TRT_COSY_CACHE"


def cache_root() -> Path:
    """``$TRT_COSY_CACHE`` when set, else ``~/.cache/trt-cosy``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "trt-cosy"
