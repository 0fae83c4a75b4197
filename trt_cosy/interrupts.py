"""Stopping the command line promptly on Ctrl-C (SIGINT) and SIGTERM, leaving no file behind.

Python turns SIGINT into ``KeyboardInterrupt`` but lets SIGTERM kill the process at once, so the
atomic writer's cleanup never runs. ``sigterm_raises`` makes SIGTERM raise ``Interrupted`` (a
``KeyboardInterrupt``) in the main thread instead.

A signal handler only runs when the main thread is between Python bytecodes, not while it waits
inside a long ONNX Runtime call (a flow or vocoder pass over a whole segment takes seconds on a
full-size model). ``run_interruptible`` therefore runs the work in a worker thread and keeps the
main thread waiting where signals reach it: on a signal the work is asked to stop and given
``grace_s`` to clean up itself; if it is still busy then, ``on_abandon`` removes what it was
writing and the process exits at once (``os._exit``: the engines' threads are never joined).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final, TypeVar

__all__ = ["Interrupted", "sigterm_raises", "run_interruptible", "exit_status", "signal_name"]

_LOGGER = logging.getLogger(__name__)

T = TypeVar("T")
_POLL_S: Final = 0.05


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived. ``signum`` is the signal's number."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_status(exc: BaseException) -> int:
    """The shell's status for a process stopped by ``exc``'s signal: 128 + its number (130, 143)."""
    return 128 + getattr(exc, "signum", signal.SIGINT)


def signal_name(exc: BaseException) -> str:
    """``"SIGINT"`` or ``"SIGTERM"``: the signal behind a ``KeyboardInterrupt``."""
    return signal.Signals(getattr(exc, "signum", signal.SIGINT)).name


def _raise_interrupted(signum: int, frame) -> None:
    raise Interrupted(signum)


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM raises ``Interrupted`` in the main thread (no-op in other threads)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait_ignoring_interrupts(done: threading.Event, timeout_s: float) -> bool:
    """``done.wait(timeout_s)`` that a second Ctrl-C does not cut short (the grace period stands)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return done.wait(max(0.0, deadline - time.monotonic()))
        except KeyboardInterrupt:
            continue


def run_interruptible(
    work: Callable[[threading.Event], T],
    on_abandon: Callable[[], None],
    grace_s: float = 1.0,
    on_wait: Callable[[], None] | None = None,
    name: str = "trt-cosy-work",
) -> T:
    """``work(stop)`` in a worker thread, the calling thread waiting where signals reach it.

    Returns what ``work`` returns and re-raises what it raises. On ``KeyboardInterrupt`` (Ctrl-C, or
    SIGTERM under ``sigterm_raises``): sets ``stop`` (``work`` should check it and raise, cleaning up
    as on any error), waits up to ``grace_s`` for ``work`` to end and re-raises the interrupt; when
    ``work`` is still running after ``grace_s``, calls ``on_abandon()``, then ends the process with
    the signal's exit status (``exit_status``) without waiting for it. ``on_wait`` is called by the
    waiting thread every 50 ms (a progress heartbeat).
    """
    stop, done = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def body() -> None:
        try:
            outcome["value"] = work(stop)
        except BaseException as exc:  # handed to the waiting thread
            outcome["error"] = exc
        finally:
            done.set()

    # Waits on an Event, never Thread.join: a join interrupted by a signal marks the thread as stopped
    # while it still runs (CPython before 3.13), and the interpreter then exits under its feet.
    threading.Thread(target=body, name=name, daemon=True).start()
    try:
        while not done.wait(_POLL_S):
            if on_wait is not None:
                on_wait()
    except KeyboardInterrupt as exc:
        stop.set()
        if not _wait_ignoring_interrupts(done, grace_s):
            _LOGGER.debug("work still running %.1f s after the interrupt; abandoning it", grace_s)
            try:
                on_abandon()
            finally:
                print(f"interrupted ({signal_name(exc)})", file=sys.stderr)
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(exit_status(exc))
        raise
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
