"""Admission by expected work in the Triton model: the rule of ``trt-cosy serve`` (``server.admission``).

The decoupled model (``triton_model``) judges each request as it arrives: its work estimated from its
planned text (``server.work_model``), the instance's measured speed (warm-up, then finished
requests) and the work the instance already admitted. What cannot finish within its timeout is
answered at once with an error instead of being started: ``UNAVAILABLE`` (HTTP 503, gRPC
UNAVAILABLE: try again later or on another instance/server; the message says in how many seconds)
or ``INVALID_ARG`` (HTTP 400, gRPC INVALID_ARGUMENT: the text could never finish within the timeout
here, even alone; the message names the limit to raise). Triton's Python backend has no error code
for "too large" (its codes are UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED,
ALREADY_EXISTS, CANCELLED), and retrying such a request unchanged never helps, so it is a bad argument.

This module holds no Triton import: ``TritonWork`` is thread-safe (Triton's ``execute`` thread admits,
the instance's worker threads report progress) and tests drive it with fake engines and clocks.
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import astuple
from typing import Any, Final, Protocol

from ..errors import TrtCosyError
from ..server.admission import AdmittedJob, Refusal, render_priority
from ..server.work_model import WarmupRun, chunk_work, segment_tokens_of, work_admission_for

__all__ = [
    "AdmissionRefused",
    "RequestTimedOut",
    "TritonWork",
    "TritonTicket",
    "WorkEvents",
    "PriorityWorkers",
    "TIMEOUT_SETTING",
]

_LOGGER = logging.getLogger(__name__)

TIMEOUT_SETTING: Final = "`trt-cosy triton-repo --timeout`, the model's request_timeout_s parameter"


class AdmissionRefused(TrtCosyError):
    """A request that admission by expected work does not start (``refusal`` says why)."""

    def __init__(self, refusal: Refusal):
        super().__init__(refusal.message)
        self.refusal = refusal
        self.code = "UNAVAILABLE" if refusal.status == 503 else "INVALID_ARG"
        """The ``pb_utils.TritonError`` code: UNAVAILABLE (retry later) or INVALID_ARG (never here)."""


class RequestTimedOut(TrtCosyError):
    """An admitted request still running at its deadline (the estimate was wrong): it is stopped."""

    code = "UNAVAILABLE"


class WorkEvents(Protocol):
    """Where the admission's numbers go (Triton's custom metrics in ``triton_model``)."""

    def refused(self, reason: str) -> None: ...

    def queued(self, seconds: float) -> None: ...

    def completed(self, estimated_s: float, actual_s: float) -> None: ...

    def admitted_work(self, seconds: float) -> None: ...


class _NoEvents:
    def refused(self, reason: str) -> None:
        pass

    def queued(self, seconds: float) -> None:
        pass

    def completed(self, estimated_s: float, actual_s: float) -> None:
        pass

    def admitted_work(self, seconds: float) -> None:
        pass


class TritonTicket:
    """An admitted request's place in the admission (a no-op when untracked). Thread-safe."""

    def __init__(self, work: TritonWork | None = None, job: AdmittedJob | None = None):
        self._work, self._job = work, job

    @property
    def priority(self) -> tuple[int, int, int]:
        """Its place in the instance's run order (``render_priority``; untracked: after the rest)."""
        return render_priority(self._job) if self._job is not None else (2, 0, 0)

    def start(self) -> None:
        """The request got a worker and runs now."""
        if self._work is None or self._job is None:
            return
        with self._work.lock:
            self._work.policy.start(self._job)
            queue_s = self._job.queue_s
        if queue_s is not None:
            self._work.emit("queued", queue_s)

    def progress(self, chunk: Any) -> None:
        """The request produced ``chunk`` (an ``AudioChunk``)."""
        if self._work is None or self._job is None:
            return
        tokens, render_s = chunk_work(chunk)
        with self._work.lock:
            self._work.policy.progress(self._job, tokens, True, render_s)

    def close(self, completed: bool) -> None:
        """The request ended (idempotent): ``completed`` with all its audio, or stopped early."""
        if self._work is None or self._job is None:
            return
        job = self._job
        with self._work.lock:
            if job.finished:
                return
            self._work.policy.finish(job, completed)
            ahead = self._work.policy.work_ahead_s()
        self._work.emit("admitted_work", ahead)
        if completed and job.speech_tokens > 0 and math.isfinite(job.estimated_s) and job.estimated_s > 0:
            self._work.emit("completed", job.estimated_s, job.work_s)


