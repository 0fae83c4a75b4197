"""Append-only per-step frame stores in device memory: the incremental flow cache on the GPU
(issue 29 item 1; ``stages.flow_incremental`` keeps its ``FlowCache`` blocks here on TensorRT).

Each Euler step k keeps frames [P_k, frame_bytes] contiguous in one device buffer, so the plan's
``past_blocks`` [P, L, 2, D] is bound straight to the buffer (one address, never a copy) and a
step's ``new_blocks`` [T, L, 2, D] is appended after the P frames with one device-to-device copy.
Buffers grow (doubling, at least ``GROW_FRAMES``) by a device-to-device copy into a larger block;
the host never holds the frames, and no step moves bytes that grow with the cache.

With ``tail_bytes`` (the device Euler loop, ``runtime.euler_incremental``) the per-step convolution
tails [2, C, K-1] live here too, twice: a chunk's step k reads ``tail_ptr(k)`` as ``past_tails`` and
writes ``tail_ptr(k, later=True)`` as ``new_tails`` (TensorRT does not promise that an input and an
output may share memory), and ``flip_tails`` swaps the two after the chunk. Rows are 256 bytes
apart (TensorRT's address alignment).
"""

from __future__ import annotations

import logging
from typing import Final

import numpy as np

from .cuda import DeviceBuffer, PinnedBuffer, Stream, bindings, cuda_call

__all__ = ["DeviceBlocks", "GROW_FRAMES"]

_LOGGER = logging.getLogger(__name__)
GROW_FRAMES: Final = 256  # the smallest growth, in frames (50 frames per chunk at 50 Hz)
_ROW: Final = 256  # TensorRT's address alignment (IExecutionContext::setTensorAddress)


class DeviceBlocks:
    """``steps`` stores of frames of ``frame_bytes`` bytes each, in device memory (one owner), and
    with ``tail_bytes`` two sets of per-step tails of that many bytes."""

    def __init__(self, steps: int, frame_bytes: int, tail_bytes: int = 0):
        self.steps, self.frame_bytes, self.tail_bytes = steps, int(frame_bytes), int(tail_bytes)
        self.frames = [0] * steps  # frames held per step
        self._buffers = [DeviceBuffer(1) for _ in range(steps)]  # never a null address, even empty
        self._tail_row = -(-self.tail_bytes // _ROW) * _ROW
        self._tails = DeviceBuffer(2 * steps * self._tail_row) if tail_bytes else None
        self.parity = 0  # which tail set holds the tails of the frames held

    @property
    def nbytes(self) -> int:
        """Device bytes reserved (capacity, not only the frames held)."""
        tails = self._tails.nbytes if self._tails is not None else 0
        return sum(buffer.nbytes for buffer in self._buffers) + tails

    def tail_ptr(self, step: int, later: bool = False) -> int:
        """Device address of step ``step``'s tails [2, C, K-1]: those of the frames held, or
        (``later``) where the next chunk writes its own."""
        if self._tails is None:
            raise ValueError("these blocks keep no tails (made without tail_bytes)")
        which = self.parity ^ int(later)
        return self._tails.ptr + (which * self.steps + step) * self._tail_row

    def flip_tails(self) -> None:
        """After a chunk: the tails it wrote become those of the frames held."""
        self.parity ^= 1

    def upload_tails(self, tails: np.ndarray, stream: Stream) -> None:
        """Copy host tails [steps, 2, C, K-1] float32 into the current set (once per segment; waits)."""
        tails = np.ascontiguousarray(tails, np.float32)
        if tails.shape[0] != self.steps or tails[0].nbytes != self.tail_bytes:
            raise ValueError(f"tails {tails.shape} do not fit {self.steps} steps of {self.tail_bytes} bytes")
        with PinnedBuffer(self.steps * self._tail_row) as staged:
            rows = staged.view(np.uint8, (self.steps, self._tail_row))
            rows[:, : self.tail_bytes] = tails.reshape(self.steps, -1).view(np.uint8)
            kind = bindings().cudaMemcpyKind.cudaMemcpyHostToDevice
            target = self.tail_ptr(0)
            count = self.steps * self._tail_row
            cuda_call(bindings().cudaMemcpyAsync(target, staged.ptr, count, kind, stream.handle))
            stream.synchronize()  # the staging buffer is freed next

    def ptr(self, step: int) -> int:
        """Device address of step ``step``'s first frame (bind it as ``past_blocks``)."""
        return self._buffers[step].ptr

    def reserve(self, step: int, frames: int, stream: Stream) -> None:
        """Make room for ``frames`` frames in step ``step`` (keeping those held). A growth copies the
        held frames device to device on ``stream`` and waits for it before freeing the old block."""
        buffer, need = self._buffers[step], frames * self.frame_bytes
        if need <= buffer.nbytes:
            return
        grown = DeviceBuffer(max(need, 2 * buffer.nbytes, GROW_FRAMES * self.frame_bytes))
        held = self.frames[step] * self.frame_bytes
        if held:
            grown.copy_from_device_async(buffer.ptr, held, stream)
            stream.synchronize()  # the old block is freed next; growth is rare (doubling)
        buffer.free()
        self._buffers[step] = grown

    def append(self, step: int, source: int, frames: int, stream: Stream) -> None:
        """Queue the copy of ``frames`` frames from the device address ``source`` after the held ones
        (room made by ``reserve`` first)."""
        offset = self.frames[step] * self.frame_bytes
        count = frames * self.frame_bytes
        if offset + count > self._buffers[step].nbytes:
            raise ValueError(f"step {step}: no room for {frames} more frames; reserve them first")
        if count:
            target = self._buffers[step]
            _copy_device(target.ptr + offset, source, count, stream)
        self.frames[step] += frames

    def clone(self, stream: Stream) -> DeviceBlocks:
        """A copy with its own buffers (a voice prefix that a request then extends); waits for it."""
        copy = DeviceBlocks(self.steps, self.frame_bytes, self.tail_bytes)
        for step, frames in enumerate(self.frames):
            copy.reserve(step, frames, stream)
            copy.append(step, self.ptr(step), frames, stream)
        if self._tails is not None and copy._tails is not None:
            copy.parity = self.parity
            _copy_device(copy._tails.ptr, self._tails.ptr, self._tails.nbytes, stream)
        stream.synchronize()
        return copy

    def free(self) -> None:
        for buffer in (*self._buffers, *([self._tails] if self._tails is not None else [])):
            buffer.free()
        self.frames = [0] * self.steps


def _copy_device(target: int, source: int, count: int, stream: Stream) -> None:
    """``cudaMemcpyAsync`` device -> device of ``count`` bytes on ``stream``."""
    kind = bindings().cudaMemcpyKind.cudaMemcpyDeviceToDevice
    cuda_call(bindings().cudaMemcpyAsync(int(target), int(source), int(count), kind, stream.handle))
