"""The server's admission by expected work (``server.admission``): estimate, refuse, track, learn.

``ServerWork.admit`` runs after a request's text has been planned (its segments tokenised) and before
it waits for a synthesis slot: it refuses with 503 + ``Retry-After`` (or 413 when the text could
never finish within the timeout here) what would not finish in time, and gives an admitted request
its place in the engine's render order. The ``WorkTicket`` it returns follows the request: started
when it gets its slot, fed each chunk's speech tokens, closed when it ends (a completed request
teaches the model its speed). Everything runs on the event loop.

Metrics: ``admission_refused{reason}``, ``work_estimated_seconds`` / ``work_actual_seconds`` /
``work_estimate_ratio`` (per completed request), ``queue_seconds``, ``admitted_work_seconds``,
``admission_margin``, ``seconds_per_speech_token{mode}`` and ``speech_text_ratio``. The access log line of a refused
request ends with the reason (``access_log.REASON_KEY``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, MutableMapping
from dataclasses import astuple
from typing import Any

from ..synthesis import AudioChunk
from .access_log import REASON_KEY
from .admission import AdmittedJob, Refusal, render_priority
from .errors import APIError
from .metrics import Metrics
from .settings import ServerSettings
from .work_model import WarmupRun, chunk_work, segment_tokens_of, work_admission_for

__all__ = ["ServerWork", "WorkTicket", "WarmupRun", "segment_tokens_of"]

_LOGGER = logging.getLogger(__name__)


class WorkTicket:
    """An admitted request's place in the work admission; a no-op when the request is untracked."""

    def __init__(self, work: ServerWork | None = None, job: AdmittedJob | None = None):
        self._work, self._job = work, job

    def start(self) -> None:
        """The request got its synthesis slot."""
        if self._work is not None and self._job is not None:
            self._work.policy.start(self._job)
            if self._job.queue_s is not None:
                self._work.metrics.queue_seconds.observe(self._job.queue_s)

    def progress(self, chunk: AudioChunk) -> None:
        if self._work is not None and self._job is not None:
            tokens, render_s = chunk_work(chunk)
            # A non-streamed chunk is a whole segment (a streamed request's segment costs are not counted).
            self._work.policy.progress(self._job, tokens, True, render_s)

    def close(self, completed: bool) -> None:
        """The request ended (idempotent): ``completed`` with all its audio, or stopped early."""
        if self._work is None or self._job is None or self._job.finished:
            return
        job = self._job
        self._work.policy.finish(job, completed)
        self._work.publish()
        if completed and job.speech_tokens > 0 and math.isfinite(job.estimated_s) and job.estimated_s > 0:
            metrics = self._work.metrics
            metrics.work_estimated.observe(job.estimated_s)
            metrics.work_actual.observe(job.work_s)
            metrics.work_ratio.observe(job.work_s / job.estimated_s)


class ServerWork:
    """Admission by expected work for one server (``settings.work_admission``).

    Args:
        tts: the loaded engine; its ``model.config`` gives the family's ratios and token rate
            (an engine without one gets CosyVoice2's).
        settings: ``request_timeout_s`` and ``work_admission``.
        metrics: where refusals, estimates and queue times go.
    """

    def __init__(self, tts: Any, settings: ServerSettings, metrics: Metrics, clock=None):
        self.policy = work_admission_for(tts, clock)
        self.enabled = settings.work_admission
        self.timeout_s = settings.request_timeout_s
        self.metrics = metrics

    def calibrate(self, runs: Iterable[WarmupRun]) -> None:
        """Set the speeds from the warm-up's syntheses (each measured alone)."""
        self.policy.speed.calibrate_alone([astuple(run) for run in runs])
        self.publish()
        speed = self.policy.speed
        _LOGGER.info(
            "work model: %.1f speech tokens per text token, %.1f ms per speech token (%.1f streamed)",
            speed.ratio,
            speed.seconds_per_token(False) * 1000,
            speed.seconds_per_token(True) * 1000,
        )

    def admit(
        self, scope: MutableMapping[str, Any], chunks: Any, streaming: bool, left_s: float
    ) -> WorkTicket:
        """Admit the request whose planned synthesis is ``chunks`` with ``left_s`` of its timeout left.

        Raises:
            APIError: 503 with ``Retry-After`` when it would not finish in time with the work admitted;
                413 when it could not even alone.
        """
        segments = segment_tokens_of(chunks)
        if not self.enabled or segments is None:
            return WorkTicket()
        decision = self._admitted(scope, self.policy.admit(segments, streaming, left_s))
        request = getattr(chunks, "request", None)
        if request is not None:  # the engine serves the heavy stages in admission order
            request.render_priority = render_priority(decision)
        self.publish()
        return WorkTicket(self, decision)

    def admit_conversion(
        self, scope: MutableMapping[str, Any], source_seconds: float, streaming: bool, left_s: float
    ) -> WorkTicket:
        """Admit a voice conversion of a ``source_seconds`` source (its speech tokens at the model's token
        rate; no LLM), as ``admit`` does a synthesis: 503 / 413 when it would not finish in time."""
        if not self.enabled:
            return WorkTicket()
        tokens = source_seconds * self.policy.tokens_per_audio_s
        decision = self._admitted(scope, self.policy.admit_speech(tokens, streaming, left_s))
        self.publish()
        return WorkTicket(self, decision)

    def _admitted(self, scope: MutableMapping[str, Any], decision: AdmittedJob | Refusal) -> AdmittedJob:
        """The admitted job, or the refusal raised as an ``APIError`` (503 + Retry-After, 413), counted and logged."""
        if isinstance(decision, Refusal):
            self.metrics.admission_refused.labels(decision.reason).inc()
            scope[REASON_KEY] = f"refused: {decision.reason} (expected {decision.estimated_s:.1f} s of work)"
            _LOGGER.info("refused a request (%s): %s", decision.reason, decision.message)
            headers = {} if decision.retry_after_s is None else {"Retry-After": str(decision.retry_after_s)}
            code = "input_too_long_for_timeout" if decision.status == 413 else "server_overloaded"
            raise APIError(decision.status, decision.message, code, headers=headers)
        return decision

    def publish(self) -> None:
        speed = self.policy.speed
        self.metrics.admitted_work.set(self.policy.work_ahead_s())
        self.metrics.admission_margin.set(self.policy.margin_now())
        self.metrics.speech_text_ratio.set(speed.ratio)
        for streaming, mode in ((False, "whole"), (True, "streamed")):
            if speed.known(streaming):
                self.metrics.seconds_per_token.labels(mode).set(speed.seconds_per_token(streaming))
