"""Run a test's native part in a child process, so a native crash fails that test, not the suite.

``run_isolated(function, *args)`` calls ``function(*args)`` (a module-level function of a test module,
picklable arguments) in a fresh *spawned* Python process (never forked: OpenVINO's and ONNX Runtime's
thread pools do not survive a fork) and returns its result. A child killed by a signal (OpenVINO's
SIGFPE on Intel AMX, a segfault) fails the calling test with the signal's name; an exception in the
child is raised again here with the child's traceback.
"""

from __future__ import annotations

import multiprocessing
import signal
import traceback
from collections.abc import Callable
from typing import Any

import pytest

__all__ = ["run_isolated", "ChildCrashed"]

TIMEOUT_S = 1800.0


class ChildCrashed(pytest.fail.Exception):  # reported as the test's failure, with the signal
    pass


def _child(connection, function: Callable[..., Any], args: tuple) -> None:
    try:
        result = ("ok", function(*args))
    except BaseException as exc:  # sent back whole: the parent raises it as the test's failure
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    connection.send(result)
    connection.close()


def run_isolated(function: Callable[..., Any], *args: Any, timeout: float = TIMEOUT_S) -> Any:
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(send, function, args), daemon=True)
    process.start()
    send.close()
    try:
        ready = receive.poll(timeout)
        message = receive.recv() if ready else None
    except EOFError:  # the child died before sending: a crash
        message = None
    process.join(timeout=60)
    if process.exitcode is None:
        process.kill()
        process.join()
        raise ChildCrashed(f"{function.__name__} did not finish within {timeout:.0f} s in its child process")
    if message is None:
        code = process.exitcode
        what = signal.Signals(-code).name if code < 0 else f"exit status {code}"
        raise ChildCrashed(f"{function.__name__} crashed its child process ({what}); the suite goes on")
    status, value = message
    if status == "error":
        pytest.fail(f"{function.__name__} failed in its child process: {value}", pytrace=False)
    return value
