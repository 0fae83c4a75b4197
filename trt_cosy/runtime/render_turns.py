"""Turns for the flow + vocoder renders of concurrent requests: one render at a time (by default),
first chunks before later ones.

Every ONNX Runtime session spins as many intra-op threads as the machine has physical cores, so two
renders at once on the CPU do not finish sooner than one after the other: they share the same cores,
each at half speed (less: the spinning threads of one steal cycles from the other), and both chunks
come late. Taking turns instead, the first render in line finishes after one render's time. The
first chunk of a request (its time to first audio) goes before any later chunk of another request,
whose listener already has audio playing; within each kind it is first come, first served, or, for
requests given a ``priority`` (a server's admission: ``server.admission.render_priority``), in that
order: streamed requests' first chunks (shortest first) and then their later chunks, then
non-streamed requests one at a time (least expected work first), so requests finish one after the
other instead of all slowing down together (``server.admission.WorkOrder`` predicts that order).

A render still waits for ``work_gate.RENDER_GATE`` (memory) first; turns only order the renders
that the gate admits. docs/benchmarks.md ("Continuous batching") has the measurements.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Final

from .work_gate import GateCancelled, render_order

__all__ = ["RenderTurns", "RENDER_TURNS"]

_POLL_S: Final = 0.05


class RenderTurns:
    """A lock for up to ``limit`` holders at once; waiters with ``first=True`` go ahead (thread-safe).

    Args:
        limit: renders at once, >= 1.
    """

    def __init__(self, limit: int = 1):
        if limit < 1:
            raise ValueError(f"render turns need limit >= 1, got {limit}")
        self.limit = limit
        self.running = 0
        self._lock = threading.Condition()
        self._tickets = itertools.count()
        self._waiting: list[tuple[int, ...]] = []  # (kind, size or rank, number, ticket), sorted

    @contextlib.contextmanager
    def turn(
        self,
        first: bool,
        cancelled: Callable[[], bool] | None = None,
        priority: tuple[int, int, int] | None = None,
        size: int = 0,
    ) -> Iterator[None]:
        """Wait for this render's turn, hold it for the block, then pass it on.

        ``priority``: the request's place among the others (``Request.render_priority``; see
        ``work_gate.render_order``), ``size`` its chunk's speech tokens; None: first chunks first,
        then this render's arrival.

        Raises:
            GateCancelled: ``cancelled()`` became True while waiting (nothing is held).
        """
        ticket = next(self._tickets)
        key = render_order(first, priority, size, ticket)
        with self._lock:
            self._waiting.append(key)
            self._waiting.sort()
            try:
                while self._waiting[0] != key or self.running >= self.limit:
                    if cancelled is not None and cancelled():
                        raise GateCancelled("cancelled while waiting for a render turn")
                    self._lock.wait(_POLL_S)
            finally:
                self._waiting.remove(key)
                self._lock.notify_all()
            self.running += 1
        try:
            yield
        finally:
            with self._lock:
                self.running -= 1
                self._lock.notify_all()


RENDER_TURNS: Final = RenderTurns(1)
"""The process-wide render turns (the cores are per process)."""
