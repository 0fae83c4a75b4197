"""Append-only per-step frame stores in device memory: the incremental flow cache on the GPU
(issue 29 item 1; ``stages.flow_incremental`` keeps its ``FlowCache`` blocks here on TensorRT).

Each Euler step k keeps frames [P_k, frame_bytes] contiguous in one device buffer, so the plan's
``past_blocks`` [P, L, 2, D] is bound straight to the buffer (one address, never a copy) and a
step's ``new_blocks`` [T, L, 2, D] is appended after the P frames with one device-to-device copy.
Buffers grow (doubling, at least ``GROW_FRAMES``) by a device-to-device copy into a larger block;
the host never holds the frames, and no step moves bytes that grow with the cache.
"""

from __future__ import annotations

import logging
from typing import Final

from .cuda import DeviceBuffer, Stream, bindings, cuda_call

__all__ = ["DeviceBlocks", "GROW_FRAMES"]

_LOGGER = logging.getLogger(__name__)
GROW_FRAMES: Final = 256  # the smallest growth, in frames (50 frames per chunk at 50 Hz)


class DeviceBlocks:
    """``steps`` stores of frames of ``frame_bytes`` bytes each, in device memory (one owner)."""

    def __init__(self, steps: int, frame_bytes: int):
        self.steps, self.frame_bytes = steps, int(frame_bytes)
        self.frames = [0] * steps  # frames held per step
        self._buffers = [DeviceBuffer(1) for _ in range(steps)]  # never a null address, even empty

    @property
    def nbytes(self) -> int:
        """Device bytes reserved (capacity, not only the frames held)."""
        return sum(buffer.nbytes for buffer in self._buffers)

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
        copy = DeviceBlocks(self.steps, self.frame_bytes)
        for step, frames in enumerate(self.frames):
            copy.reserve(step, frames, stream)
            copy.append(step, self.ptr(step), frames, stream)
        stream.synchronize()
        return copy

    def free(self) -> None:
        for buffer in self._buffers:
            buffer.free()
        self.frames = [0] * self.steps


def _copy_device(target: int, source: int, count: int, stream: Stream) -> None:
    """``cudaMemcpyAsync`` device -> device of ``count`` bytes on ``stream``."""
    kind = bindings().cudaMemcpyKind.cudaMemcpyDeviceToDevice
    cuda_call(bindings().cudaMemcpyAsync(int(target), int(source), int(count), kind, stream.handle))
