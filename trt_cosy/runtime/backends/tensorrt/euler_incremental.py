"""A streaming chunk's Euler solve over its new frames, wholly on the device (issue 29 items 1 and 4).

``stages.flow_incremental`` without a step plan runs the incremental estimator once per Euler step
and does the guided update on the host: per step the velocity [2, 80, T] comes down, x goes up and
the stream is synchronized (10 synchronizes a chunk). The ``FLOW_STEP_INCREMENTAL`` plan
(``builder.flow_step``: estimator + guidance + Euler update) takes x [1, 80, T] and returns x_next,
so ``DeviceIncrementalLoop`` queues the whole chunk on one stream:

* x0 (the fixed noise of the new frames), mu, spks and cond go up once per chunk (the CFG pair);
* t and dt are rows of the schedule table uploaded once (``euler.DeviceEulerLoop``);
* x ping-pongs between the slot's ``x`` and ``x_next`` buffers;
* step k binds ``past_blocks`` to the segment's device store of step k (``DeviceBlocks``, never a
  copy) and ``past_tails`` / ``new_tails`` to its two tail sets, and the plan's ``new_blocks`` are
  appended to the store device to device;
* the mel of the new frames comes down after the last step, with the chunk's one synchronize.

So per chunk the host sends 4 · (400 T + 160) bytes and receives 4 · 80 T, whatever the cache holds,
and each step launches through the runner's CUDA graph for that step (``graphs``; captured again and
updated with the segment's addresses, ``TrtRunner.enqueue(graph=...)``).

Numpy only; the step runner is a ``TrtRunner`` (or anything with its hot-path methods).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Final

import numpy as np

from .cuda import Event
from .device_blocks import DeviceBlocks
from .euler import DeviceEulerLoop, DeviceOutput

__all__ = ["DeviceIncrementalLoop", "incremental_feed"]

_LOGGER = logging.getLogger(__name__)
_BOUND: Final = ("t", "dt", "past_blocks", "past_tails")  # bound by address, never uploaded per chunk


def incremental_feed(
    noise: np.ndarray, mu: np.ndarray, spks: np.ndarray, cond: np.ndarray
) -> dict[str, np.ndarray]:
    """The step plan's per-chunk inputs over the new frames, the CFG pair as ``solve_euler`` builds it.

    Args:
        noise: x0 of the new frames [1, 80, T]. mu, cond: [1, 80, T]. spks: [1, 80].

    Returns:
        x [1, 80, T]; mu, cond [2, 80, T] and spks [2, 80] with row 1 (unconditional) zeros; float32.
    """

    def pair(value: np.ndarray) -> np.ndarray:
        value = np.asarray(value, np.float32)
        return np.concatenate([value[:1], np.zeros_like(value[:1])])  # [2, ...]

    return {
        "x": np.ascontiguousarray(noise, np.float32),  # [1, 80, T]
        "mu": pair(mu),  # [2, 80, T]
        "spks": pair(spks),  # [2, 80]
        "cond": pair(cond),  # [2, 80, T]
    }


class DeviceIncrementalLoop(DeviceEulerLoop):
    """Every Euler step of one incremental chunk queued on a step runner's slot stream.

    Args:
        runner: a ``TrtRunner`` over a ``FLOW_STEP_INCREMENTAL`` plan, loaded with ``past_blocks`` and
            ``past_tails`` bound by address (``trt.BOUND_INPUTS``).
        schedule: the (t, dt) pairs [n, 2] (``step_schedule(cosine_t_span(n))``).
        graphs: launch each step through the runner's CUDA graph for it (see the module docstring).

    The buffer contract and the staging rule are ``DeviceEulerLoop``'s. The store passed to
    ``enqueue`` is the caller's (one segment's cache, one owner); it must keep tails
    (``DeviceBlocks(tail_bytes=...)``) and the same frame count in every step.
    """

    GRAPH_TAG: Final = "incremental"

    def enqueue_chunk(
        self, store: DeviceBlocks, feed: Mapping[str, np.ndarray], slot: int = 0, after: Event | None = None
    ) -> DeviceOutput:
        """Queue the chunk's solve and the appends to ``store`` on ``slot``'s stream; return at once.

        Args:
            store: the segment's device cache: P frames per step in, P + T out (tails flipped).
            feed: ``incremental_feed`` of the new frames.
            slot: a runner slot the caller holds. after: an event to wait for first.

        Returns:
            x of the new frames [1, 80, T] on the device and the event after the last append.
        """
        runner, frames = self.runner, int(feed["x"].shape[2])
        held = store.frames[0]
        if store.frames != [held] * self.steps or store.steps != self.steps:
            raise ValueError(
                f"the store holds {store.frames} frames per step; the loop has {self.steps} steps"
            )
        stream = runner.stream(slot)
        for step in range(self.steps):  # before any launch: a growth moves the buffer (and waits)
            store.reserve(step, held + frames, stream)
        blocks = store.frame_bytes // 4
        arrays = {
            **feed,
            "t": self.schedule[0, :1],
            "dt": self.schedule[0, 1:],
            "past_blocks": np.empty((held, *runner.input_specs()["past_blocks"][0][1:]), np.float32),
            "past_tails": np.empty(runner.input_specs()["past_tails"][0], np.float32),
        }
        if int(np.prod(arrays["past_blocks"].shape[1:])) != blocks:
            raise ValueError(f"the store's {store.frame_bytes}-byte frames do not fit the plan's past_blocks")
        shapes = self._stage(arrays, slot, after, bound=_BOUND)  # past_*: shapes only, never copied
        buffers = self._x_buffers(slot)
        for step in range(self.steps):
            addresses = {
                **self.step_addresses(step, buffers),
                "past_blocks": store.ptr(step),  # [P, L, 2, D]
                "past_tails": store.tail_ptr(step),  # [2, C, K-1]
                "new_tails": store.tail_ptr(step, later=True),
            }
            self._launch(slot, step, addresses)
            produced, shape, _ = runner.device_tensor("new_blocks", slot)  # [T, L, 2, D]
            store.append(step, produced, int(shape[0]), stream)
        store.flip_tails()
        event = runner.record(slot, self._done[slot])
        return DeviceOutput(buffers[self.steps % 2], shapes["x_next"], event)

    def run_chunk(self, store: DeviceBlocks, feed: Mapping[str, np.ndarray]) -> np.ndarray:
        """Solve a chunk on a free slot and return x of its new frames [1, 80, T] (one synchronize)."""
        with self.runner.slot() as slot:
            return self.to_host(self.enqueue_chunk(store, feed, slot), slot)
