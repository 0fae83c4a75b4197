"""Turns for the flow + vocoder renders of concurrent requests: one render at a time (by default),
first chunks before later ones.

Every ONNX Runtime session spins as many intra-op threads as the machine has physical cores, so two
renders at once on the CPU do not finish sooner than one after the other: they share the same cores,
each at half speed (less: the spinning threads of one steal cycles from the other), and both chunks
come late. Taking turns instead, the first render in line finishes after one render's time. The
first chunk of a request (its time to first audio) goes before any later chunk of another request,
whose listener already has audio playing; within each kind it is first come, first served, or, for
requests given a ``priority`` (a server gives its admission order), in that order: then one
request's renders go before those of requests admitted after it, so requests finish one after the
other instead of all slowing down together, and first chunks go shortest first (``serving.admission``
predicts that order).

A render still waits for ``work_gate.RENDER_GATE`` (memory) first; turns only order the renders
that the gate admits. docs/benchmarks.md ("Continuous batching") has the measurements.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Final

from .work_gate import GateCancelled

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
        # (0 for a first chunk else 1, size of a prioritised first chunk, priority or (0, ticket), ticket)
        self._waiting: list[tuple[int, int, tuple[int, int], int]] = []

    @contextlib.contextmanager
    def turn(
        self,
        first: bool,
        cancelled: Callable[[], bool] | None = None,
        priority: tuple[int, int] | None = None,
        size: int = 0,
    ) -> Iterator[None]:
        """Wait for this render's turn, hold it for the block, then pass it on.

        ``priority``: the request's place among the others (lower first; ``Request.render_priority``);
        None: this render's arrival. With a priority, first chunks go shortest ``size`` (speech
        tokens) first, so a short request is not stuck behind a long request's first segment.

        Raises:
            GateCancelled: ``cancelled()`` became True while waiting (nothing is held).
        """
        ticket = next(self._tickets)
        if priority is None:
            key = (0 if first else 1, 0, (0, ticket), ticket)
        else:
            key = (0 if first else 1, size if first else 0, priority, ticket)
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
