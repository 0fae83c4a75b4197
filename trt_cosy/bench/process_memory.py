"""This process's resident memory from /proc (Linux), for the benchmarks: now, the peak, and a restart of
the peak so that one phase's peak is measured apart from the ones before it."""

from __future__ import annotations

import resource
from pathlib import Path
from typing import Final

__all__ = ["peak_rss_gb", "reset_peak_rss", "rss_gb", "status_gb"]

_STATUS: Final = Path("/proc/self/status")
_CLEAR_REFS: Final = Path("/proc/self/clear_refs")


def status_gb(field: str) -> float | None:
    """``field`` (``VmRSS``, ``VmHWM``) of /proc/self/status in GB (GiB), or None where there is none."""
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024**2  # kB
    return None


def peak_rss_gb() -> float:
    """This process's peak resident set since it started or since ``reset_peak_rss``, in GB."""
    peak = status_gb("VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # ru_maxrss is in KiB on Linux


def rss_gb() -> float:
    """This process's resident set now, in GB (the peak where /proc is missing)."""
    rss = status_gb("VmRSS")
    return rss if rss is not None else peak_rss_gb()


def reset_peak_rss() -> bool:
    """Restart the peak (``VmHWM``) from the current resident set (Linux: ``5`` to /proc/self/clear_refs);
    False where that is not possible (the peak then stays the process's)."""
    if status_gb("VmHWM") is None:
        return False
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    return True
