"""The LLM worker of one request: ``TokenFeed`` decodes every text segment in its own thread and hands
the speech tokens to the request's consumer as they come (moved from ``pipeline``, which re-exports it).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Final

import numpy as np

__all__ = ["Cancelled", "TokenFeed"]

_LOGGER = logging.getLogger(__name__)
_JOIN_WARN_S: Final = 30.0


class Cancelled(Exception):
    """The request was cancelled (``TokenFeed.close`` or ``cancel``) while its consumer waited."""


class TokenFeed:
    """Speech tokens of every segment of one request, decoded by a worker thread.

    Args:
        decode: ``segment index -> iterator of speech token ids`` (a fresh ``LLMStage.generate``).
        segments: how many segments to decode, in order.
        name: the worker thread's name (for logs and debuggers).
    """

    def __init__(self, decode: Callable[[int], Iterator[int]], segments: int, name: str = "trt-cosy-llm"):
        self._decode = decode
        self._tokens: list[list[int]] = [[] for _ in range(segments)]
        self._token_times: list[list[float]] = [[] for _ in range(segments)]  # perf_counter per token
        self._finished = [False] * segments
        self._llm_seconds = [0.0] * segments
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._may_decode = threading.Event()  # cleared while the consumer renders with the cores to itself
        self._may_decode.set()
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    @property
    def alive(self) -> bool:
        """True while the worker thread runs."""
        return self._thread.is_alive()

    def start(self) -> None:
        if not self.started:
            _LIVE_FEEDS.add(self)  # joined at interpreter exit (_close_live_feeds)
            self._thread.start()

    def cancel(self) -> None:
        """Ask the worker to stop after its current LLM step and wake any waiting consumer (thread-safe)."""
        self._stop.set()
        self._may_decode.set()  # a held worker must see the stop flag
        with self._changed:
            self._changed.notify_all()

    def hold(self) -> None:
        """Pause the worker before its next LLM step until ``release`` (thread-safe).

        For a consumer about to render on cores the LLM's threads would share: one LLM step at most
        overlaps the render instead of the whole chunk (2 + 2 intra-op threads on 2 cores run both
        stages at well under half speed each).
        """
        self._may_decode.clear()

    def release(self) -> None:
        """Let a held worker decode again (thread-safe, idempotent)."""
        self._may_decode.set()

    def close(self) -> None:
        """Cancel and join the worker (idempotent)."""
        self.cancel()
        if self.started and self._thread is not threading.current_thread():
            self._thread.join(_JOIN_WARN_S)
            if self._thread.is_alive():  # one LLM step should never take this long
                _LOGGER.warning("LLM worker still running %.0f s after it was told to stop", _JOIN_WARN_S)

    @property
    def cancelled(self) -> bool:
        return self._stop.is_set()

    @property
    def finished_all(self) -> bool:
        """The LLM has finished every segment."""
        return all(self._finished)

    def llm_seconds(self, segment: int) -> float:
        """Seconds the worker has spent decoding ``segment`` so far."""
        return self._llm_seconds[segment]

    def token_times(self, segment: int) -> list[float]:
        """When each token of ``segment`` so far was published (``time.perf_counter`` seconds; a copy)."""
        with self._changed:
            return list(self._token_times[segment])

    def wait(self, segment: int, count: int | None) -> tuple[np.ndarray, bool]:
        """Block until ``segment`` has ``count`` tokens (None: until it is finished).

        Returns (a copy of the segment's tokens so far, int64 [n]; whether the LLM finished it).

        Raises:
            Cancelled: the request was cancelled.
            Exception: whatever the worker raised.
        """
        self.start()
        with self._changed:
            while True:
                if self._error is not None:
                    raise self._error
                if self._stop.is_set():
                    raise Cancelled("the request was cancelled")
                tokens, finished = self._tokens[segment], self._finished[segment]
                if finished or (count is not None and len(tokens) >= count):
                    return np.asarray(tokens, dtype=np.int64), finished  # [n]
                self._changed.wait()

    def _run(self) -> None:
        try:
            for segment in range(len(self._tokens)):
                if not self._decode_segment(segment):
                    return
        except BaseException as exc:  # handed to the consumer, which re-raises it
            with self._changed:
                self._error = exc
                self._changed.notify_all()

    def _decode_segment(self, segment: int) -> bool:
        """Decode one segment; False when stopped early."""
        self._may_decode.wait()
        started = time.perf_counter()
        held = 0.0  # seconds spent paused by ``hold``: not LLM time
        stream = self._decode(segment)
        try:
            for token in stream:
                # Checked between tokens: a closed request costs at most one more LLM step.
                if self._stop.is_set():
                    return False
                with self._changed:
                    self._tokens[segment].append(int(token))
                    self._token_times[segment].append(time.perf_counter())
                    self._llm_seconds[segment] = time.perf_counter() - started - held
                    self._changed.notify_all()
                if not self._may_decode.is_set():
                    paused = time.perf_counter()
                    self._may_decode.wait()
                    held += time.perf_counter() - paused
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        with self._changed:
            self._finished[segment] = True
            self._llm_seconds[segment] = time.perf_counter() - started - held
            self._changed.notify_all()
        return not self._stop.is_set()


_LIVE_FEEDS: weakref.WeakSet[TokenFeed] = weakref.WeakSet()


@atexit.register
def _close_live_feeds() -> None:
    """Stop and join every LLM worker at interpreter exit, before daemon threads are frozen: a worker
    frozen inside a graph run (a prefill, an unbatched decode step) aborts the process (SIGABRT), e.g.
    when a program is interrupted while its requests decode. ``stages.llm_batch`` stops the decode loops."""
    feeds = list(_LIVE_FEEDS)
    for feed in feeds:
        feed.cancel()
    for feed in feeds:
        feed.close()
