"""Prometheus metrics with ``prometheus-client``: one registry per app, so two apps in a process
(tests, a Ray Serve replica beside another) never share counts.

``GET /metrics`` answers in the format the scraper asks for (``exposition_for``): the text format
0.0.4 by default, OpenMetrics when the ``Accept`` header names it.
"""

from __future__ import annotations

import logging
import time
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder

from .http_middleware import HTTPMiddleware

__all__ = ["Metrics", "MetricsMiddleware", "path_label", "exposition_for"]

_LOGGER = logging.getLogger(__name__)

_LATENCY_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_RTF_BUCKETS: Final = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0, 10.0)
_WORK_BUCKETS: Final = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_RATIO_BUCKETS: Final = (0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0)
_NAMESPACE: Final = "trt_cosy"
_KNOWN_PATHS: Final = frozenset(
    ("/", "/v1/audio/speech", "/tts", "/v1/models", "/v1/voices", "/health", "/metrics")
)


class Metrics:
    """Every metric the server exports, registered in ``self.registry`` (this instance's own)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        common = {"namespace": _NAMESPACE, "registry": self.registry}

        def counter(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, documentation, labels, **common)

        def gauge(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, documentation, labels, **common)

        def histogram(name: str, documentation: str, buckets: tuple[float, ...], labels=()) -> Histogram:
            return Histogram(name, documentation, labels, buckets=buckets, **common)

        self.requests = counter("http_requests", "HTTP requests answered, by path and status.", ("path", "status"))
        self.errors = counter("http_errors", "Requests answered with an error, by path and code.", ("path", "code"))
        self.latency = histogram(
            "http_request_duration_seconds",
            "Time from request to the last response byte, by path.",
            _LATENCY_BUCKETS,
            ("path",),
        )
        self.first_audio = histogram(
            "time_to_first_audio_seconds", "Time from request to the first synthesised audio.", _LATENCY_BUCKETS
        )
        self.rtf = histogram(
            "rtf", "Real-time factor of each synthesis (compute time / audio time).", _RTF_BUCKETS
        )
        self.audio_seconds = counter("audio_seconds", "Seconds of audio synthesised.")
        self.encode_cpu = counter(
            "encode_cpu_seconds", "CPU seconds spent encoding streamed answers, by response format.", ("format",)
        )
        self.cancelled = counter("syntheses_cancelled", "Syntheses stopped early, by reason.", ("reason",))
        self.queue_depth = gauge("queue_depth", "Requests waiting for a synthesis slot.")
        self.active = gauge("active_requests", "Syntheses (and voice uploads) running now.")
        self.ready = gauge("ready", "1 once warm-up has finished, else 0.")
        # Admission by expected work (server.work_admission).
        self.admission_refused = counter(
            "admission_refused",
            "Requests refused at once by admission by expected work, by reason "
            "(overloaded, cannot_keep_up: 503; too_long: 413).",
            ("reason",),
        )
        self.work_estimated = histogram(
            "work_estimated_seconds",
            "Expected machine seconds of each completed request, when it was admitted.",
            _WORK_BUCKETS,
        )
        self.work_actual = histogram(
            "work_actual_seconds",
            "Machine seconds each completed request took (the busy time shared among those running).",
            _WORK_BUCKETS,
        )
        self.work_ratio = histogram(
            "work_estimate_ratio", "Actual over expected work of each completed request.", _RATIO_BUCKETS
        )
        self.queue_seconds = histogram(
            "queue_seconds", "Time from admission to the start of synthesis (waiting for a slot).", _LATENCY_BUCKETS
        )
        self.admitted_work = gauge(
            "admitted_work_seconds", "Expected machine seconds of the admitted work still to do."
        )
        self.admission_margin = gauge(
            "admission_margin",
            "Share of its timeout a request's predicted finish may use now (learnt from completed requests).",
        )
        self.seconds_per_token = gauge(
            "seconds_per_speech_token",
            "Measured machine seconds per speech token, by mode (whole, streamed).",
            ("mode",),
        )
        self.speech_text_ratio = gauge("speech_text_ratio", "Learnt speech tokens per text token.")


def exposition_for(metrics: Metrics, accept: str) -> tuple[bytes, str]:
    """The ``GET /metrics`` body and its content type for a request's ``Accept`` header."""
    encoder, content_type = choose_encoder(accept)
    return encoder(metrics.registry), content_type


def path_label(path: str) -> str:
    """A bounded set of path labels: the route, never the raw path (voice names stay out)."""
    if path in _KNOWN_PATHS:
        return path
    if path.startswith("/v1/voices/"):
        return "/v1/voices/{name}"
    return "other"


class MetricsMiddleware(HTTPMiddleware):
    """ASGI middleware: counts every HTTP request and times it to its last body byte."""

    def __init__(self, app, metrics: Metrics):
        super().__init__(app)
        self.metrics = metrics

    async def handle(self, scope, receive, send) -> None:
        started = time.perf_counter()
        path = path_label(scope.get("path", ""))
        status = [500]

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self.metrics.requests.labels(path, str(status[0])).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - started)
