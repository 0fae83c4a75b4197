"""Per-request control over the graph runs one thread makes: cancel a run while it computes.

A request's flow and vocoder calls on a long segment take seconds each, and a cancelled request
should not wait for them. The request activates its ``RunScope`` around those calls
(``with scope.active(): ...``); a backend that can abort a run (ONNX Runtime: ``RunOptions.terminate``)
asks ``current()`` for the scope and registers the run with it, so ``scope.cancel()`` from any
thread stops the running graph at its next node and the call raises ``RunCancelled``. A backend
that cannot abort ignores the scope: the request then stops after the call.

No backend is imported here: a scope only holds opaque run handles with a ``terminate`` attribute.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

__all__ = ["RunScope", "RunCancelled", "current", "context_set"]

T = TypeVar("T")

_CURRENT: contextvars.ContextVar[RunScope | None] = contextvars.ContextVar("trt_cosy_run_scope", default=None)


@contextlib.contextmanager
def context_set(var: contextvars.ContextVar[T], value: T) -> Iterator[T]:
    """``var`` is ``value`` within the block (this thread / context only), its earlier value after."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


class RunCancelled(Exception):
    """A graph run was stopped because its request was cancelled."""


class RunScope:
    """The cancellable runs of one request (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._runs: set[Any] = set()
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Abort the registered runs and refuse new ones (idempotent, from any thread)."""
        with self._lock:
            self._cancelled = True
            for run in self._runs:
                run.terminate = True

    def register(self, run: Any) -> None:
        """Track ``run`` (an object with a ``terminate`` attribute) until ``unregister``.

        Raises:
            RunCancelled: the scope is already cancelled (the run should not start).
        """
        with self._lock:
            if self._cancelled:
                raise RunCancelled("the request was cancelled")
            self._runs.add(run)

    def unregister(self, run: Any) -> None:
        with self._lock:
            self._runs.discard(run)

    @contextlib.contextmanager
    def active(self) -> Iterator[RunScope]:
        """Make this the scope of the graph runs made in the block (this thread / context only)."""
        with context_set(_CURRENT, self):
            yield self


def current() -> RunScope | None:
    """The scope activated around the current call, if any."""
    return _CURRENT.get()
