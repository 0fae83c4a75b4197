"""A bound on the flow + vocoder work in flight, so memory does not grow with the request count.

The flow and the vocoder of one chunk need working memory in proportion to the chunk's length (the
flow runs on prompt + chunk tokens, the vocoder on their mel frames), and ONNX Runtime's arena grows
to the largest total seen. Eight long requests rendering at once need eight times the memory of
one, for no gain on a CPU whose cores one render already keeps busy. ``WorkGate`` admits renders
while their weights (speech tokens) fit in its capacity, first come first served; a render heavier
than the capacity runs alone. Short streaming chunks still pass next to one long render.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Final

__all__ = ["WorkGate", "GateCancelled", "RENDER_GATE", "DEFAULT_RENDER_TOKENS", "render_order"]

_LOGGER = logging.getLogger(__name__)

# Speech tokens in flight: about 80 s of speech (25 tokens/s), the longest segment the sentence
# splitter makes with its 80-text-token pieces at the LLM's 20 speech-per-text token cap.
DEFAULT_RENDER_TOKENS: Final = 2000
_POLL_S: Final = 0.05


def render_order(first: bool, priority: tuple[int, int, int] | None, size: int, ticket: int) -> tuple[int, ...]:
    """The place of a render in line (lower first), shared by ``WorkGate`` and ``RenderTurns``.

    Without a ``priority``: first chunks first, then arrival (``ticket``). With a server's priority
    (``server.admission.render_priority``): a streamed request ``(0, _, number)`` has its first chunks
    go first, shortest ``size`` first, then its later chunks in ``number`` order; a non-streamed one
    ``(1, rank, number)`` comes after those, lowest ``(rank, number)`` first.
    """
    if priority is None:
        return (0 if first else 1, 0, 0, ticket)
    if priority[0] == 0:
        return (0, size, priority[-1], ticket) if first else (1, 0, priority[-1], ticket)
    return (2, *priority[1:], ticket)


class WorkGate:
    """A weighted semaphore whose waiters go in line: first come first served, or in ``render_order``
    when they give a priority (thread-safe).

    Args:
        capacity: the total weight admitted at once, >= 1; a heavier request is admitted alone.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.in_flight = 0
        self._lock = threading.Condition()
        self._tickets = itertools.count()
        self._queue: list[tuple[int, ...]] = []  # render_order keys, sorted

    @contextlib.contextmanager
    def hold(
        self,
        weight: int,
        cancelled: Callable[[], bool] | None = None,
        priority: tuple[int, int, int] | None = None,
        first: bool = False,
    ) -> Iterator[None]:
        """Wait for room for ``weight``, hold it for the block, then release it.

        ``cancelled`` is polled while waiting; when it returns True the wait ends with
        ``GateCancelled`` (nothing is held). ``priority`` and ``first``: the render's place in line
        (``render_order``); without a priority, arrival order.
        """
        weight = max(1, min(int(weight), self.capacity))
        with self._lock:
            ticket = next(self._tickets)
            if priority is None:
                key: tuple[int, ...] = (0, 0, 0, ticket)  # arrival order, as before priorities
            else:
                key = render_order(first, priority, int(weight), ticket)
            self._queue.append(key)
            self._queue.sort()
            try:
                while self._queue[0] != key or self.in_flight + weight > self.capacity:
                    if cancelled is not None and cancelled():
                        raise GateCancelled("cancelled while waiting for render capacity")
                    self._lock.wait(_POLL_S)
            finally:
                self._queue.remove(key)
                self._lock.notify_all()
            self.in_flight += weight
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= weight
                self._lock.notify_all()


class GateCancelled(Exception):
    """The waiter's request was cancelled before it got room."""


RENDER_GATE: Final = WorkGate(DEFAULT_RENDER_TOKENS)
"""The process-wide gate of flow + vocoder renders (memory is per process)."""
