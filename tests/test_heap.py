"""glibc heap settings for servers: freed blocks go back to the OS (trt_cosy.runtime.heap)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from trt_cosy.runtime import heap

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and /proc are Linux only")


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_trim_returns_the_free_holes_of_a_threads_heap():
    if not heap.return_large_blocks():
        pytest.skip("not glibc: no mallopt/malloc_trim")
    kept: list[np.ndarray] = []

    def fragment() -> None:  # 2000 x 100 KiB blocks (under the mmap threshold) between small live ones
        large = []
        for _ in range(2000):
            large.append(np.ones(100 * 1024 // 8))  # written: its pages are resident
            kept.append(np.ones(16))
        large.clear()  # ~195 MiB free in holes the heap cannot shrink past

    worker = threading.Thread(target=fragment)
    worker.start()
    worker.join()
    before = _rss_mib()
    assert heap.trim() in (True, False)
    after = _rss_mib()
    assert before - after > 100, f"RSS {before:.0f} -> {after:.0f} MiB"
    assert len(kept) == 2000


def test_trim_now_returns_free_pages_without_the_server_setting():
    kept: list[np.ndarray] = []

    def fragment() -> None:  # the test above's holes, in a fresh thread's heap
        large = []
        for _ in range(2000):
            large.append(np.ones(100 * 1024 // 8))
            kept.append(np.ones(16))
        large.clear()

    worker = threading.Thread(target=fragment)
    worker.start()
    worker.join()
    before = _rss_mib()
    if not heap.trim_now():
        pytest.skip("not glibc: no malloc_trim")
    after = _rss_mib()
    assert before - after > 100, f"RSS {before:.0f} -> {after:.0f} MiB"
