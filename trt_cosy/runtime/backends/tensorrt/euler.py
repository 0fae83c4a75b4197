"""The CFM Euler solve on the device: n chained step-graph launches, no host synchronisation inside.

``stages.flow.solve_euler`` runs the estimator once per step and updates x on the host: on
TensorRT that is a device -> host -> device round trip and a stream synchronize per step. The
``FLOW_STEP`` graph (``runtime.graphs``; ``builder.flow_step.wrap_estimator_step``: estimator +
guidance + Euler update) takes x [1, 80, F] and returns x_next, so ``DeviceEulerLoop`` can queue all n steps on one stream:

* mask, mu, spks, cond and the start noise x0 are copied to the device once per solve;
* the (t, dt) schedule is uploaded once, at construction, into one device buffer; step k binds
  ``t`` and ``dt`` by address into it (no per-step copy);
* x ping-pongs between the slot's ``x`` and ``x_next`` buffers (step k reads one, writes the other);
* the result is either copied to the host after one synchronize (``run``) or handed to the next
  stage as a device pointer plus a CUDA event to wait on (``enqueue``).

Numpy only; the step runner is a ``TrtRunner`` (or anything with its hot-path methods).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Final, Protocol

import numpy as np

from .cuda import DeviceBuffer, Event, PinnedBuffer, Stream, bindings, cuda_call

__all__ = [
    "TIME_STRIDE",
    "step_schedule",
    "guidance_feed",
    "StepRunner",
    "DeviceOutput",
    "DeviceEulerLoop",
]

_LOGGER = logging.getLogger(__name__)

# TensorRT wants every bound address 256-byte aligned (IExecutionContext::setTensorAddress), so the
# schedule table gives each t and each dt its own 256-byte row: t_k at 2k rows, dt_k at 2k + 1.
TIME_STRIDE: Final = 256
_FLOAT: Final = np.dtype(np.float32)


def step_schedule(t_span: np.ndarray) -> np.ndarray:
    """The (t, dt) of each Euler step [n, 2] float32, exactly as ``solve_euler`` produces them.

    ``t`` accumulates in float32 (``t += dt``) and ``dt = t_span[k + 1] - t``, so t tracks the time
    grid ``t_span`` [n + 1] (``stages.flow.cosine_t_span(n)``) only up to rounding, as officially.
    """
    grid = np.asarray(t_span, dtype=np.float32)  # [n+1]
    steps = grid.shape[0] - 1
    if steps < 1:
        raise ValueError(f"the time grid needs at least 2 points, got {grid.shape[0]}")
    schedule = np.empty((steps, 2), np.float32)  # [n, 2]
    t, dt = grid[0], grid[1] - grid[0]
    for step in range(steps):
        schedule[step] = t, dt
        t = t + dt
        if step + 1 < steps:
            dt = grid[step + 2] - t
    return schedule


def guidance_feed(
    noise: np.ndarray, mu: np.ndarray, mask: np.ndarray, spks: np.ndarray, cond: np.ndarray
) -> dict[str, np.ndarray]:
    """The step graph's per-solve inputs, the CFG pair as ``solve_euler`` builds it.

    Args:
        noise: start point x0 [1, 80, F]. mu: [1, 80, F]. mask: [1, 1, F]. spks: [1, 80]. cond: [1, 80, F].

    Returns:
        x [1, 80, F], mask [2, 1, F] and mu, spks, cond as [2, ...] with row 0 conditional and
        row 1 unconditional (zeros), float32.
    """

    def pair(value: np.ndarray) -> np.ndarray:
        value = np.asarray(value, np.float32)
        return np.concatenate([value[:1], np.zeros_like(value[:1])])  # [2, ...]

    return {
        "x": np.ascontiguousarray(noise, np.float32),  # [1, 80, F]
        "mask": np.repeat(np.asarray(mask, np.float32), 2, axis=0),  # [2, 1, F]
        "mu": pair(mu),  # [2, 80, F]
        "spks": pair(spks),  # [2, 80]
        "cond": pair(cond),  # [2, 80, F]
    }


class StepRunner(Protocol):
    """The ``TrtRunner`` hot-path methods the loop uses."""

    slots: int

    def input_specs(self) -> dict[str, tuple[tuple[Any, ...], Any]]: ...
    def slot(self) -> AbstractContextManager[int]: ...
    def set_shapes(
        self, shapes: Mapping[str, Sequence[int]], slot: int = 0
    ) -> dict[str, tuple[int, ...]]: ...
    def copy_inputs(
        self, arrays: Mapping[str, np.ndarray], slot: int = 0, bound: Collection[str] = ()
    ) -> None: ...
    def enqueue(self, slot: int = 0, addresses: Mapping[str, int] | None = None) -> None: ...
    def device_tensor(self, name: str, slot: int = 0) -> tuple[int, tuple[int, ...], np.dtype]: ...
    def record(self, slot: int = 0, event: Event | None = None) -> Event: ...
    def wait(self, event: Event, slot: int = 0) -> None: ...
    def stream(self, slot: int = 0) -> Stream: ...


@dataclass(frozen=True)
class DeviceOutput:
    """The solved mel on the device: wait on ``event`` before reading ``ptr``."""

    ptr: int
    """Device address of x [1, 80, F] float32 (one of the slot's buffers)."""
    shape: tuple[int, ...]
    event: Event
    """Recorded on the slot's stream after the last step."""


class DeviceEulerLoop:
    """All Euler steps of one solve queued on a step runner's slot stream.

    Args:
        runner: a ``TrtRunner`` over a ``FLOW_STEP`` / ``FLOW_STEP_STREAM`` plan.
        schedule: the (t, dt) pairs [n, 2] (``step_schedule(cosine_t_span(n))``).

    The schedule goes to the device once, here (ordered before every solve by an event, no host
    synchronize). Buffer contract: ``enqueue`` returns a pointer into the slot's ``x``/``x_next``
    buffers; it stays valid until the slot's next solve: pass the consumer's event as ``after``.
    Chained solves on one slot never overwrite pinned staging still being copied: ``copy_inputs``
    writes the slot's pinned buffers from the host at once, so ``enqueue`` first waits (on the host,
    only while it is not done) for the event recorded after the previous solve's uploads.
    """

    def __init__(self, runner: StepRunner, schedule: np.ndarray):
        self.runner = runner
        self.schedule = np.ascontiguousarray(schedule, dtype=np.float32)  # [n, 2]
        steps = self.schedule.shape[0]
        table = np.zeros((2 * steps, TIME_STRIDE // _FLOAT.itemsize), np.float32)  # [2n, 64]
        table[:, 0] = self.schedule.reshape(-1)  # rows t_0, dt_0, t_1, dt_1, ...
        self._table_host = PinnedBuffer(table.nbytes)  # kept until free(): the upload reads it
        self._table_host.view(np.float32, table.shape)[...] = table
        self._table = DeviceBuffer(table.nbytes)
        stream = runner.stream(0)
        self._table.copy_from_async(self._table_host, table.nbytes, stream)
        self._uploaded = Event().record(stream)
        max_x = runner.input_specs()["x"][0]  # the profile maximum [1, 80, F]
        self._results = [PinnedBuffer(_FLOAT.itemsize * int(np.prod(max_x))) for _ in range(runner.slots)]
        self._done = [Event() for _ in range(runner.slots)]
        self._uploaded_inputs = [Event() for _ in range(runner.slots)]  # after each solve's copies in
        self._staging_busy = [False] * runner.slots

    @property
    def steps(self) -> int:
        return int(self.schedule.shape[0])

    def time_addresses(self, step: int) -> dict[str, int]:
        """Device addresses of step ``step``'s ``t`` and ``dt`` in the schedule table."""
        base = self._table.ptr + 2 * step * TIME_STRIDE
        return {"t": base, "dt": base + TIME_STRIDE}

    def enqueue(
        self, feed: Mapping[str, np.ndarray], slot: int = 0, after: Event | None = None
    ) -> DeviceOutput:
        """Queue the whole solve on ``slot``'s stream and return at once (no host synchronize).

        Args:
            feed: x [1, 80, F] (the start noise), mask [2, 1, F], mu, spks, cond (``guidance_feed``).
            slot: a runner slot the caller holds (``with runner.slot() as slot``).
            after: an event the solve waits for first (e.g. the previous consumer of this slot).

        Returns:
            The final x on the device and the event recorded after the last step.
        """
        runner = self.runner
        arrays = {**feed, "t": self.schedule[0, :1], "dt": self.schedule[0, 1:]}  # t/dt: bound by address
        shapes = runner.set_shapes({name: np.shape(value) for name, value in arrays.items()}, slot)
        if after is not None:
            runner.wait(after, slot)
        runner.wait(self._uploaded, slot)  # a no-op once the table is there
        staged = self._uploaded_inputs[slot]
        if self._staging_busy[slot] and not staged.done():  # the last solve's uploads still read them
            staged.synchronize()
        runner.copy_inputs(arrays, slot, bound=("t", "dt"))  # t/dt: rows of the schedule table
        runner.record(slot, staged)
        self._staging_busy[slot] = True
        # Preallocated at the profile maxima, these pointers do not move while the slot is ours.
        buffers = (runner.device_tensor("x", slot)[0], runner.device_tensor("x_next", slot)[0])
        for step in range(self.steps):
            addresses = {"x": buffers[step % 2], "x_next": buffers[(step + 1) % 2]}
            runner.enqueue(slot, addresses={**addresses, **self.time_addresses(step)})
        event = runner.record(slot, self._done[slot])
        return DeviceOutput(buffers[self.steps % 2], shapes["x_next"], event)

    def run(self, feed: Mapping[str, np.ndarray]) -> np.ndarray:
        """Solve on a free slot and return x [1, 80, F] on the host (one stream synchronize)."""
        with self.runner.slot() as slot:
            out = self.enqueue(feed, slot)
            nbytes = _FLOAT.itemsize * int(np.prod(out.shape))
            host, stream = self._results[slot], self.runner.stream(slot)
            host.resize(nbytes)
            kind = bindings().cudaMemcpyKind.cudaMemcpyDeviceToHost
            cuda_call(bindings().cudaMemcpyAsync(host.ptr, out.ptr, nbytes, kind, stream.handle))
            stream.synchronize()
            return np.array(host.view(np.float32, out.shape), copy=True)  # [1, 80, F]

    def free(self) -> None:
        """Release the schedule, the result staging buffers and the events."""
        events = (self._uploaded, *self._done, *self._uploaded_inputs)
        for resource in (self._table, self._table_host, *self._results, *events):
            resource.free()

    def __enter__(self) -> DeviceEulerLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()
