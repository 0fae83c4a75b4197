"""Render turns: one render at a time by default, first chunks ahead of later ones, first come first
served within each kind, a cancelled waiter leaves the line."""

from __future__ import annotations

import threading
import time

import pytest

from trt_cosy.runtime.render_turns import RenderTurns
from trt_cosy.runtime.work_gate import GateCancelled


def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _waiters(turns: RenderTurns, kinds: list[bool], order: list[str]) -> list[threading.Thread]:
    """Queue one waiter per kind (True: a first chunk), each after the previous is in line."""
    threads = []
    for index, first in enumerate(kinds):

        def run(index=index, first=first) -> None:
            with turns.turn(first):
                order.append(f"{'first' if first else 'later'}-{index}")

        thread = threading.Thread(target=run)
        thread.start()
        threads.append(thread)
        in_line = len(threads)
        _wait_for(lambda in_line=in_line: len(turns._waiting) == in_line)
    return threads


def test_first_chunks_go_before_later_ones_and_each_kind_in_arrival_order():
    turns = RenderTurns(1)
    order: list[str] = []
    with turns.turn(False):  # a render in progress: everyone below waits in line
        threads = _waiters(turns, [False, True, False, True], order)
        assert order == [] and turns.running == 1
    for thread in threads:
        thread.join(5.0)
    assert order == ["first-1", "first-3", "later-0", "later-2"]
    assert turns.running == 0 and not turns._waiting


def test_limit_admits_that_many_renders_at_once():
    turns = RenderTurns(2)
    with turns.turn(False), turns.turn(True):
        assert turns.running == 2
        order: list[str] = []
        threads = _waiters(turns, [True], order)
        assert order == []  # a third waits
    threads[0].join(5.0)
    assert order == ["first-0"]


def test_cancelled_waiter_leaves_the_line_and_holds_nothing():
    turns = RenderTurns(1)
    cancel = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with turns.turn(True, cancel.is_set):
                pass
        except GateCancelled as exc:
            errors.append(exc)

    with turns.turn(False):
        thread = threading.Thread(target=run)
        thread.start()
        _wait_for(lambda: len(turns._waiting) == 1)
        cancel.set()
        thread.join(5.0)
    assert len(errors) == 1 and not turns._waiting and turns.running == 0
    with turns.turn(False):  # the line still works
        assert turns.running == 1


def test_limit_must_be_positive():
    with pytest.raises(ValueError, match="limit >= 1"):
        RenderTurns(0)


def test_with_priorities_streams_go_first_and_whole_requests_by_rank():
    """A server gives each request its place: a streamed request's first chunks (shortest first), then
    its later chunks in admission order, then non-streamed requests by (rank, number), whatever order
    they queue in."""
    turns = RenderTurns(1)
    order: list[str] = []
    waiting = [
        (True, (1, 900, 1), 300, "whole-900-first-chunk"),
        (False, (1, 50, 6), 0, "whole-50"),
        (False, (1, 900, 0), 0, "whole-900-admitted-first"),
        (False, (0, 0, 4), 0, "stream-4-later"),
        (True, (0, 0, 5), 60, "stream-5-first-60"),
        (False, (0, 0, 3), 0, "stream-3-later"),
        (True, (0, 0, 7), 28, "stream-7-first-28"),
    ]
    threads = []
    with turns.turn(False):
        for first, priority, size, name in waiting:

            def run(first=first, priority=priority, size=size, name=name) -> None:
                with turns.turn(first, None, priority, size):
                    order.append(name)

            threads.append(threading.Thread(target=run))
            threads[-1].start()
            in_line = len(threads)
            _wait_for(lambda in_line=in_line: len(turns._waiting) == in_line)
    for thread in threads:
        thread.join(5.0)
    assert order == [
        "stream-7-first-28",
        "stream-5-first-60",
        "stream-3-later",
        "stream-4-later",
        "whole-50",
        "whole-900-admitted-first",
        "whole-900-first-chunk",
    ]