class TritonWork:
    """Admission by expected work for one Triton model instance.

    Args:
        tts: the loaded engine (its ``model.config`` gives the family's ratios).
        timeout_s: the time a request may take from arrival to its last audio (the model's
            ``request_timeout_s``); a request's own Triton timeout, when shorter, is used instead.
        enabled: False admits everything untracked (``--no-work-admission``).
        events: where refusals, queue times and estimates go.
        clock: monotonic seconds; tests pass a fake.
    """

    def __init__(
        self,
        tts: Any,
        timeout_s: float,
        enabled: bool = True,
        events: WorkEvents | None = None,
        clock: Callable[[], float] | None = None,
    ):
        self.policy = work_admission_for(tts, clock, timeout_setting=TIMEOUT_SETTING)
        self.timeout_s = timeout_s
        self.enabled = enabled
        self.events: WorkEvents = events if events is not None else _NoEvents()
        self.lock = threading.Lock()

    def calibrate(self, runs: Iterable[WarmupRun]) -> None:
        """Set the speeds from the warm-up's syntheses (each measured alone)."""
        with self.lock:
            speed = self.policy.speed
            speed.calibrate_alone([astuple(run) for run in runs])
        _LOGGER.info(
            "work model: %.1f speech tokens per text token, %.1f ms per speech token (%.1f streamed)",
            speed.ratio,
            speed.seconds_per_token(False) * 1000,
            speed.seconds_per_token(True) * 1000,
        )

    def emit(self, event: str, *values: Any) -> None:
        """Tell ``events`` (a failing metric never fails the request)."""
        try:
            getattr(self.events, event)(*values)
        except Exception as exc:  # noqa: BLE001
            _LOGGER.warning("work admission metric %s failed: %s", event, exc)

    def timeout_for(self, request_timeout_us: int | None) -> float:
        """The seconds a request has: the model's timeout, or the request's own when shorter."""
        if request_timeout_us and request_timeout_us > 0:
            return min(self.timeout_s, request_timeout_us / 1e6)
        return self.timeout_s

    def admit(self, chunks: Any, streaming: bool, timeout_s: float | None = None) -> TritonTicket:
        """Admit the request whose planned synthesis is ``chunks`` (``CosyVoice.synthesize``'s iterator).

        Raises:
            AdmissionRefused: it would not finish within ``timeout_s`` (default: the model's) given the
                admitted work (code UNAVAILABLE, with the seconds to wait), or not even alone
                (INVALID_ARG, naming the limit to raise).
        """
        segments = segment_tokens_of(chunks)
        if not self.enabled or segments is None:
            return TritonTicket()
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self.lock:
            decision = self.policy.admit(segments, streaming, timeout_s)
            ahead = self.policy.work_ahead_s()
        self.emit("admitted_work", ahead)
        if isinstance(decision, Refusal):
            self.emit("refused", decision.reason)
            _LOGGER.info(
                "refused a request (%s, expected %.1f s of work, %.1f s admitted ahead): %s",
                decision.reason,
                decision.estimated_s,
                ahead,
                decision.message,
            )
            raise AdmissionRefused(decision)
        request = getattr(chunks, "request", None)
        if request is not None:  # the engine serves the heavy stages in admission order
            request.render_priority = render_priority(decision)
        return TritonTicket(self, decision)


class PriorityWorkers:
    """``workers`` threads that run submitted tasks, lowest priority first (then first submitted).

    The Triton model runs each admitted request here in ``TritonTicket.priority`` order: the order
    ``WorkOrder`` predicted when it admitted them.
    """

    _STOP: Final = (9,)  # after every request

    def __init__(self, workers: int, name: str = "trt-cosy-worker"):
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{index}", daemon=True)
            for index in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, priority: tuple[int, ...], task: Callable[[], None]) -> None:
        self._queue.put((priority, next(self._order), task))

    def _loop(self) -> None:
        while True:
            _, _, task = self._queue.get()
            if task is None:
                return
            try:
                task()
            except Exception:  # noqa: BLE001 - a task answers its own request; the worker stays
                _LOGGER.exception("a request's task failed")

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued tasks, then stop the threads (waits up to ``timeout_s`` for each)."""
        for _ in self._threads:
            self._queue.put((self._STOP, next(self._order), None))
        for thread in self._threads:
            thread.join(timeout_s)
