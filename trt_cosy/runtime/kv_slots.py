"""Preallocated KV cache slots in host memory for batched decoding through the ``LLM_BATCH`` graph
(``graphs.LLM_BATCH``; see ``stages.llm_batch`` for the scheduler that drives it).

``KVSlots`` holds one key and one value buffer per layer, [slots, H, capacity, Dh] float32,
reserved once (anonymous memory: the pages are committed as rows fill). The active rows of a batch
are always the first ``count`` slots, so a step passes the views ``buffer[:count]`` (contiguous, no
copy); when a row leaves, the last active row moves into its place (one copy of that row's
cached positions) and the row freed at the end gives its pages back to the OS (``madvise``), so the
slots hold only what the active rows use: after a burst of long requests RSS returns.

The ONNX Runtime runs of the ``LLM_BATCH`` graph over them are ``backends.onnxruntime.batch.OrtBatchLLM``;
the TensorRT decode over device slots is ``backends.tensorrt.batch``.
"""

from __future__ import annotations

import logging
import mmap
from typing import Final

import numpy as np

from ..errors import InputError

__all__ = ["KVSlots", "PrefillCache", "ROW_GROUP"]

_LOGGER = logging.getLogger(__name__)
ROW_GROUP: Final = 4  # fixed-shape steps run a multiple of this many rows (kernels block rows in 1, 2 or 4)


class PrefillCache:
    """One request's cache after its batch-1 prefill: per layer keys/values [1, H, T, Dh]."""

    def __init__(self, layers: int, kv_heads: int, length: int, head_dim: int):
        shape = (1, kv_heads, length, head_dim)
        self.keys = [np.zeros(shape, np.float32) for _ in range(layers)]  # each [1, H, T, Dh]
        self.values = [np.zeros(shape, np.float32) for _ in range(layers)]
        self.length = length


class KVSlots:
    """``slots`` rows of ``capacity`` cached positions each, for ``layers`` layers (not thread-safe:
    one owner, the decode scheduler, changes it). The buffers hold ``rows`` rows (``slots`` rounded up
    to ``ROW_GROUP``); the rows past ``slots`` are never filled (fixed-shape steps run them empty)."""

    def __init__(self, slots: int, layers: int, kv_heads: int, capacity: int, head_dim: int):
        if slots < 1 or capacity < 1:
            raise InputError(f"KV slots need slots >= 1 and capacity >= 1, got {slots} and {capacity}.")
        self.slots, self.capacity = slots, capacity
        self.rows = -(-slots // ROW_GROUP) * ROW_GROUP  # rows of the buffers (>= slots; a fixed-shape step's batch)
        shape = (self.rows, kv_heads, capacity, head_dim)
        self._maps: list[mmap.mmap] = []  # the anonymous mappings under the buffers (when madvise exists)
        self.keys = [self._zeros(shape) for _ in range(layers)]  # each [R, H, C, Dh], R = rows
        self.values = [self._zeros(shape) for _ in range(layers)]
        self.lengths = np.zeros(slots, np.int32)  # cached positions per row (0: inactive)
        self.count = 0  # active rows: 0 .. count-1

    def _zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        """A zeroed float32 buffer whose pages can be given back (an anonymous mapping), or np.zeros
        where ``madvise`` is missing."""
        nbytes = int(np.prod(shape)) * 4
        if not hasattr(mmap, "MADV_DONTNEED"):
            return np.zeros(shape, np.float32)
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # MADV_DONTNEED frees it
        self._maps.append(mapping)
        return np.frombuffer(mapping, np.float32).reshape(shape)

    def release(self, row: int) -> None:
        """Give the pages of an inactive ``row`` back to the OS (they read as zeros afterwards)."""
        if not self._maps:
            return
        row_bytes = self.keys[0][0].nbytes
        start = -(-row * row_bytes // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the row only
        end = (row + 1) * row_bytes // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            for mapping in self._maps:
                mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    @property
    def nbytes(self) -> int:
        """Bytes reserved for the buffers (virtual: pages are committed as they are written)."""
        return sum(buffer.nbytes for buffer in (*self.keys, *self.values))

    def add(self, cache: PrefillCache) -> int:
        """Copy a prefilled cache into the next free row; returns the row."""
        if self.count >= self.slots:
            raise InputError(f"all {self.slots} KV slots are in use")
        if cache.length > self.capacity:
            raise InputError(f"a cache of {cache.length} positions exceeds the slot capacity {self.capacity}")
        row, length = self.count, cache.length
        for buffers, parts in ((self.keys, cache.keys), (self.values, cache.values)):
            for buffer, part in zip(buffers, parts, strict=True):
                buffer[row, :, :length] = part[0]  # [H, T, Dh]
        self.lengths[row] = length
        self.count += 1
        return row

    def export(self, row: int) -> PrefillCache:
        """A copy of ``row``'s cached positions (a row that leaves the batch for a while and comes back
        with ``add``: a streamed request waiting for text)."""
        length = int(self.lengths[row])
        layers, (_, kv_heads, _, head_dim) = len(self.keys), self.keys[0].shape
        cache = PrefillCache(layers, kv_heads, length, head_dim)
        for buffers, parts in ((self.keys, cache.keys), (self.values, cache.values)):
            for buffer, part in zip(buffers, parts, strict=True):
                part[0] = buffer[row, :, :length]  # [H, T, Dh]
        return cache

    def remove(self, row: int) -> int | None:
        """Free ``row``; the last active row moves into it. Returns the row that moved there (its old
        index was ``count`` after this call), or None when ``row`` was the last one."""
        last = self.count - 1
        self.count = last
        if row == last:
            self.lengths[last] = 0
            self.release(last)
            return None
        length = int(self.lengths[last])
        for buffer in (*self.keys, *self.values):
            buffer[row, :, :length] = buffer[last, :, :length]  # [H, P, Dh]
        self.lengths[row] = length
        self.lengths[last] = 0
        self.release(last)
        return last
