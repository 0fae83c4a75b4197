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

__all__ = ["WorkGate", "GateCancelled", "RENDER_GATE", "DEFAULT_RENDER_TOKENS"]

_LOGGER = logging.getLogger(__name__)

# Speech tokens in flight: about 80 s of speech (25 tokens/s), the longest segment the sentence
# splitter makes with its 80-text-token pieces at the LLM's 20 speech-per-text token cap.
DEFAULT_RENDER_TOKENS: Final = 2000
_POLL_S: Final = 0.05


class WorkGate:
    """A first-come-first-served weighted semaphore (thread-safe).

    Args:
        capacity: the total weight admitted at once, >= 1; a heavier request is admitted alone.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.in_flight = 0
        self._lock = threading.Condition()
        self._tickets = itertools.count()
        self._queue: list[int] = []

    @contextlib.contextmanager
    def hold(self, weight: int, cancelled: Callable[[], bool] | None = None) -> Iterator[None]:
        """Wait for room for ``weight``, hold it for the block, then release it.

        ``cancelled`` is polled while waiting; when it returns True the wait ends with
        ``GateCancelled`` (nothing is held).
        """
        weight = max(1, min(int(weight), self.capacity))
        with self._lock:
            ticket = next(self._tickets)
            self._queue.append(ticket)
            try:
                while self._queue[0] != ticket or self.in_flight + weight > self.capacity:
                    if cancelled is not None and cancelled():
                        raise GateCancelled("cancelled while waiting for render capacity")
                    self._lock.wait(_POLL_S)
            finally:
                self._queue.remove(ticket)
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
