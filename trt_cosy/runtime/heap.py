"""Return freed memory to the operating system (glibc ``mallopt``), for long-running servers.

glibc serves allocations under a *dynamic* mmap threshold (it rises to 32 MiB after large blocks
are freed) from heaps that it rarely returns to the OS, one heap per thread that allocated. A
server whose render threads allocate and free tens of MiB per chunk (ONNX Runtime arena regions,
numpy temporaries) so keeps its high-water mark for good. A fixed threshold makes every block of
``threshold`` bytes or more its own mapping, unmapped when freed: RSS follows the work in flight
(docs/benchmarks.md, "Memory under load"). The same as ``MALLOC_MMAP_THRESHOLD_=131072``.

Smaller blocks still fragment the per-thread heaps: after eight long requests are cancelled
mid-render, hundreds of MiB sit free inside them. ``trim`` (glibc ``malloc_trim(0)``) gives those
pages back; once ``return_large_blocks`` is on, every request calls it when it ends.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import Final

__all__ = ["return_large_blocks", "trim", "trim_now", "DEFAULT_MMAP_THRESHOLD"]

_LOGGER = logging.getLogger(__name__)

DEFAULT_MMAP_THRESHOLD: Final = 128 * 1024  # glibc's initial value, kept fixed
_M_MMAP_THRESHOLD: Final = -3  # from <malloc.h>
_TRIM: list = []  # [libc] once return_large_blocks succeeded: trim() is on


def return_large_blocks(threshold: int = DEFAULT_MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at ``threshold`` bytes for this process; False where not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(_M_MMAP_THRESHOLD, int(threshold)))
    _LOGGER.debug("glibc mmap threshold fixed at %d bytes: %s", threshold, ok)
    if ok and not _TRIM and hasattr(libc, "malloc_trim"):
        libc.malloc_trim.argtypes = (ctypes.c_size_t,)
        _TRIM.append(libc)
    return ok


def trim() -> bool:
    """Return the free pages of glibc's heaps to the OS (``malloc_trim(0)``, a few ms); a no-op
    (False) unless ``return_large_blocks`` turned it on for this process."""
    if not _TRIM:
        return False
    return bool(_TRIM[0].malloc_trim(0))


def trim_now() -> bool:
    """``malloc_trim(0)`` once, whether or not ``return_large_blocks`` is on: a benchmark between its
    phases, so that the next phase's peak starts from the memory in use, not from freed pages that
    glibc kept. False where there is no glibc ``malloc_trim``."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return False
    malloc_trim.argtypes = (ctypes.c_size_t,)
    return bool(malloc_trim(0))
